"""The scaling curve: real tau against GPU-minutes, one line per training set, from `bench/quality.py` results.

    python bench/curve.py RESULT.json ... [--regen ROWS=MINUTES ...] [--out curve.png]

Each result is one run; its x is the minutes it trained (`train_loop_s`, else its budget) plus the minutes its
data took to regenerate (`--regen`, keyed by the training set's row count, since a result made on a cached set
does not carry them). Runs on the same number of training rows form one line. Prints a markdown table (for
bench/RESULTS.md) and writes the figure; the last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402


def point(result: dict, regen_minutes: dict[int, float]) -> dict:
    rows = int(result["data"]["train_rows"])
    train_min = result["train_loop_s"] / 60 if result.get("train_loop_s") else float(result["budget_minutes"])
    return {"name": result["name"], "rows": rows, "train_min": train_min,
            "gpu_min": train_min + regen_minutes.get(rows, 0.0), "regen_known": rows in regen_minutes,
            "tau": result["tau"], "lookup": result["prompt_lookup_tau"], "ratio": result["tau"] / result["prompt_lookup_tau"],
            "commit": result.get("commit", "?")}


def table(points: list[dict]) -> str:
    lines = ["| training rows | run | commit | training min | GPU-min (with regeneration) | real tau | prompt lookup | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p["rows"], p["gpu_min"])):
        gpu = f"{p['gpu_min']:.1f}" if p["regen_known"] else f"{p['gpu_min']:.1f} + regeneration"
        lines.append(f"| {p['rows']:,} | {p['name']} | {p['commit']} | {p['train_min']:.1f} | {gpu} | {p['tau']:.2f} | "
                     f"{p['lookup']:.2f} | {p['ratio']:.2f}x |")
    return "\n".join(lines)


def figure(points: list[dict], out: Path) -> None:
    fig = Figure(figsize=(7.5, 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(alpha=0.3)
    lines = defaultdict(list)
    for p in points:
        lines[p["rows"]].append(p)
    for rows, pts in sorted(lines.items()):
        pts.sort(key=lambda p: p["gpu_min"])
        ax.plot([p["gpu_min"] for p in pts], [p["tau"] for p in pts], marker="o", label=f"{rows:,} training rows")
    lookup = sum(p["lookup"] for p in points) / len(points)
    ax.axhline(lookup, color="#8c8c8c", linestyle="--", label=f"prompt lookup ({lookup:.2f})")
    ax.axhline(2 * lookup, color="#c44e52", linestyle=":", label=f"2x prompt lookup ({2 * lookup:.2f})")
    ax.set_xlim(left=0)
    ax.set_xlabel("GPU-minutes (training, plus regeneration where known)")
    ax.set_ylabel("real tau, 40 held-out prompts")
    ax.legend(loc="best")
    fig.savefig(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--regen", action="append", default=[], help="ROWS=MINUTES: regeneration time of a training set")
    p.add_argument("--out", type=Path, default=Path("curve.png"))
    args = p.parse_args(argv)
    regen = {}
    for item in args.regen:
        rows, _, minutes = item.partition("=")
        try:
            regen[int(rows.replace(",", ""))] = float(minutes)
        except ValueError:
            raise SystemExit(f"--regen {item!r}: expected ROWS=MINUTES, e.g. 15763=1.6") from None
    points = [point(json.loads(path.read_text()), regen) for path in args.results]
    print(table(points))
    figure(points, args.out)
    print(f"figure: {args.out}")
    print(json.dumps({"bench": "curve", "points": points, "figure": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
