"""The drafter step at long context: chunked (`train.blocks_per_chunk`) against one pass over all blocks.

    python bench/long_context/long_context.py                                  # CUDA, 8B shape, 32K / 64K / 128K tokens
    python bench/long_context/long_context.py --lengths 16384,32768 --blocks-per-chunk 1024
    python bench/long_context/long_context.py --smoke                          # tiny shapes on the CPU: code paths only

Each length L is one packed batch of one sequence of L tokens (10% prompt) with the recipe's 512 blocks per 3,072
tokens, random bf16 taps and a random frozen head, trained by the trainer's drafter step (`drafter_step.py`'s
`run_variant`: block sampling, masks, the compiled forward, the loss, backward, clipping, fused AdamW). Two modes
per length, in the same run:
  chunked    train.blocks_per_chunk=--blocks-per-chunk (0: the planner's choice from the free memory, logged)
  one-pass   train.blocks_per_chunk=N: every block's activations alive until the backward (the naive baseline;
             out of memory at long lengths, reported as OOM)
Reported: ms per step, tokens/s (L / step time), the drafter's model TFLOP (bench/flops.py: drafter_step_flops)
and MFU, peak GPU memory (torch.cuda.max_memory_allocated), and the chunk plan. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import add_shape_args, bench_device, device_name, git_commit, log, reset_memory, write_result
import torch
from bench.speed.drafter_step import run_variant
from bench.flops import PEAK_TFLOPS

BLOCKS_PER_TOKEN = (512, 3072)
"""The recipe's anchor density: 512 blocks per 3,072 tokens."""


class _LastPlan(logging.Handler):
    """Keeps the chunk planner's latest log line (the plan each run chose)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p, "long_context")
    p.add_argument("--lengths", default="32768,65536,131072", help="comma-separated sequence lengths (tokens)")
    p.add_argument("--modes", default="chunked,one-pass", help="comma-separated: chunked, one-pass")
    p.add_argument("--blocks-per-chunk", type=int, default=0,
                   help="train.blocks_per_chunk of the chunked mode (0: chosen from the free memory)")
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    if not args.lengths or any(n < 64 for n in args.lengths):
        p.error("--lengths needs lengths of at least 64 tokens")
    if any(m not in ("chunked", "one-pass") for m in args.modes):
        p.error(f"--modes must name chunked and/or one-pass, got {args.modes}")
    if args.smoke:  # CPU-sized: the code paths only
        args.model, args.block_size, args.drafter_layers, args.steps, args.warmup = "tiny", 8, 2, 2, 1
        args.lengths = [128, 256]
        args.blocks_per_chunk = args.blocks_per_chunk or 12
    return args


def shape_for(args: argparse.Namespace, length: int) -> argparse.Namespace:
    """`drafter_step.run_variant`'s arguments for one sequence of `length` tokens at the recipe's block density."""
    shape = copy.copy(args)
    shape.seqs, shape.seq_len = 1, length
    shape.blocks_per_seq = max(1, length * BLOCKS_PER_TOKEN[0] // BLOCKS_PER_TOKEN[1])
    shape.profile, shape.profile_steps = False, 0
    return shape


def run_one(args: argparse.Namespace, length: int, mode: str, device: torch.device, plans: _LastPlan) -> dict:
    shape = shape_for(args, length)
    setting = args.blocks_per_chunk if mode == "chunked" else shape.blocks_per_seq
    row = {"length": length, "mode": mode, "num_blocks": shape.blocks_per_seq, "blocks_per_chunk_setting": setting}
    plans.message = ""
    try:
        result = run_variant(f"{mode}: train.blocks_per_chunk={setting}", shape, device)
        row.update(result, tokens_per_s=length / (result["step_ms"] / 1e3), plan=plans.message)
    except torch.cuda.OutOfMemoryError as e:
        row.update(error="OOM", detail=str(e).splitlines()[0], plan=plans.message)
    except Exception as e:  # a mode that fails for another reason: report it, go on
        traceback.print_exc()
        row.update(error=f"{type(e).__name__}: {str(e)[:300]}", plan=plans.message)
    torch._dynamo.reset()  # the next run compiles its own shapes (and this one's memory is freed)
    reset_memory(device)
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = bench_device(args)
    if device is None:
        return 2
    plans = _LastPlan()
    chunk_log = logging.getLogger("dflash_trainer.train.chunking")
    chunk_log.addHandler(plans)
    chunk_log.setLevel(logging.INFO)
    rows = []
    for length in args.lengths:
        for mode in args.modes:
            log(f"{length} tokens, {mode}: start")
            rows.append(run_one(args, length, mode, device, plans))
            r = rows[-1]  # each row as it ends: a call that runs out of time still shows the rows done
            log(f"{length} tokens, {mode}: " + (r.get("error") or f"{r['step_ms']:.1f} ms, {r['tokens_per_s']:,.0f} "
                f"tokens/s, MFU {r['mfu']:.1%}, peak {r['peak_gpu_mem_gb'] or 0:.1f} GiB") + f"; {r['plan']}")
    print(f"\nlong-context drafter step ({args.model}, {args.drafter_layers} layers, B={args.block_size}, "
          f"{BLOCKS_PER_TOKEN[0]} blocks per {BLOCKS_PER_TOKEN[1]} tokens) on {device}; "
          f"MFU against {PEAK_TFLOPS} TFLOP/s")
    print(f"{'tokens':>8}  {'mode':<9}{'step ms':>10}{'tokens/s':>11}{'TFLOP':>8}{'MFU':>8}{'peak GiB':>9}  plan")
    for r in rows:
        if "error" in r:
            print(f"{r['length']:>8}  {r['mode']:<9}{r['error']:>10}  {r['plan']}")
            continue
        print(f"{r['length']:>8}  {r['mode']:<9}{r['step_ms']:>10.1f}{r['tokens_per_s']:>11,.0f}{r['step_tflop']:>8.1f}"
              f"{r['mfu']:>8.1%}{r['peak_gpu_mem_gb'] or 0:>9.1f}  {r['plan']}")
    summary = {"bench": "long_context", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "commit": git_commit(), "gpu": device_name(device), "command": " ".join([sys.executable, *sys.argv]),
               "model": args.model, "peak_tflops": PEAK_TFLOPS, "results": rows}
    write_result(summary, "long_context", args.model, args.out)
    print(json.dumps(summary))
    return 0 if rows and all("error" not in r for r in rows if r["mode"] == "chunked") else 1


if __name__ == "__main__":
    sys.exit(main())
