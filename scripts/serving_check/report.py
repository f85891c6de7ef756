"""Judging each (job, engine) and the table the check prints. Pure: no engine, no model."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Optional

import torch

TOLERANCE = 1e-4
"""Max |difference| of hidden states and logits (fp32) for a pass."""

PASS, FAIL, NOT_READ, REFUSED, CANNOT_SERVE = "PASS", "FAIL", "NOT READ", "REFUSED", "CANNOT SERVE"
"""NOT READ: the engine does not read this format (expected for SGLang and the speculators format). REFUSED: our
exporter refuses to write this drafter in this format (a mixed drafter in the speculators format). CANNOT SERVE: the
engine cannot serve this drafter with its target, as expected (`CANNOT_SERVE_EXPECTED`). None of them fails."""

NOT_READ_EXPECTED = {("sglang", "speculators")}

CANNOT_SERVE_EXPECTED = {("sglang", "qwen3-vl-image")}
"""(engine, drafter): SGLang 0.5.23 cannot capture a Qwen3-VL target's layers for DFlash (image_case.py)."""

TARGET_RUNNERS = {"vllm"}
"""Engines whose own target the check runs on a job's conversation (the image case), to compare its taps with ours."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    engine: str
    variant: str
    format: str
    drafter: str
    layers: str
    """The engine's causality per layer: N (non-causal) or C (causal), with its window (C4: a 4-token window)."""
    hidden_diff: Optional[float]
    logits_diff: Optional[float]
    selector_diff: Optional[float] = None
    """DFlash2: max |difference| of the selector's lattice of scores (the candidates must be the same); DSpark: of
    the Markov walk's scores (the drafts must be the same)."""
    taps_diff: Optional[float] = None
    """The image case: max |difference| of the engine's own target's taps of the conversation from our capture's."""
    result: str
    why: str = ""


def layers_text(layers: list) -> str:
    return " ".join(("C" if l["causal"] else "N") + (str(l["window"]) if l["window"] else "") for l in layers)


def judge(engine: str, job, result, reference, head: torch.Tensor, variant_classes: dict) -> Row:
    """job: jobs.Job; result: jobs.EngineResult, or None (refused by our exporter, or the engine's process died);
    reference: cases.Reference; head (V, H): the target's LM head; variant_classes: engine -> the class it must
    build."""
    base = dict(engine=engine, variant=job.variant, format=job.format, drafter=job.drafter)
    if job.refused:
        return Row(**base, layers="-", hidden_diff=None, logits_diff=None, result=REFUSED,
                   why="our exporter refuses it: " + job.refused.split(";")[0].split(": ")[0])
    if result is None or result.status == "error":
        return Row(**base, layers="-", hidden_diff=None, logits_diff=None, result=FAIL,
                   why=result.detail if result else "no result: the engine's process died (WORK/ENGINE.log, --keep)")
    if result.status == "refused":
        expected = (engine, job.drafter) in CANNOT_SERVE_EXPECTED
        return Row(**base, layers="-", hidden_diff=None, logits_diff=None, result=CANNOT_SERVE if expected else FAIL,
                   why=("the engine cannot serve it: " if expected else "unexpectedly refused: ") + result.detail)
    if result.status == "not-read":
        expected = (engine, job.format) in NOT_READ_EXPECTED
        return Row(**base, layers="-", hidden_diff=None, logits_diff=None, result=NOT_READ if expected else FAIL,
                   why=("not read by this engine: " if expected else "unexpectedly not read: ") + result.detail)
    out = torch.load(result.outputs)
    hidden_diff = float((out["hidden"].float() - reference.hidden).abs().max())
    logits_diff = float((out["logits"].float() - reference.hidden @ head.float().T).abs().max())
    problems = []
    if result.model_class != variant_classes[engine]:
        problems.append(f"built {result.model_class}, expected {variant_classes[engine]}")
    if result.layers != reference.layers:
        problems.append(f"layers {layers_text(result.layers)}, trained {layers_text(reference.layers)}")
    if result.taps != reference.taps:
        problems.append(f"taps {result.taps}, ours {reference.taps}")
    if result.block_size != job.block_size:
        problems.append(f"block {result.block_size}, ours {job.block_size}")
    if not max(hidden_diff, logits_diff) < TOLERANCE:
        problems.append(f"forward differs from ours by more than {TOLERANCE:g}")
    selector_diff = None
    if reference.selector is not None:
        if "lattice" not in out:
            problems.append("no selector output")
        elif not torch.equal(out["candidates"].long(), reference.selector["candidates"]):
            problems.append("selector candidates differ from ours")
        else:
            selector_diff = float((out["lattice"].float() - reference.selector["lattice"]).abs().max())
            if not selector_diff < TOLERANCE:
                problems.append(f"selector scores differ from ours by more than {TOLERANCE:g}")
            if "picks" in reference.selector and not torch.equal(out.get("picks", torch.empty(0)).long(),
                                                                 reference.selector["picks"]):
                problems.append("lattice walk's picks differ from ours")
    if reference.walk is not None:
        if "drafts" not in out:
            problems.append("no Markov walk output")
        elif not torch.equal(out["drafts"].long(), reference.walk["drafts"]):
            problems.append(f"Markov drafts {out['drafts'].tolist()}, ours {reference.walk['drafts'].tolist()}")
        else:
            selector_diff = float((out["scores"].float() - reference.walk["scores"]).abs().max())
            if not selector_diff < TOLERANCE:
                problems.append(f"Markov walk scores differ from ours by more than {TOLERANCE:g}")
    taps_diff = None
    if reference.target_taps is not None and engine in TARGET_RUNNERS:
        if "target_taps" not in out:
            problems.append("no taps of the engine's own target")
        else:
            taps_diff = float((out["target_taps"].float() - reference.target_taps).abs().max())
            if not taps_diff < TOLERANCE:
                problems.append(f"its target's taps differ from our capture's by more than {TOLERANCE:g}")
    return Row(**base, layers=layers_text(result.layers), hidden_diff=hidden_diff, logits_diff=logits_diff,
               selector_diff=selector_diff, taps_diff=taps_diff, result=FAIL if problems else PASS,
               why="; ".join(problems))


def table(rows: list[Row]) -> str:
    head = ("engine", "variant", "format", "drafter", "layers (engine)", "max|dh|", "max|dlogits|", "max|dsel|",
            "max|dtaps|", "result")
    body = [(r.engine, r.variant, r.format, r.drafter, r.layers, _num(r.hidden_diff), _num(r.logits_diff),
             _num(r.selector_diff), _num(r.taps_diff), r.result + (f": {r.why}" if r.why else "")) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *[b[:-1] + ("",) for b in body])]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells[:-1], widths)) + "  " + cells[-1]
    return "\n".join([line(head), line(tuple("-" * w for w in widths[:-1]) + ("------",))] + [line(b) for b in body])


def _num(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1e}"


def summary_json(rows: list[Row]) -> str:
    return json.dumps({"passed": all(r.result != FAIL for r in rows), "rows": [asdict(r) for r in rows]})
