"""Muon's optimizer step on the drafter's weight matrices, on every rank (each orthogonalising them all) against split
over the data-parallel ranks (each its share, broadcast; `train/muon.py`), in one torchrun job:

    torchrun --nproc_per_node 2 bench/speed/muon_step.py            # CUDA, the 8B drafter's matrices, ~1 min
    torchrun --nproc_per_node 8 bench/speed/muon_step.py
    torchrun --nproc_per_node 2 bench/speed/muon_step.py --smoke    # CPU (gloo), tiny shapes: code paths only

The matrices are those `train.optimizer=muon` routes to Muon in the drafter at `--model`'s shape (`route_parameters`),
fp32 with random gradients (the same on every rank, as after the gradients' all-reduce). Both ways are timed in the
same job, the whole-on-every-rank way first (the baseline); one rank prints the table and the last line is JSON
(`--out` also gets a file). Run on one rank it measures the baseline alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package

import torch
import torch.distributed as dist
from bench.common import (add_shape_args, apply_smoke, bench_config, device_name, git_commit, log, peak_gb, synchronize,
                          write_result)

from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.target.load import target_model_config
from dflash_trainer.train.muon import Muon, ns_flops, route_parameters
from dflash_trainer.train.trainer import build_drafter


def time_steps(opt: Muon, params: list[torch.nn.Parameter], warmup: int, steps: int, device: torch.device) -> float:
    """Seconds per `opt.step()`, the mean over `steps` after `warmup` (the gradients stay as set)."""
    for _ in range(warmup):
        opt.step()
    synchronize(device)
    dist.barrier()  # every rank starts the timed steps together
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    synchronize(device)  # timing boundary: the queued kernels and copies have run
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, "speed")
    args = p.parse_args(argv)
    apply_smoke(args)
    device = torch.device("cpu" if args.smoke else f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl", device_id=device if device.type == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        config = bench_config(args, device)
        spec = drafter_spec(target_model_config(config.target), config.drafter)
        model = build_drafter(config, spec, device)
        named = route_parameters(model, spec.vocab_size)["muon"]
        params = [p for _, p in named]
        gen = torch.Generator(device).manual_seed(0)
        for q in params:
            q.grad = torch.randn(q.shape, generator=gen, device=device)  # the same on every rank
        tflop = sum(ns_flops(q.shape) for q in params) / 1e12
        results = {}
        for label, group in (("every rank", None), (f"split over {world}", dist.group.WORLD)):
            opt = Muon(params, lr=1e-3, group=group)
            results[label] = time_steps(opt, params, args.warmup, args.steps, device)
            log(f"rank {rank}: {label}: {results[label] * 1e3:.1f} ms a step")
        if rank == 0:
            base = results["every rank"]
            print(f"\nMuon step on {len(params)} matrices ({sum(q.numel() for q in params) / 1e6:.0f}M parameters, "
                  f"{tflop:.1f} TFLOP of Newton-Schulz) of the {args.model} drafter ({args.drafter_layers} layers), "
                  f"{world} rank(s) on {device_name(device)}")
            print(f"{'way':<16}{'step ms':>10}{'vs every rank':>16}")
            for label, seconds in results.items():
                print(f"{label:<16}{seconds * 1e3:>10.1f}{base / seconds:>15.2f}x")
            summary = {"bench": "muon_step", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "commit": git_commit(), "gpu": device_name(device), "world": world, "model": args.model,
                       "drafter_layers": args.drafter_layers, "matrices": len(params),
                       "ns_tflop": tflop, "step_ms": {k: v * 1e3 for k, v in results.items()},
                       "peak_gpu_mem_gb": peak_gb(device), "command": " ".join([sys.executable, *sys.argv])}
            print(json.dumps(summary))
            if args.out and not args.smoke:
                write_result(summary, "muon_step", f"{args.model}-x{world}", args.out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
