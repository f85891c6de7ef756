"""`dflash-train plan`: tokenize the data (into the tokenized cache), build the epoch-0 plan, print a summary; with
`run.dir` set, write the plan there for a later `dflash-train train` with the same `run.dir` (which plans again
from its own config, so the two need not agree)."""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

from dflash_trainer.config import Config
from dflash_trainer.data.plan import check_lengths_fit, plan_epoch, write_epoch_plan, write_summary
from dflash_trainer.data.prepare import prepare_data, summary_json
from dflash_trainer.data.tokenizer import load_tokenizer
from dflash_trainer.rundir import claim_run_dir


def format_summary(s: dict[str, Any]) -> str:
    rows = [
        ("conversations read", f"{s['conversations_total']:,}"),
        ("  kept for training", f"{s['conversations_kept']:,}"),
        ("  held out for eval", f"{s['eval_conversations']:,}"),
    ]
    rows += [(f"  dropped: {reason}", f"{n:,}") for reason, n in sorted(s["dropped"].items(), key=lambda kv: -kv[1])]
    rows += [("  cut at data.max_length", f"{s['truncated']:,} ({s['truncated_tokens']:,} tokens left out)")]
    rows += [
        ("tokens", f"{s['tokens']:,}"),
        ("  supervised", f"{s['supervised_tokens']:,} ({s['supervised_tokens'] / max(1, s['tokens']):.0%})"),
        ("token budget / max seqs", f"{s['token_budget']:,} / {s['max_seqs']}"),
        ("jobs (epoch 0)", f"{s['jobs']:,}"),
        ("padding waste", f"{s['padding_waste']:.1%}"),
    ]
    rows += [(f"  bucket {b['bucket_id']}", f"len {b['min_length']}-{b['max_length']}: {b['num_sequences']} seqs, "
              f"longest in {b['num_jobs']} jobs") for b in s["buckets"]]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(config: Config, args: Optional[argparse.Namespace] = None) -> int:
    start = time.perf_counter()
    check_lengths_fit(config.data.max_length, config.pipeline.token_budget)  # before anything is written
    tokenizer = load_tokenizer(config.target, config.data.chat_template)
    if not config.run.dir:  # a directory no later command would find: the cache is what `plan` leaves
        prepared = prepare_data(config, "", tokenizer=tokenizer, write_files=False)
        plan = plan_epoch(config, prepared.train.lengths, 0)
        _print(summary_json(prepared.summary, plan), prepared, start, where="run dir: none (set run.dir to keep "
               "the plan and the held-out prompts for a `train` with the same run.dir)")
        return 0
    with claim_run_dir(config, "plan") as claim:
        prepared = prepare_data(config, claim.path, tokenizer=tokenizer)
        plan = plan_epoch(config, prepared.train.lengths, 0)
        write_epoch_plan(claim.path, plan)
        summary = summary_json(prepared.summary, plan)
        write_summary(claim.path, summary)
    _print(summary, prepared, start, where=f"run dir: {claim.path}  (plan/epoch_0.json, plan/eval.jsonl, "
           "plan/summary.json)")
    return 0


def _print(summary: dict[str, Any], prepared, start: float, *, where: str) -> None:
    print(format_summary(summary))
    cache = "hit" if prepared.summary.cache_hit else "written"
    print(f"tokenized cache {cache}: {prepared.summary.cache_path}")
    print(f"{where}  [{time.perf_counter() - start:.1f}s]")
