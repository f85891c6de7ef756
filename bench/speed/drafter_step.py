"""The drafter's training step alone (no target), exactly as the trainer runs it, with A/B variants and a profile.

    python bench/speed/drafter_step.py                                  # CUDA, 8B shape, ~2 min
    python bench/speed/drafter_step.py --variant "eager ce" --profile   # compare variants, print kernel profiles
    python bench/speed/drafter_step.py --smoke                          # tiny shapes on the CPU: code paths only

Issue 62's prices (1 x 3,072 tokens, 512 blocks; LiLiCorr's head at ModelOpt's 1024 and at the drafter's width):
    python bench/speed/drafter_step.py --seqs 1 --blocks-per-seq 512 --warmup 3 --steps 8 \
      --variant "adam: drafter.variant=dflash2 drafter.dpace=true" \
      --variant "lcv: drafter.variant=lilicorr drafter.lilicorr_conv=true drafter.dpace=true" \
      --variant "lcv512: drafter.variant=lilicorr drafter.lilicorr_conv=true drafter.dpace=true drafter.lilicorr_hidden_size=512" \
      --variant "lcv wide: drafter.variant=lilicorr drafter.lilicorr_conv=true drafter.dpace=true drafter.lilicorr_hidden_size=0"

One step = the trainer's `StepLoop.step` on one packed batch: block sampling, mask building, the compiled
drafter forward (flex attention), the chunked frozen-head loss, backward, gradient scaling and clipping,
fused AdamW (`bench/common.py: drafter_loop`). The batch is the `mfu` workload (`bench/common.py`; 4 x 3072
tokens, 2048 blocks of 16; 10% of each sequence is prompt) with random taps in bf16; the frozen embedding
and LM head are random (V x H, bf16). Each step gets a new job id, so new anchors.

Variants are config overrides (`--variant NAME` or `--variant "NAME: key=value ..."`, repeatable; the
first is the reference of the speedup column). The named ones:
  ours               the trainer's path as configured (the default)
  eager ce           drafter.loss_kernel=eager: the head's CE kernel uncompiled (fp32 logits copy, separate passes)
  sdpa eager         drafter.attention=sdpa train.compile=false: the naive drafter (~90 GB at the 8B shape)
  chunk 4096         drafter.loss_chunk_rows=4096
  cuda graphs        train.compile_mode=reduce-overhead: the compiled forward (and its backward) as CUDA graphs
  create_block_mask  drafter.mask_tiles=pairs: BlockMasks from create_block_mask (every pair evaluated)
Model FLOPs: bench/flops.py (drafter_step_flops). The last line printed is JSON; `--out` also gets a file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import (add_shape_args, apply_smoke, bench_config, bench_device, device_name, drafter_loop, git_commit,
                          log, mfu_workload, peak_gb, reset_memory, stall_dumps, synchronize, write_result)
import torch
from bench.flops import PEAK_TFLOPS, drafter_step_flops, lilicorr_step_flops, mfu
from bench.kernel_profile import print_profile, profile_dict, profile_steps
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash_trainer.drafter.anchors import plan_blocks
from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.target.capture import prepare_inputs
from dflash_trainer.target.head import TargetHead
from dflash_trainer.target.load import target_model_config
from dflash_trainer.transport.wire import WireHeader, allocate, from_wire, wire_spec

VARIANTS = {  # name -> config overrides on the trainer's path
    "ours": [],
    "eager ce": ["drafter.loss_kernel=eager"],
    "sdpa eager": ["drafter.attention=sdpa", "train.compile=false"],
    "chunk 4096": ["drafter.loss_chunk_rows=4096"],
    "create_block_mask": ["drafter.mask_tiles=pairs"],
    "cuda graphs": ["train.compile_mode=reduce-overhead"],
}


def make_batches(args, config, spec, device, count: int):
    """`count` HiddenStateBatches over one shared wire buffer (same tokens, different job ids)."""
    workload = mfu_workload(1, args.seqs, args.seq_len, spec.mask_token_id)
    wire = allocate(wire_spec(config, hidden=spec.hidden_size, num_taps=spec.num_taps), device)
    job = workload.jobs[0]
    inputs = prepare_inputs([workload.dataset[i] for i in job.sequence_ids], wire)
    wire.taps.normal_()
    if wire.last_hidden is not None:  # a variant that reads the target's last hidden state (KD, LiLiCorr's penalty)
        wire.last_hidden.normal_()
    headers = [WireHeader(job_id=k, bucket_id=0, epoch=0, num_tokens=inputs.num_tokens, num_seqs=inputs.num_seqs,
                          has_last_hidden=config.drafter.needs_last_hidden, end_of_stream=False) for k in range(count)]
    return [from_wire(wire, h) for h in headers]


def variant(name: str) -> tuple[str, list[str]]:
    """(name, config overrides) of a named variant or of "NAME: key=value key=value ..."."""
    if name in VARIANTS:
        return name, VARIANTS[name]
    label, sep, rest = name.partition(":")
    if not sep or not rest.split():
        raise SystemExit(f"--variant {name!r}: not one of {sorted(VARIANTS)} and not 'NAME: key=value ...'")
    return label.strip(), rest.split()


def run_variant(spec_text: str, args, device: torch.device) -> dict:
    name, overrides = variant(spec_text)
    config = bench_config(args, device, tuple(overrides))
    torch.manual_seed(0)  # the same head and taps for every variant
    spec = drafter_spec(target_model_config(config.target), config.drafter)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        head = TargetHead(embed_weight=(torch.randn(spec.vocab_size, spec.hidden_size) * 0.02).to(dtype),
                          lm_head_weight=(torch.randn(spec.vocab_size, spec.hidden_size) * 0.02).to(dtype),
                          final_norm=Qwen3RMSNorm(spec.hidden_size))
    total = args.warmup + args.steps + (args.profile_steps if args.profile else 0)
    batches = make_batches(args, config, spec, device, total)
    loop = drafter_loop(config, spec, head, device, total_steps=total)
    reset_memory(device)
    t0 = time.perf_counter()
    for i in range(args.warmup):
        record = loop.step(lambda i=i: (batches[i], lambda: None))
        log(f"{name}: warmup step {i + 1}/{args.warmup} done at {time.perf_counter() - t0:.1f}s, loss {record.loss:.3f}")
        if record.skipped:
            raise FloatingPointError(f"{name}: non-finite loss or gradient at warmup step {i + 1}")
    synchronize(device)
    warmup_s = time.perf_counter() - t0
    events = []
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        start.record() if start else None
        record = loop.step(lambda i=i: (batches[i], lambda: None))
        if start:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events.append((start, end))
    synchronize(device)
    step_s = (time.perf_counter() - t0) / args.steps
    gpu_s = sum(a.elapsed_time(b) for a, b in events) / 1e3 / args.steps if events else step_s
    log(f"{name}: {args.steps} timed steps, {step_s * 1e3:.1f} ms each")
    profile = None
    if args.profile:
        first = args.warmup + args.steps
        profile = profile_steps(lambda i: loop.step(lambda: (batches[first + i], lambda: None)),
                                args.profile_steps, device)
        print_profile(name, profile)
    batch = batches[args.warmup]
    plan = plan_blocks(input_ids=batch.input_ids, loss_mask=batch.loss_mask, cu_seqlens=batch.cu_seqlens,
                       num_blocks=config.batch.num_blocks, block_size=spec.block_size, mask_token_id=spec.mask_token_id,
                       seed=config.run.seed, epoch=batch.epoch, job_id=batch.job_id)
    flops = drafter_step_flops(spec, anchor_pos=plan.anchor_pos[plan.block_valid], context_tokens=batch.num_tokens)
    lattice = lilicorr_step_flops(spec, int(plan.block_valid.sum()))  # host sync: after the timed loop
    result = {
        "variant": name, "overrides": overrides, "compiled": config.train.compile and device.type == "cuda",
        "step_ms": step_s * 1e3, "gpu_step_ms": gpu_s * 1e3, "step_tflop": flops / 1e12,
        "lattice_tflop": {part: f / 1e12 for part, f in lattice.items()} or None,
        "tflops": flops / step_s / 1e12, "mfu": mfu(flops, step_s), "peak_gpu_mem_gb": peak_gb(device),
        "warmup_s": warmup_s, "loss": record.loss, "profile": None if profile is None else profile_dict(profile),
    }
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p, "speed")
    p.add_argument("--variant", action="append",
                   help=f"repeatable; one of {sorted(VARIANTS)} or 'NAME: key=value ...' (config overrides on "
                        "the trainer's path); default: ours. The first one is the reference")
    p.add_argument("--profile", action="store_true", help="profile extra steps per variant and print kernel kinds")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--stall-dump-s", type=float, default=240.0,
                   help="print every thread's stack if the run is still going after this long (and every period after)")
    args = p.parse_args(argv)
    args.variant = args.variant or ["ours"]
    apply_smoke(args)
    if args.smoke:
        args.profile_steps = 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with stall_dumps(args.stall_dump_s):
        device = bench_device(args)
        if device is None:
            return 2
        results = []
        for text in args.variant:
            log(f"variant {text}: start")
            try:
                results.append(run_variant(text, args, device))
            except torch.OutOfMemoryError as e:
                results.append({"variant": variant(text)[0], "error": f"OOM: {str(e).splitlines()[0]}"})
            except Exception as e:  # a variant's options can be rejected by the kernel: report, go on
                traceback.print_exc()
                results.append({"variant": variant(text)[0], "error": f"{type(e).__name__}: {str(e)[:300]}"})
            torch._dynamo.reset()  # the next variant compiles its own model (and this one's memory is freed)
            reset_memory(device)
    ref = next((r for r in results if "error" not in r), None)
    print(f"\ndrafter step ({args.model}, {args.seqs} x {args.seq_len} tokens, {args.seqs * args.blocks_per_seq} "
          f"blocks of {args.block_size}, {args.drafter_layers} layers) on {device}; MFU against {PEAK_TFLOPS} TFLOP/s")
    print(f"{'variant':<14}{'step ms':>10}{'GPU ms':>10}{'TFLOP':>8}{'MFU':>8}{'peak GiB':>10}{'warmup s':>10}"
          f"{'vs first':>10}  loss")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<14}  {r['error']}")
            continue
        rel = ref["step_ms"] / r["step_ms"] if ref else float("nan")
        print(f"{r['variant']:<14}{r['step_ms']:>10.1f}{r['gpu_step_ms']:>10.1f}{r['step_tflop']:>8.1f}{r['mfu']:>8.1%}"
              f"{r['peak_gpu_mem_gb'] or 0:>10.1f}{r['warmup_s']:>10.1f}{rel:>9.2f}x  {r['loss']:.4f}")
    summary = {"bench": "drafter_step", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "commit": git_commit(), "gpu": device_name(device),
               "command": " ".join([sys.executable, *sys.argv]), "model": args.model,
               "peak_tflops": PEAK_TFLOPS, "results": results}
    write_result(summary, "drafter_step", args.model, args.out)
    print(json.dumps(summary))
    return 0 if results and all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
