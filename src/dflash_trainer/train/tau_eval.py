"""Evaluation during training (colocated: the live drafter against the target this rank already holds):
held-out validation (teacher-forced metrics and walk tau, `eval/validation.py`), then real tau by
speculative decoding beside prompt lookup; checkpoint selection by real tau: the best drafter so far is
exported to `RUN_DIR/best/`.

Loss can keep falling while tau falls, so the drafter to ship is chosen on tau, not on loss.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from dflash_trainer.config import Config
from dflash_trainer.eval.drafter_eval import evaluate_drafter
from dflash_trainer.eval.evaluate import EvalReport, load_prompt_messages
from dflash_trainer.eval.stats import plus_minus
from dflash_trainer.eval.validation import HeldOutValidator, ValidationReport
from dflash_trainer.rundir import RunDir, write_atomic
from dflash_trainer.target.head import TargetHead

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class TauSummary:
    """The latest real-tau evaluation and the best so far (the run summary's `eval`; sent between ranks)."""

    step: int
    """Optimizer step of the latest evaluation."""
    tau: float
    tau_stderr: Optional[float]
    """Standard error of `tau` over the prompts (None under 2 prompts)."""
    greedy_match_rate: Optional[float]
    """Prompts whose speculative output equals plain target decoding (temperature 0), else None."""
    best_tau: float
    best_step: int
    best_dir: str
    """`RUN_DIR/best`: the best drafter by tau, in the inference format."""
    acceptance_histogram: list[int]
    prompt_lookup_tau: Optional[float] = None
    """Prompt lookup (no training) on the same prompts: the baseline."""
    val: Optional[dict] = None
    """The latest held-out validation (`ValidationReport` fields), or None without held-out replies."""


def summary_values(summary: TauSummary) -> dict:
    """The metrics row of one evaluation (`eval_*`, and `val_*` from the held-out validation)."""
    values = {"eval_tau": summary.tau, "eval_prompt_lookup_tau": summary.prompt_lookup_tau,
              "eval_greedy_match_rate": summary.greedy_match_rate}
    if summary.val is not None:
        val = summary.val
        values |= {"val_loss": val["loss"], "val_acc": val["accuracy"], "val_sim_tau": val["sim_tau"],
                   "val_walk_tau": val["walk_tau"], "val_slot_acc": [round(a, 4) for a in val["slot_accuracy"]]}
    return values


@dataclass
class TauRecord:
    step: int
    tau: float


class TauTracker:
    """Runs `evaluate_drafter` on the held-out prompts; remembers the best tau and exports that drafter."""

    def __init__(self, config: Config, *, target, tokenizer, head: TargetHead, prompts_path: Path, run_dir: Path,
                 validator: Optional[HeldOutValidator] = None) -> None:
        self.config = config
        self.validator = validator
        self.last_val: Optional[ValidationReport] = None
        self.target = target
        self.tokenizer = tokenizer
        self.head = head
        self.prompts = load_prompt_messages(prompts_path, config.eval.num_prompts)
        self.layout = RunDir(run_dir)
        self.history: list[TauRecord] = []
        self.best: Optional[TauRecord] = _saved_best(self.layout)
        """The best so far, over every session of the run: a resumed run starts from the drafter in `best/`."""
        self.last_report: Optional[EvalReport] = None

    def evaluate(self, model, step: int, *, export: Callable[[Path], object], sink=None,
                 blocks_per_chunk: Optional[int] = None) -> TauSummary:
        """Validation and real tau of `model` (a DFlashDrafter) at optimizer step `step`; `export(dir)` writes
        that drafter in the inference format (used when it is the best so far); `sink` logs the result (None:
        not logged here); `blocks_per_chunk`: the training step's chunk size (`HeldOutValidator.run`)."""
        if self.validator is not None:  # in the training mode: no recompile of a compiled training forward
            self.last_val = self.validator.run(model, blocks_per_chunk=blocks_per_chunk)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                report = evaluate_drafter(self.config, self.target, self.tokenizer, model, self.prompts, head=self.head)
        finally:
            model.train(was_training)
        self.history.append(TauRecord(step=step, tau=report.tau))
        self.last_report = report
        if self.best is None or report.tau > self.best.tau:
            self.best = TauRecord(step=step, tau=report.tau)
            self._save_best(export, step, report)
        summary = self.summary(step)
        if sink is not None:
            sink.log(step, summary_values(summary))
        log.info("step %d: real tau %.3f%s on %d held-out prompts in %.1f s (prompt lookup %s)%s", step, report.tau,
                 plus_minus(report.tau_stderr), report.prompts, report.seconds, _fmt(report.prompt_lookup_tau),
                 f", held-out walk tau {self.last_val.walk_tau:.3f}" if self.last_val is not None else "")
        return summary

    def finish(self, model, step: int, *, export: Callable[[Path], object], sink=None,
               blocks_per_chunk: Optional[int] = None) -> TauSummary:
        """Evaluate the final drafter (unless just done), write `RUN_DIR/eval.json`, return the summary entry."""
        if not self.history or self.history[-1].step != step:
            self.evaluate(model, step, export=export, sink=sink, blocks_per_chunk=blocks_per_chunk)
        return self.summary(step)

    def summary(self, step: int) -> TauSummary:
        """The latest evaluation (also written to `RUN_DIR/eval.json`) and the best so far."""
        report = self.last_report
        val = {"val": asdict(self.last_val)} if self.last_val is not None else {}
        write_atomic(self.layout.eval_json, json.dumps({"step": step, **report.to_json(), **val}, indent=2))
        return TauSummary(step=step, tau=report.tau, tau_stderr=report.tau_stderr,
                          greedy_match_rate=report.greedy_match_rate, best_tau=self.best.tau,
                          best_step=self.best.step, best_dir=str(self.layout.best),
                          acceptance_histogram=list(report.acceptance_histogram),
                          prompt_lookup_tau=report.prompt_lookup_tau,
                          val=asdict(self.last_val) if self.last_val is not None else None)

    def _save_best(self, export: Callable[[Path], object], step: int, report: EvalReport) -> None:
        best, tmp = self.layout.best, self.layout.best_tmp
        shutil.rmtree(tmp, ignore_errors=True)
        export(tmp)
        (tmp / "eval.json").write_text(json.dumps({"step": step, **report.to_json()}, indent=2))
        shutil.rmtree(best, ignore_errors=True)
        tmp.rename(best)


def _saved_best(layout: RunDir) -> Optional[TauRecord]:
    """The tau of the drafter in `RUN_DIR/best/` (its `eval.json`), or None when there is none (a new run, or an
    unreadable file: then the next evaluation is the best so far)."""
    try:
        saved = json.loads((layout.best / "eval.json").read_text())
        return TauRecord(step=int(saved["step"]), tau=float(saved["tau"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"
