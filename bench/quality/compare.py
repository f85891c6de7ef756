"""Drafters evaluated on the same prompts, compared prompt by prompt: each one's real tau, and its difference from
the first one's with the standard error of that difference (paired: what the prompts share cancels).

    python bench/quality/compare.py BASE.json OTHER.json ... [--first N]
    python bench/quality/compare.py --seeds 3 BASE_s0 BASE_s1 BASE_s2 OTHER_s0 OTHER_s1 OTHER_s2 ...

Each file is a `bench/quality/quality.py` result or a run's `eval.json` (its `per_prompt_committed`, `per_prompt_steps`
and `setting_digest`: the same prompts, decoding settings and target). `--first N` compares on the first N prompts
only (e.g. the usual 40 of a 200-prompt evaluation). When the evaluation kept prompt lookup's per-prompt counts,
its tau on the same prompts and each run's ratio to it are printed too. Prints a markdown table (for
bench/RESULTS.md); the last line printed is JSON.

`--seeds N`: the files are arms of N seeds each, in the same seed order (the base arm first). Seed k of an arm is
paired with seed k of the base; each arm gets its mean tau and spread (sd) over seeds, and its difference of means
from the base with the seed-level error (the sd of the per-seed differences over sqrt(N)) beside the per-seed paired
errors: the paired error leaves out the prompts' spread, the seed-level error the runs' spread too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import or_dash  # noqa: E402  (bench/common.py)

from dflash_trainer.eval.stats import plus_minus, tau_difference_stderr, tau_stderr  # noqa: E402

FIELDS = ("per_prompt_committed", "per_prompt_steps", "setting_digest")
LOOKUP_FIELDS = ("prompt_lookup_per_prompt_committed", "prompt_lookup_per_prompt_steps")


def load(path: Path, first: Optional[int] = None) -> dict:
    """The per-prompt counts of `path` (the first `first` prompts when given)."""
    result = json.loads(path.read_text())
    missing = [k for k in FIELDS if result.get(k) is None]
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)} (evaluated before per-prompt counts were kept): "
                         "evaluate its drafter again with `dflash-train eval`")
    prompts = len(result["per_prompt_steps"])
    if first is not None and not 1 <= first <= prompts:
        raise SystemExit(f"--first {first}: {path} has {prompts} prompts; give 1 to {prompts}")
    # a run's eval.json is named by its folder (eval-alone-<arm>/eval.json); a copy by its own file name
    name = result.get("name") or (path.resolve().parent.name if path.stem == "eval" else path.stem)
    counts = {k: result[k][:first] for k in FIELDS[:2] + LOOKUP_FIELDS if result.get(k) is not None}
    return {"name": name, "path": str(path), "setting_digest": result["setting_digest"], **counts}


def pooled_tau(committed: list[int], steps: list[int]) -> float:
    """Committed tokens per verification step over every step of these prompts (the evaluator's tau)."""
    return sum(committed) / sum(steps)


def same_lookup(run: dict, base: dict) -> bool:
    """Whether prompt lookup's per-prompt counts of both runs agree on every prompt: the same prompts, decoding and
    target replies, where the digests differ only by what they cannot see through (an older dflash-train's digest
    included the target's folder path). Printed when it is what lets two runs be compared."""
    if not all(k in run and k in base for k in LOOKUP_FIELDS):
        return False
    same = all(run[k] == base[k] for k in LOOKUP_FIELDS)
    if same:
        print(f"note: {run['name']} and {base['name']} have other setting digests (an older evaluation of a target "
              f"in another folder?) but prompt lookup's counts agree on all {len(base['per_prompt_steps'])} prompts: "
              "compared", file=sys.stderr)
    return same


def compare(runs: list[dict]) -> tuple[list[dict], Optional[dict]]:
    """Each run's tau and its paired difference from the first run's; prompt lookup's tau on the same prompts
    (None when no run kept its per-prompt counts)."""
    base = runs[0]
    for run in runs[1:]:
        if run["setting_digest"] != base["setting_digest"] and not same_lookup(run, base):
            raise SystemExit(f"{run['path']} was evaluated otherwise than {base['path']} (other prompts, decoding "
                             "settings or target): compare evaluations of the same eval.prompts, eval.num_prompts, "
                             "eval.max_new_tokens, eval.temperature, block size and target")
    # the same digest means the same target replies, so prompt lookup's pass is the same in every run
    with_lookup = next((run for run in runs if all(k in run for k in LOOKUP_FIELDS)), None)
    lookup = None
    if with_lookup is not None:
        counts = [with_lookup[k] for k in LOOKUP_FIELDS]
        lookup = {"tau": pooled_tau(*counts), "stderr": tau_stderr(*counts)}
    base_counts = (base["per_prompt_committed"], base["per_prompt_steps"])
    rows = []
    for run in runs:
        own = (run["per_prompt_committed"], run["per_prompt_steps"])
        tau = pooled_tau(*own)
        rows.append({"name": run["name"], "tau": tau, "stderr": tau_stderr(*own),
                     "difference": tau - pooled_tau(*base_counts),
                     "difference_stderr": tau_difference_stderr(*own, *base_counts),
                     "lookup_ratio": tau / lookup["tau"] if lookup else None})
    return rows, lookup


def table(rows: list[dict], prompts: int, lookup: Optional[dict]) -> str:
    base = rows[0]["name"]
    lines = [f"| run | real tau ({prompts} prompts) | difference from {base} | paired error | difference / error "
             "| ratio to prompt lookup |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["difference"] / r["difference_stderr"] if r["difference_stderr"] else None
        lines.append(f"| {r['name']} | {r['tau']:.3f}{plus_minus(r['stderr'])} | "
                     f"{or_dash(r['difference'], '{:+.3f}')} | {or_dash(r['difference_stderr'], '{:.3f}')} | "
                     f"{or_dash(ratio, '{:+.1f}')} | {or_dash(r['lookup_ratio'], '{:.2f}x')} |")
    if lookup is not None:
        lines.append(f"\nprompt lookup on the same prompts: {lookup['tau']:.3f}{plus_minus(lookup['stderr'])}")
    return "\n".join(lines)


def by_seeds(runs: list[dict], seeds: int) -> list[dict]:
    """Each arm (N consecutive runs, one a seed) against the base arm seed by seed: its taus, their mean and sd,
    the per-seed differences with their paired errors, and the difference of means with its seed-level error."""
    if seeds < 1 or len(runs) % seeds or len(runs) < 2 * seeds:
        raise SystemExit(f"--seeds {seeds}: give two or more arms of {seeds} results each ({len(runs)} given)")
    arms = [runs[i:i + seeds] for i in range(0, len(runs), seeds)]
    rows = []
    for arm in arms:
        pairs = [compare([base, run])[0][1] for base, run in zip(arms[0], arm)]  # (base seed k, arm seed k)
        taus = [pair["tau"] for pair in pairs]
        diffs = [pair["difference"] for pair in pairs]
        rows.append({
            "name": arm[0]["name"], "taus": taus, "mean": statistics.fmean(taus),
            "sd": statistics.stdev(taus) if seeds > 1 else None,
            "differences": diffs, "paired_errors": [pair["difference_stderr"] for pair in pairs],
            "difference": statistics.fmean(diffs),
            "seed_error": statistics.stdev(diffs) / seeds ** 0.5 if seeds > 1 else None,
        })
    return rows


def seeds_table(rows: list[dict], seeds: int) -> str:
    base = rows[0]["name"]
    lines = [f"| arm (first seed's name) | tau, seeds 0..{seeds - 1} | mean (sd over seeds) | difference of means from "
             f"{base} | seed-level error | per-seed paired errors |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        if i == 0:  # the base itself
            lines.append(f"| {r['name']} | {' / '.join(f'{x:.3f}' for x in r['taus'])} | {r['mean']:.3f} "
                         f"({or_dash(r['sd'], '{:.3f}')}) | - | - | - |")
            continue
        lines.append(f"| {r['name']} | {' / '.join(f'{x:.3f}' for x in r['taus'])} | {r['mean']:.3f} "
                     f"({or_dash(r['sd'], '{:.3f}')}) | {r['difference']:+.3f} | {or_dash(r['seed_error'], '{:.3f}')} | "
                     f"{' / '.join(or_dash(e, '{:.3f}') for e in r['paired_errors'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="the first is the base")
    p.add_argument("--first", type=int, help="compare on the first N prompts only")
    p.add_argument("--seeds", type=int, help="the results are arms of this many seeds each (see the docstring)")
    args = p.parse_args(argv)
    runs = [load(path, args.first) for path in args.results]
    if args.seeds:
        rows = by_seeds(runs, args.seeds)
        print(seeds_table(rows, args.seeds))
        print(json.dumps({"bench": "compare", "prompts": len(runs[0]["per_prompt_steps"]), "seeds": args.seeds,
                          "arms": rows}))
        return 0
    rows, lookup = compare(runs)
    print(table(rows, len(runs[0]["per_prompt_steps"]), lookup))
    print(json.dumps({"bench": "compare", "prompts": len(runs[0]["per_prompt_steps"]), "rows": rows,
                      "prompt_lookup": lookup}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
