"""`dflash-train plan`: tokenize the data, build the epoch-0 plan, write it to the run dir, print a summary."""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

from dflash_trainer.config import Config
from dflash_trainer.data.plan import check_lengths_fit, plan_epoch, write_epoch_plan, write_summary
from dflash_trainer.data.prepare import prepare_data, summary_json
from dflash_trainer.data.tokenizer import load_tokenizer
from dflash_trainer.rundir import make_run_dir


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
              f"{b['num_jobs']} jobs") for b in s["buckets"]]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(config: Config, args: Optional[argparse.Namespace] = None) -> int:
    start = time.perf_counter()
    check_lengths_fit(config.data.max_length, config.pipeline.token_budget)  # before anything is written
    tokenizer = load_tokenizer(config.target, config.data.chat_template)
    run_dir = make_run_dir(config)
    prepared = prepare_data(config, run_dir, tokenizer=tokenizer)
    plan = plan_epoch(config, prepared.train.lengths, 0)
    write_epoch_plan(run_dir, plan)
    summary = summary_json(prepared.summary, plan)
    write_summary(run_dir, summary)
    print(format_summary(summary))
    cache = "hit" if prepared.summary.cache_hit else "written"
    print(f"tokenized cache {cache}: {prepared.summary.cache_path}")
    print(f"run dir: {run_dir}  (plan/epoch_0.json, plan/eval.jsonl, plan/summary.json)  "
          f"[{time.perf_counter() - start:.1f}s]")
    return 0
