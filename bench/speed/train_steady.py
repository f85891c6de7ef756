"""Steady-state throughput of a finished `dflash-train train` run, from its `metrics.jsonl` (one record a step).

    python bench/speed/train_steady.py RUN_DIR [RUN_DIR ...] [--skip 40]

Per run: the tokens trained after the first `--skip` records (compile and warm-up excluded) over the wall time
between those records' timestamps, and the mean drafter wait per step. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def steady(run_dir: Path, skip: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "tokens" in r and "time" in r]
    if len(records) < skip + 2:
        raise SystemExit(f"{run_dir}: {len(records)} step records, need more than --skip {skip} + 1 "
                         "(train longer: raise train.max_steps)")
    window = records[skip:]
    seconds = window[-1]["time"] - window[0]["time"]
    if seconds <= 0:
        raise SystemExit(f"{run_dir}: the steady window has no duration (timestamps {window[0]['time']} .. "
                         f"{window[-1]['time']}); lower --skip or train longer")
    tokens = sum(r["tokens"] for r in window[1:])  # tokens trained between the first and last timestamps
    return {
        "run": str(run_dir), "steps": len(records), "steady_steps": len(window) - 1,
        "steady_tokens_per_s": tokens / seconds,
        "mean_step_s": seconds / (len(window) - 1),
        "mean_wait_s": sum(r.get("wait_time_s", 0.0) for r in window[1:]) / (len(window) - 1),
        "first_steps_s": window[0]["time"] - records[0]["time"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--skip", type=int, default=40, help="records left out at the start (compile, warm-up)")
    args = p.parse_args(argv)
    rows = [steady(run, args.skip) for run in args.runs]
    print(f"{'run':<28}{'steps':>7}{'tokens/s':>11}{'step s':>9}{'wait s':>9}{f'first {args.skip} s':>12}")
    for r in rows:
        print(f"{Path(r['run']).name:<28}{r['steps']:>7}{r['steady_tokens_per_s']:>11.0f}{r['mean_step_s']:>9.3f}"
              f"{r['mean_wait_s']:>9.3f}{r['first_steps_s']:>12.1f}")
    print(json.dumps({"bench": "train_steady", "skip": args.skip, "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
