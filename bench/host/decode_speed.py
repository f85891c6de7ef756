"""Batched decoding speed (`eval/batched.py`) on a target: ms per decode step at several batch sizes and
prompt lengths, and a profile of one setting (where a step's time goes).

    python bench/host/decode_speed.py --target DIR [--rows 256,1024] [--prompt 128,1024] [--new 64] [--profile]
        [--pyprofile] [--threads N] [--repeat N]

Each setting runs `--repeat` times (the first run of a shape can be far slower than the next: allocator
segments and per-shape kernel choices are made then); the profiles run a shape not run before.

Prompts are random token ids (every row the same length), decoded greedily with no stop token, so every row
runs `--new` steps. Prints a table, then (with --profile) the top operators, and last one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from dflash_trainer.eval.batched import decode_batch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--rows", default="256,1024")
    p.add_argument("--prompt", default="128,1024")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="profile the largest setting (operators)")
    p.add_argument("--pyprofile", action="store_true", help="profile the largest setting (Python functions)")
    p.add_argument("--repeat", type=int, default=1, help="runs of each setting (each one reported)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}, CPUs: {len(os.sched_getaffinity(0))}", flush=True)
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.bfloat16).to(device).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    results = []

    def run(rows: int, length: int) -> float:
        prompts = [torch.randint(10, vocab, (length,), generator=generator) for _ in range(rows)]
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        decode_batch(model, prompts, max_new_tokens=args.new, stop_token_ids=[])
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    run(8, 16)  # warm-up
    for rows in map(int, args.rows.split(",")):
        for length in map(int, args.prompt.split(",")):
            for attempt in range(args.repeat):
                seconds = run(rows, length)
                results.append({"rows": rows, "prompt": length, "new": args.new, "run": attempt + 1,
                                "seconds": seconds, "ms_per_step": 1000 * seconds / args.new,
                                "tokens_per_s": rows * args.new / seconds})
    print(f"{'rows':>6}{'prompt':>8}{'run':>5}{'s':>8}{'ms/step':>9}{'tok/s':>10}")
    for r in results:
        print(f"{r['rows']:>6}{r['prompt']:>8}{r['run']:>5}{r['seconds']:>8.2f}{r['ms_per_step']:>9.1f}"
              f"{r['tokens_per_s']:>10.0f}")
    biggest = max(results, key=lambda r: r["rows"] * r["prompt"])
    fresh = (biggest["rows"], biggest["prompt"] + 1)  # a shape not run yet
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            print(f"profiled run of {fresh}: {run(*fresh):.2f} s")
        for key in ("self_cpu_time_total", "self_cuda_time_total"):
            print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
    if args.pyprofile:
        import cProfile
        import pstats

        fresh = (fresh[0], fresh[1] + 1)
        profiler = cProfile.Profile()
        print(f"profiled run of {fresh}: {profiler.runcall(run, *fresh):.2f} s")
        for key in ("tottime", "cumulative"):
            pstats.Stats(profiler).sort_stats(key).print_stats(25)
    print(json.dumps({"bench": "decode_speed", "device": device, "threads": torch.get_num_threads(),
                      "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
