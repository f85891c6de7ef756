"""Drafters evaluated on the same prompts, compared prompt by prompt: each one's real tau, and its difference from
the first one's with the standard error of that difference (paired: what the prompts share cancels).

    python bench/compare.py BASE.json OTHER.json ...

Each file is a `bench/quality.py` result or a run's `eval.json` (its `tau`, `per_prompt_committed`,
`per_prompt_steps` and `setting_digest`: the same prompts, decoding settings and target). Prints a markdown
table (for bench/RESULTS.md); the last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import or_dash  # noqa: E402  (bench/common.py)

from dflash_trainer.eval.stats import plus_minus, tau_difference_stderr, tau_stderr  # noqa: E402

FIELDS = ("tau", "per_prompt_committed", "per_prompt_steps", "setting_digest")


def load(path: Path) -> dict:
    result = json.loads(path.read_text())
    missing = [k for k in FIELDS if result.get(k) is None]
    if missing:
        raise SystemExit(f"{path}: no {', '.join(missing)} (evaluated before per-prompt counts were kept): "
                         "evaluate its drafter again with `dflash-train eval`")
    # a run's eval.json is named by its folder (eval-alone-<arm>/eval.json); a copy by its own file name
    name = result.get("name") or (path.resolve().parent.name if path.stem == "eval" else path.stem)
    return {"name": name, "path": str(path), **{k: result[k] for k in FIELDS}}


def compare(runs: list[dict]) -> list[dict]:
    base = runs[0]
    for run in runs[1:]:
        if run["setting_digest"] != base["setting_digest"]:
            raise SystemExit(f"{run['path']} was evaluated otherwise than {base['path']} (other prompts, decoding "
                             "settings or target): compare evaluations of the same eval.prompts, eval.num_prompts, "
                             "eval.max_new_tokens, eval.temperature, block size and target")
    rows = []
    for run in runs:
        own = (run["per_prompt_committed"], run["per_prompt_steps"])
        rows.append({"name": run["name"], "tau": run["tau"], "stderr": tau_stderr(*own),
                     "difference": run["tau"] - base["tau"],
                     "difference_stderr": tau_difference_stderr(*own, base["per_prompt_committed"],
                                                                base["per_prompt_steps"])})
    return rows


def table(rows: list[dict], prompts: int) -> str:
    base = rows[0]["name"]
    lines = [f"| run | real tau ({prompts} prompts) | difference from {base} | paired error | difference / error |",
             "|---|---|---|---|---|"]
    for r in rows:
        ratio = r["difference"] / r["difference_stderr"] if r["difference_stderr"] else None
        lines.append(f"| {r['name']} | {r['tau']:.3f}{plus_minus(r['stderr'])} | "
                     f"{or_dash(r['difference'], '{:+.3f}')} | {or_dash(r['difference_stderr'], '{:.3f}')} | "
                     f"{or_dash(ratio, '{:+.1f}')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="the first is the base")
    args = p.parse_args(argv)
    runs = [load(path) for path in args.results]
    rows = compare(runs)
    print(table(rows, len(runs[0]["per_prompt_steps"])))
    print(json.dumps({"bench": "compare", "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
