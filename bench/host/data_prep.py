"""Tokenizing a dataset on a cache miss: one process against worker processes, same conversations, same run.

    python bench/host/data_prep.py                          # bundled ShareGPT, 3000 conversations, tiny tokenizer
    python bench/host/data_prep.py --conversations 20000 --workers 1,4,16
    python bench/host/data_prep.py --smoke                  # 300 conversations, workers 1 and 2 (checks the script)
    python bench/host/data_prep.py data.path=FILE.jsonl target.path=DIR target.random_init=null target.tokenizer=null
                                                       # other data or tokenizer: the demo recipe's overrides

Loads the conversations once (`data/sources.py`, the demo recipe's source), then times `tokenize_all` for each
worker count (workers 1 = in this process, the baseline; N > 1: all in N processes, however fast this one
is), checks every result equals the baseline's, and prints conversations/s
and the speedup. CPU work: run it on the machine that will train. Last line: JSON (`--out DIR`: also written there as
`<date>-host-data_prep-<conversations>x<largest worker count>.json`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package

import torch  # noqa: E402

from bench.common import git_commit, write_result  # noqa: E402

from dflash_trainer.config import load_config  # noqa: E402
from dflash_trainer.data.sources import load_conversations  # noqa: E402
from dflash_trainer.data.tokenizer import load_tokenizer  # noqa: E402
from dflash_trainer.data.tokenized import tokenize_all  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=3000)
    p.add_argument("--workers", default="1,2,4,8,16", help="comma-separated worker counts; 1 is the baseline")
    p.add_argument("--max-length", type=int, default=3072)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON into this folder")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the demo recipe (data.path=..., target.path=...)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the pool's timings
    if args.smoke:
        args.conversations, args.workers = 300, "1,2"
    counts = sorted({int(w) for w in args.workers.split(",")} | {1})
    config = load_config("demo", [f"data.max_conversations={args.conversations}", f"data.max_length={args.max_length}",
                                  *args.overrides])
    tokenizer = load_tokenizer(config.target, config.data.chat_template)
    chats = load_conversations(config.data, seed=0).conversations
    rows, base = [], None
    for workers in counts:
        t0 = time.perf_counter()
        out = tokenize_all(chats, tokenizer, thinking=False, max_length=args.max_length, min_supervised=32,
                           num_workers=workers, parallel_min_s=0.0, probe=0)
        seconds = time.perf_counter() - t0
        if base is None:
            base = out
        same = (out.dropped == base.dropped and torch.equal(out.dataset.input_ids, base.dataset.input_ids)
                and torch.equal(out.dataset.loss_mask, base.dataset.loss_mask))
        rows.append({"workers": workers, "seconds": seconds, "conversations_per_s": len(chats) / seconds,
                     "speedup": rows[0]["seconds"] / seconds if rows else 1.0, "same_as_one_process": same})
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"tokenizing {len(chats)} conversations (tokenizer {tokenizer.name_or_path or 'tiny'}, max_length "
          f"{args.max_length}) on {cpus} CPUs")
    print(f"{'workers':>8}{'seconds':>10}{'conv/s':>10}{'speedup':>9}  same as 1")
    for r in rows:
        print(f"{r['workers']:>8}{r['seconds']:>10.1f}{r['conversations_per_s']:>10.0f}{r['speedup']:>8.2f}x  "
              f"{r['same_as_one_process']}")
    result = {"bench": "data_prep", "conversations": len(chats), "cpus": cpus, "rows": rows}
    print(json.dumps(result))
    if args.out is not None:
        result.update(commit=git_commit(), tokenizer=tokenizer.name_or_path or "tiny", max_length=args.max_length)
        write_result(result, "host", f"data_prep-{len(chats)}x{counts[-1]}", args.out)
    return 0 if all(r["same_as_one_process"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
