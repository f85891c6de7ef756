"""N-GPU scaling of real training runs: split target:drafter ratios against N x one colocated GPU, same run.

    python bench/multi_gpu/scaling.py --gpus 8 --splits 3,4       # 8 GPUs: 1 GPU colocated, then 3:5 and 4:4 split
    python bench/multi_gpu/scaling.py --gpus 2 --splits 1 --colocated-n
    python bench/multi_gpu/scaling.py --gpus 4 --splits 1 --target-parallel 1,2   # 1:3 split, then one TP=2 group : 2
    python bench/multi_gpu/scaling.py --smoke                     # CPU + gloo, tiny target: 1 colocated, 1:2 split

Each run is the real `dflash-train train` (one process for one GPU, `torchrun` on one host for N), on the
bundled ShareGPT data, with a random-weight target of the chosen preset, the DFlash 8B drafter shape and
the target's layers compiled. Throughput is steady state: the tokens of the last half of the optimizer
steps in `metrics.jsonl` over the wall time they took (compilation and the first steps excluded); the
efficiency of an N-rank run is its tokens/s over N x the one-GPU colocated run's. The issue's target:
the best split >= 0.9. Each run's summary (I, T, drafter wait, target idle) comes from `summary.json`.
The last line printed is JSON, also written to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import ROOT, free_port, git_commit, write_result

GPU_OVERRIDES = [
    "run.device=cuda", "target.random_init=qwen3-8b", "target.dtype=bfloat16", "target.compile=true",
    "train.dtype=bfloat16", "drafter.num_layers=5", "drafter.block_size=16", "drafter.tap_layer_ids=[1,9,17,25,33]",
    "drafter.mask_token_id=151669", "drafter.loss_chunk_rows=2048", "pipeline.token_budget=12288",
    "data.max_length=3072", "data.max_conversations=4000", "train.num_epochs=1", "train.checkpoint_interval=100000",
    "eval.at_end=false", "logging.progress=false",
]
SMOKE_OVERRIDES = ["data.max_conversations=120", "train.num_epochs=1", "train.checkpoint_interval=100000",
                   "eval.at_end=false", "logging.progress=false"]


def launch(ranks: int, overrides: list[str], run_dir: Path, timeout_s: float) -> tuple[int, str, float]:
    """(exit status, output tail, seconds) of one training run with `ranks` processes."""
    if ranks == 1:
        head = [sys.executable, "-m", "dflash_trainer"]
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "dflash_trainer"]
    cmd = [*head, "train", "--config", "demo", *overrides, f"run.dir={run_dir}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out[-3000:], time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun stops its workers (they run in sessions of their own), then the group goes.
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=30)
        return 124, (out or "")[-3000:], time.perf_counter() - t0


def steady_tokens_per_s(run_dir: Path) -> tuple[float | None, int]:
    """(tokens/s over the last half of the optimizer steps, steps logged) from metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None, 0
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if "tokens" in r and "time" in r]
    if len(rows) < 4:
        return None, len(rows)
    first = len(rows) // 2
    seconds = rows[-1]["time"] - rows[first - 1]["time"]
    tokens = sum(r["tokens"] for r in rows[first:])
    return (tokens / seconds if seconds > 0 else None), len(rows)


def run_one(name: str, ranks: int, overrides: list[str], out_dir: Path, timeout_s: float) -> dict:
    run_dir = out_dir / name.replace(" ", "_").replace(":", "-")
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {ranks} rank(s)", flush=True)
    rc, tail, seconds = launch(ranks, overrides, run_dir, timeout_s)
    tps, steps = steady_tokens_per_s(run_dir)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if rc != 0:
        print(tail, file=sys.stderr)
    return {"name": name, "ranks": ranks, "rc": rc, "seconds": seconds, "steps": steps,
            "steady_tokens_per_s": tps, "status": summary.get("status"), "roles": summary.get("roles"),
            **{k: summary.get(k) for k in ("I_tokens_per_s", "T_tokens_per_s", "overall_tokens_per_s",
                                           "drafter_wait_frac", "target_idle_frac")}}


def run_plan(args: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    """(name, ranks, overrides) of each run: one GPU colocated first (the baseline), then each split once per
    target_parallel value that leaves a drafter rank, then N colocated if asked."""
    plan = [("1 colocated", 1, ["pipeline.colocated=true"])]
    for t in (int(x) for x in args.splits.split(",") if x.strip()):
        if not 0 < t < args.gpus:
            raise SystemExit(f"--splits {t}: a split needs 1..{args.gpus - 1} target ranks")
        for k in (int(x) for x in args.target_parallel.split(",") if x.strip()):
            if t * k >= args.gpus:
                print(f"--splits {t} with --target-parallel {k}: {t * k} target ranks leave no drafter rank of "
                      f"{args.gpus}; skipped", file=sys.stderr)
                continue
            name = f"{t}:{args.gpus - t * k} split" if k == 1 else f"{t}xTP{k}:{args.gpus - t * k} split"
            plan.append((name, args.gpus, ["pipeline.colocated=false", f"pipeline.num_targets={t}",
                                           f"pipeline.target_parallel={k}"]))
    if args.colocated_n:
        plan.append((f"{args.gpus} colocated", args.gpus, ["pipeline.colocated=true"]))
    return plan


def add_run_arguments(p: argparse.ArgumentParser, *, steps: int, work_dir: str) -> None:
    """The options of a bench made of `run_one` runs: their steps, time limit, result and run folders."""
    p.add_argument("--steps", type=int, default=steps, help="train.max_steps of every run")
    p.add_argument("--timeout-s", type=float, default=540.0, help="per run")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "multi_gpu"))
    p.add_argument("--work-dir", default=work_dir)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=8, help="ranks of the N-rank runs")
    p.add_argument("--splits", default="", help="comma list of target-rank counts for split runs (e.g. 3,4)")
    p.add_argument("--target-parallel", default="1",
                   help="comma list of pipeline.target_parallel values: each split runs once per value, its target "
                   "groups of that many ranks (e.g. 1,2: TP=2 groups against single-GPU targets)")
    p.add_argument("--colocated-n", action="store_true", help="also run N ranks colocated")
    add_run_arguments(p, steps=40, work_dir="/tmp/dflash-scaling")
    p.add_argument("--smoke", action="store_true", help="CPU + gloo, tiny target: 1 colocated vs a 1:2 split")
    args = p.parse_args(argv)
    if args.smoke:
        args.gpus, args.splits, args.steps = 3, args.splits or "1", min(args.steps, 8)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    common = (SMOKE_OVERRIDES if args.smoke else GPU_OVERRIDES) + [f"train.max_steps={args.steps}"]
    work = Path(args.work_dir) / datetime.now().strftime("%Y%m%dT%H%M%S")
    plan = run_plan(args)
    results = [run_one(name, ranks, common + extra, work, args.timeout_s) for name, ranks, extra in plan]
    single = results[0]["steady_tokens_per_s"]
    for r in results:
        tps = r["steady_tokens_per_s"]
        r["efficiency"] = tps / (r["ranks"] * single) if tps and single else None

    def fmt(x, spec):
        return format(x, spec) if x is not None else "-"

    print(f"\nscaling ({'CPU smoke' if args.smoke else 'GPU'}; {args.steps} steps per run; steady = last half)")
    print(f"{'run':<18}{'ranks':>6}{'tokens/s':>11}{'vs N x 1':>10}{'I tok/s':>10}{'T tok/s':>10}{'wait':>7}"
          f"{'idle':>7}  status")
    for r in results:
        print(f"{r['name']:<18}{r['ranks']:>6}{fmt(r['steady_tokens_per_s'], '.0f'):>11}"
              f"{fmt(r['efficiency'], '.2f'):>10}{fmt(r['I_tokens_per_s'], '.0f'):>10}"
              f"{fmt(r['T_tokens_per_s'], '.0f'):>10}{fmt(r['drafter_wait_frac'], '.2f'):>7}"
              f"{fmt(r['target_idle_frac'], '.2f'):>7}  {r['status'] or r['rc']}")
    result = {"bench": "scaling", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "smoke": args.smoke, "gpus": args.gpus,
              "steps": args.steps, "command": " ".join([sys.executable, *sys.argv]), "results": results}
    write_result(result, "scaling", str(args.gpus), args.out)
    print(json.dumps(result))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
