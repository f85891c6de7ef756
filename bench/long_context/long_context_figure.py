"""Memory and speed against sequence length at long context: a table and a figure from the JSONs of
`bench/long_context/long_context.py` (the drafter step alone, chunked and in one pass) and `bench/speed/run.py` (the whole step on
one sequence: target forward, then the drafter step).

    python bench/long_context/long_context_figure.py bench/results/long_context/*long_context*.json bench/results/long_context/*run-qwen3-8b-mfu.json \\
        [--model qwen3-8b] [--out bench/results/long_context/long-context-memory.png]

Only `run.py` results of one sequence a batch (`--seqs 1`) of at least `--min-length` tokens are long-context
points. Each point: its length, what ran, peak GPU memory, step time, tokens/s and MFU. The figure draws peak
memory against length per series, with the device's memory as a line: the chunked drafter step's memory should grow
with the context only (its blocks' share bounded by the chunk), the one-pass step's with the blocks too. Prints a
markdown table (for bench/RESULTS.md); the last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

DEVICE_GIB = 139.8
"""An H200's memory in GiB, drawn as the ceiling (the benches' `peak_gpu_mem_gb` are GiB too)."""


def points(paths: list[Path], model: str, min_length: int) -> list[dict]:
    """One row per measured (length, series) of `model`, from each result file's kind."""
    rows = []
    for path in paths:
        result = json.loads(path.read_text())
        if result.get("model") != model:
            continue
        common = {"commit": result.get("commit", "?")[:7], "file": path.name}
        if result.get("bench") == "long_context":
            for r in result["results"]:
                if r.get("peak_gpu_mem_gb") is None or r.get("step_ms") is None:
                    continue
                rows.append(common | {"length": r["length"], "series": f"drafter step, {r['mode']}",
                                      "peak_gb": r["peak_gpu_mem_gb"], "step_ms": r["step_ms"],
                                      "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"], "plan": r.get("plan", "")})
        elif result.get("bench") == "run" and result.get("status") == "ok":
            length = int(result["tokens_per_step"])
            if "1 sequences" not in result.get("workload_note", "") or length < min_length:
                continue
            target = "compiled" if result.get("compile_target") else "eager"
            rows.append(common | {"length": length, "series": f"whole step (target {target})",
                                  "peak_gb": result["peak_gpu_mem_gb"], "step_ms": result["step_ms"],
                                  "tokens_per_s": result["tokens_per_s"], "mfu": result["mfu"],
                                  "plan": f"target {result['target_mfu']:.1%} MFU, drafter "
                                          f"{result['drafter_step_mfu']:.1%}"})
    return sorted(rows, key=lambda r: (r["series"], r["length"]))


def table(rows: list[dict]) -> str:
    lines = ["| length | what | peak GiB | step ms | tokens/s | MFU | notes | commit |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['length']:,} | {r['series']} | {r['peak_gb']:.1f} | {r['step_ms']:,.0f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['plan']} | {r['commit']} |")
    return "\n".join(lines)


def draw(rows: list[dict], out: Path, model: str) -> None:
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for series in sorted({r["series"] for r in rows}):
        mine = [r for r in rows if r["series"] == series]
        ax.plot([r["length"] / 1024 for r in mine], [r["peak_gb"] for r in mine], marker="o", label=series)
    ax.axhline(DEVICE_GIB, color="grey", linestyle="--", linewidth=1, label="H200 memory")
    ax.set_xlabel("sequence length (K tokens)")
    ax.set_ylabel("peak GPU memory (GiB)")
    ax.set_title(f"Long context at the {model} shape, one sequence a step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--min-length", type=int, default=16384, help="shortest run.py sequence counted as long")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "long_context" / "long-context-memory.png")
    args = p.parse_args(argv)
    rows = points(args.results, args.model, args.min_length)
    if not rows:
        raise SystemExit(f"no long-context results of {args.model} in the files given")
    print(table(rows))
    draw(rows, args.out, args.model)
    print(json.dumps({"figure": str(args.out), "points": len(rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
