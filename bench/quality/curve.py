"""The scaling curve: real tau against GPU-minutes, one line per training set, from `bench/quality/quality.py` results.

    python bench/quality/curve.py RESULT.json ... [--regen ROWS=MINUTES ...] [--label ROWS=TEXT ...] [--out curve.png]

Each result is one run; its x is the minutes it trained (`train_loop_s`, else its budget) plus the minutes its
data took to regenerate (`--regen`, keyed by the training set's row count, since a result made on a cached set
does not carry them). Runs on the same number of training rows form one line. Evaluations made during a run
(`eval.interval`) are drawn too, hollow, at the run's minutes times their share of its steps: they come from a
schedule whose lr has not yet decayed, so they sit below what a run of that budget would give. Prints a markdown
table (for bench/RESULTS.md) and writes the figure; the last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import or_dash  # noqa: E402  (bench/common.py)
from matplotlib.figure import Figure  # noqa: E402


def run_points(result: dict, regen_minutes: dict[int, float]) -> list[dict]:
    """The run's end point, then one per evaluation made before its last step (`during`: the step it was at)."""
    rows = int(result["data"]["train_rows"])
    train_min = result["train_loop_s"] / 60 if result.get("train_loop_s") else float(result["budget_minutes"])

    def at(minutes: float, tau: float, lookup: float | None, during: int | None) -> dict:
        return {"name": result["name"], "rows": rows, "train_min": minutes, "during": during,
                "gpu_min": minutes + regen_minutes.get(rows, 0.0), "regen_known": rows in regen_minutes,
                "tau": tau, "lookup": lookup, "ratio": tau / lookup if lookup else None,
                "commit": result.get("commit", "?")}

    steps = result.get("steps") or 0
    earlier = [e for e in result.get("evals") or [] if e.get("eval_tau") and steps and e["step"] < steps]
    return [at(train_min, result["tau"], result["prompt_lookup_tau"], None)] + [
        at(train_min * e["step"] / steps, e["eval_tau"], e.get("eval_prompt_lookup_tau"), e["step"]) for e in earlier]


def table(points: list[dict]) -> str:
    lines = ["| training rows | run | commit | training min | GPU-min (with regeneration) | real tau | prompt lookup | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (p["rows"], p["gpu_min"])):
        gpu = f"{p['gpu_min']:.1f}" if p["regen_known"] else f"{p['gpu_min']:.1f} + regeneration"
        name = p["name"] if p["during"] is None else f"{p['name']} (at step {p['during']:,})"
        lines.append(f"| {p['rows']:,} | {name} | {p['commit']} | {p['train_min']:.1f} | {gpu} | {p['tau']:.2f} | "
                     f"{or_dash(p['lookup'])} | {or_dash(p['ratio'])}x |")
    return "\n".join(lines)


def figure(points: list[dict], out: Path, labels: dict[int, str]) -> None:
    fig = Figure(figsize=(7.5, 4.2), dpi=110, layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    ax.grid(alpha=0.3)
    lines = defaultdict(list)
    for p in points:
        lines[p["rows"]].append(p)
    for rows, pts in sorted(lines.items()):
        ends = sorted((p for p in pts if p["during"] is None), key=lambda p: p["gpu_min"])
        line = ax.plot([p["gpu_min"] for p in ends], [p["tau"] for p in ends], marker="o", label=labels.get(rows, f"{rows:,} training rows"))
        for name in dict.fromkeys(p["name"] for p in pts if p["during"] is not None):
            run = sorted((p for p in pts if p["name"] == name), key=lambda p: p["gpu_min"])
            ax.plot([p["gpu_min"] for p in run], [p["tau"] for p in run], marker="o", markerfacecolor="none",
                    linestyle=":", color=line[0].get_color(), label=f"{name}, during training")
    lookups = [p["lookup"] for p in points if p["during"] is None and p["lookup"]]  # one per run
    if lookups:
        lookup = sum(lookups) / len(lookups)
        ax.axhline(lookup, color="#8c8c8c", linestyle="--", label=f"prompt lookup ({lookup:.2f})")
        ax.axhline(2 * lookup, color="#c44e52", linestyle=":", label=f"2x prompt lookup ({2 * lookup:.2f})")
    ax.set_xlim(left=0)
    ax.set_xlabel("GPU-minutes (training, plus regeneration where known)")
    ax.set_ylabel("real tau, 40 held-out prompts")
    ax.legend(loc="best")
    fig.savefig(out)


def by_rows(items: list[str], convert, flag: str, expected: str) -> dict:
    """`ROWS=VALUE` items keyed by their row count."""
    out = {}
    for item in items:
        rows, _, value = item.partition("=")
        try:
            out[int(rows.replace(",", ""))] = convert(value)
        except ValueError:
            raise SystemExit(f"{flag} {item!r}: expected {expected}") from None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--regen", action="append", default=[], help="ROWS=MINUTES: regeneration time of a training set")
    p.add_argument("--label", action="append", default=[], help="ROWS=TEXT: the figure's name for a training set")
    p.add_argument("--out", type=Path, default=Path("curve.png"))
    args = p.parse_args(argv)
    regen = by_rows(args.regen, float, "--regen", "ROWS=MINUTES, e.g. 15763=1.6")
    labels = by_rows(args.label, str, "--label", "ROWS=TEXT, e.g. 15763=first turns")
    all_points = [p for path in args.results for p in run_points(json.loads(path.read_text()), regen)]
    print(table(all_points))
    figure(all_points, args.out, labels)
    print(f"figure: {args.out}")
    print(json.dumps({"bench": "curve", "points": all_points, "figure": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
