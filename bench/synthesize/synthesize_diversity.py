"""How diverse self-made prompts are against a reference prompt set: distinct n-gram ratios and duplicate rates.

    python bench/synthesize/synthesize_diversity.py SYNTH [REFERENCE ...] [--num N] [--threshold 0.7]

Each input is what `data.path` takes (a `dflash-train synthesize` or `regenerate` output directory, a JSONL /
JSON / Parquet file of `messages` or `conversations` rows, or `sharegpt`); its prompts are the first user turns.
Every set is measured on its first N prompts (default: as many as the smallest set has), since distinct-n falls
as a set grows. Per set:
- distinct-n (n = 1, 2, 3): distinct word n-grams / all word n-grams over the set (Li et al. 2016), words of
  the normalised text (`synth/filters.normalise`);
- distinct-n at equal words (`d1@W`, `d2@W`, `d3@W`): the same over each set's first W words, W the smallest set's
  word count (distinct-n falls with the words a set holds, so sets of shorter prompts would look more diverse);
- exact duplicate rate: prompts whose normalised text came earlier in the set;
- near-duplicate rate: prompts whose word-bigram Jaccard similarity with an earlier one reaches `--threshold`
  (exact duplicates included), found as `synthesize` finds them (`synth/filters.NearDuplicates`).
Prints a table; the last line is JSON, also written to `--out DIR` (`<date>-synthesize-diversity.json`). CPU only,
seconds for 16K prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package

from dflash_trainer.data.config import DataSourceConfig  # noqa: E402
from dflash_trainer.data.rules import REGENERATE  # noqa: E402
from dflash_trainer.data.sources import load_source  # noqa: E402
from dflash_trainer.synth.filters import NearDuplicates, normalise  # noqa: E402


def prompts_of(path: str) -> list[str]:
    """The first user turn of every usable row of `path`, in order."""
    loaded = load_source(DataSourceConfig(path=path), purpose=REGENERATE)
    return [next(m.content for m in c.messages if m.role == "user") for c in loaded.conversations]


def distinct(prompts: list[str], n: int) -> float:
    grams = [tuple(words[i : i + n]) for words in (normalise(p).split() for p in prompts)
             for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def first_words(prompts: list[str], total: int) -> list[str]:
    """The prompts in order, cut so that they hold `total` words (the last one cut short)."""
    kept, left = [], total
    for prompt in prompts:
        words = normalise(prompt).split()[:left]
        kept.append(" ".join(words))
        left -= len(words)
        if left <= 0:
            break
    return kept


def duplicate_rates(prompts: list[str], threshold: float) -> tuple[float, float]:
    """(exact duplicate rate, near-duplicate rate) of `prompts` against the prompts before each."""
    seen: set[str] = set()
    near = NearDuplicates(threshold)
    exact = close = 0
    for prompt in prompts:
        key = normalise(prompt)
        if key in seen:
            exact += 1
            close += 1
            continue
        seen.add(key)
        close += near.add_if_new(prompt) is not None
    return exact / max(1, len(prompts)), close / max(1, len(prompts))


def measure(name: str, prompts: list[str], threshold: float) -> dict:
    exact, close = duplicate_rates(prompts, threshold)
    return {"set": name, "prompts": len(prompts),
            "mean_words": sum(len(normalise(p).split()) for p in prompts) / max(1, len(prompts)),
            "distinct_1": distinct(prompts, 1), "distinct_2": distinct(prompts, 2), "distinct_3": distinct(prompts, 3),
            "exact_dup_rate": exact, "near_dup_rate": close}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sets", nargs="+", help="the synthesized set first, then reference sets")
    parser.add_argument("--num", type=int, default=None, help="prompts per set (default: the smallest set's count)")
    parser.add_argument("--threshold", type=float, default=0.7, help="near-duplicate Jaccard threshold")
    parser.add_argument("--out", type=Path, default=None, help="folder for the result JSON (default: printed only)")
    args = parser.parse_args(argv)
    found = {path: prompts_of(path) for path in args.sets}
    empty = [path for path, prompts in found.items() if not prompts]
    if empty:
        raise SystemExit(f"no prompts in {', '.join(empty)}: give a dataset with user turns")
    num = args.num or min(len(p) for p in found.values())
    short = [f"{path} ({len(prompts)})" for path, prompts in found.items() if len(prompts) < num]
    if short:
        print(f"warning: fewer than --num {num} prompts in {', '.join(short)}: the sets are compared at unequal "
              "sizes, which flatters the smaller one's distinct-n", file=sys.stderr)
    rows = [measure(path, prompts[:num], args.threshold) for path, prompts in found.items()]
    words = min(round(r["mean_words"] * r["prompts"]) for r in rows)
    for row, prompts in zip(rows, found.values()):
        cut = first_words(prompts[:num], words)
        row.update({f"d{n}@W": distinct(cut, n) for n in (1, 2, 3)}, words=words)
    keys = ("prompts", "mean_words", "distinct_1", "distinct_2", "distinct_3", "d1@W", "d2@W", "d3@W",
            "exact_dup_rate", "near_dup_rate")
    width = max(len(r["set"]) for r in rows)
    print(f"W = {words:,} words (distinct-n at equal words)")
    print(f"{'set':<{width}}  " + "  ".join(f"{k:>14}" for k in keys))
    for r in rows:
        print(f"{r['set']:<{width}}  " + "  ".join(f"{r[k]:>14.4f}" if isinstance(r[k], float) else f"{r[k]:>14}"
                                                   for k in keys))
    result = {"bench": "synthesize_diversity", "command": " ".join(sys.argv), "threshold": args.threshold,
              "prompts_per_set": num, "sets": rows}
    print(json.dumps(result))
    if args.out:
        from bench.common import write_result

        write_result(result, "synthesize", "diversity", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
