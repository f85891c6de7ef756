"""What the target forward costs the first time a job's batch shape is seen, and what would bound the shapes.

    python bench/target/target_shapes.py --target .practice/model                # CUDA: the practice target, ~3 min
    python bench/target/target_shapes.py --preset qwen3-8b --num-layers 10       # 8B layers, random weights
    python bench/target/target_shapes.py --smoke                                 # tiny target on the CPU
    python bench/target/target_shapes.py --census 6 --token-budget 12288 --max-length 3072   # no GPU: new shapes a run meets

cuDNN's attention builds an execution plan for every new shape, and almost every job of a first epoch has its own
(rows, padded length): training's first epoch ran slower than later ones (bench/RESULTS.md, "The target forward on
new shapes"). This measures it: jobs come from the
project's epoch plan (length buckets, first-fit-decreasing packing) over sequence lengths drawn from a
log-normal (median --median-length, capped at --max-length), so their shapes are those of an epoch. Each variant
runs in its own process (the plan cache is per process) and forwards the first --jobs jobs twice, as
`TapCapture.run` in training: pass 1 meets each shape for the first time, pass 2 again. Variants:
  default     SDPA picks its backend, as training runs now (cuDNN's attention on the H200)
  no-cudnn    SDPA without cuDNN's attention (`target.cudnn_attention=false`: flash attention)
  pad-64      default, each job's padded length rounded up to a multiple of 64
  rounded     default, the length rounded up to one of 16 lengths per power of two (at most 6.25% more)
  rounded-rows  rounded, and the rows rounded up the same way with empty ones (if the plans key on rows too)
Printed per variant: ms per forward in each pass, distinct (rows, length) shapes, computed / real tokens.
The last line is JSON. --census EPOCHS forwards nothing: it counts, for datasets of --census-sequences
sequences, the jobs of an EPOCHS-epoch run that meet a shape no earlier job had (those that pay the plan).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import device_name, git_commit, synchronize, target_attention, write_result  # noqa: E402  (bench/common.py)

from dflash_trainer.config import BatchShape  # noqa: E402
from dflash_trainer.data.plan import build_epoch_plan  # noqa: E402
from dflash_trainer.drafter.config import DrafterConfig  # noqa: E402
from dflash_trainer.data.types import TokenizedSequence  # noqa: E402
from dflash_trainer.target.capture import ForwardInputs, TapCapture, prepare_inputs  # noqa: E402
from dflash_trainer.target.checks import choose_tap_layer_ids  # noqa: E402
from dflash_trainer.target.config import TargetConfig  # noqa: E402
from dflash_trainer.target.load import load_target  # noqa: E402
from dflash_trainer.runtime.config import PipelineConfig  # noqa: E402
from dflash_trainer.transport.wire import WireSpec, allocate  # noqa: E402

VARIANTS = ("default", "no-cudnn", "pad-64", "rounded", "rounded-rows")


def rounded_length(n: int) -> int:
    """`n` rounded up to a multiple of 1/16 of its power of two: 16 lengths per octave, at most 6.25% more."""
    step = max(1, (1 << (n.bit_length() - 1)) // 16)
    return -(-n // step) * step


def variant_length(longest: int, variant: str) -> int:
    """The length a variant pads a job of longest sequence `longest` to."""
    if variant == "pad-64":
        return math.ceil(longest / 64) * 64
    return rounded_length(longest) if variant.startswith("rounded") else longest


def job_inputs(sequences: list[TokenizedSequence], out, variant: str) -> ForwardInputs:
    """A job's batch as `variant` pads it (rounded-rows: also empty rows up to a rounded row count)."""
    longest = max(s.num_tokens for s in sequences)
    inputs = prepare_inputs(sequences, out, pad_to=variant_length(longest, variant))
    if variant != "rounded-rows":
        return inputs
    rows, length = inputs.input_ids.shape  # (B, S)
    more = rounded_length(rows) - rows
    # rows appended after every real one: `real_index` (b * S + t) is unchanged
    return dataclasses.replace(inputs, input_ids=F.pad(inputs.input_ids, (0, 0, 0, more)),  # (B', S)
                               padded_tokens=(rows + more) * length)


def batch_shape(args) -> BatchShape:
    """The batch shape training derives from --token-budget (the default drafter: blocks of 16)."""
    return BatchShape.of(PipelineConfig(token_budget=args.token_budget), DrafterConfig())


def sequence_lengths(args) -> list[int]:
    """--sequences log-normal lengths (median --median-length, at most --max-length), from 2 blocks of 16 up
    (training drops shorter sequences)."""
    rng = random.Random(0)
    return [min(args.max_length, max(32, round(rng.lognormvariate(math.log(args.median_length), 0.8))))
            for _ in range(args.sequences)]


def epoch_job_ids(args, lengths: list[int], epoch: int) -> list[list[int]]:
    """The jobs (sequence ids) of epoch `epoch`'s plan, as training packs them."""
    plan = build_epoch_plan(lengths, epoch=epoch, seed=0, num_buckets=args.num_buckets,
                            token_budget=args.token_budget, max_seqs=batch_shape(args).max_seqs)
    return [list(job.sequence_ids) for job in plan.jobs]


def epoch_jobs(args) -> tuple[list[list[int]], list[int]]:
    """The first --jobs jobs (sequence ids) of an epoch plan over log-normal lengths, and the lengths."""
    lengths = sequence_lengths(args)
    return epoch_job_ids(args, lengths, 0)[: args.jobs], lengths


def shape_census(args, lengths: list[int], epochs: int) -> list[dict]:
    """Per epoch: its jobs, and how many of them have a (rows, padded length) shape no earlier job had: the
    forwards that pay cuDNN's plan (no GPU needed)."""
    seen, rows = set(), []
    for epoch in range(epochs):
        jobs = epoch_job_ids(args, lengths, epoch)
        before = len(seen)
        seen.update((len(ids), max(lengths[i] for i in ids)) for ids in jobs)
        rows.append(dict(epoch=epoch, jobs=len(jobs), new_shapes=len(seen) - before))
    return rows


def print_census(args) -> None:
    """--census: for each --census-sequences count, the share of an N-epoch run's jobs that meet a new shape."""
    print("| sequences | jobs per epoch | new shapes by epoch | new-shape share: first epoch | whole run |")
    print("|---|---|---|---|---|")
    for count in args.census_sequences:
        sized = argparse.Namespace(**{**vars(args), "sequences": count})
        census = shape_census(sized, sequence_lengths(sized), args.census)
        new = [r["new_shapes"] for r in census]
        print(f"| {count:,} | {census[0]['jobs']:,} | {', '.join(map(str, new))} | "
              f"{new[0] / census[0]['jobs']:.3f} | {sum(new) / sum(r['jobs'] for r in census):.3f} |", flush=True)


def run_variant(args) -> dict:
    """One variant in this process: the first --jobs jobs forwarded twice, each forward timed to its end."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.target:
        config = TargetConfig(path=args.target, dtype=args.dtype, compile=False)
    else:
        config = TargetConfig(random_init=args.preset, dtype=args.dtype, compile=False,
                              attn_implementation=target_attention(args.preset, device))
    model = load_target(config, device, seed=0)
    if args.num_layers:
        model.model.layers = model.model.layers[: args.num_layers]
    num_layers = len(model.model.layers)
    taps = choose_tap_layer_ids(num_layers, min(5, num_layers))
    capture = TapCapture(model, taps, cudnn_attention=args.variant != "no-cudnn")  # as target.cudnn_attention
    out = allocate(WireSpec.of(batch_shape(args), num_taps=len(taps), hidden=model.config.hidden_size,
                               dtype=model.dtype, has_last_hidden=False), device)
    jobs, lengths = epoch_jobs(args)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    dataset = {i: TokenizedSequence(input_ids=torch.randint(0, vocab, (n,), generator=g),
                                    loss_mask=torch.ones(n, dtype=torch.bool)) for i, n in enumerate(lengths)}
    passes, shapes, computed, real = [], set(), 0, 0
    # one-time costs that are not the shapes' (CUDA modules, library handles, the allocator's first blocks),
    # on a (1, 16) batch: the plan's sequences are 32 tokens or more, so no job has its shape
    capture.run(prepare_inputs([TokenizedSequence(input_ids=dataset[0].input_ids[:16],
                                                  loss_mask=dataset[0].loss_mask[:16])], out), out)
    synchronize(device)
    for _ in range(2):
        t0 = time.perf_counter()
        for job in jobs:
            inputs = job_inputs([dataset[i] for i in job], out, args.variant)
            capture.run(inputs, out)
            shapes.add(tuple(inputs.input_ids.shape))
            computed, real = computed + inputs.padded_tokens, real + inputs.num_tokens
        synchronize(device)  # the pass ends when its last forward has run
        passes.append(time.perf_counter() - t0)
    return dict(variant=args.variant, jobs=len(jobs), shapes=len(shapes), layers=num_layers,
                pass1_ms=1000 * passes[0] / len(jobs), pass2_ms=1000 * passes[1] / len(jobs),
                computed_per_real=computed / real, device=device_name(device),
                cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="an HF model folder (default: --preset with random weights)")
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--num-layers", type=int, default=0, help="keep the first N decoder layers (0: all)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)  # set by the parent: run one variant in this process
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--sequences", type=int, default=20000)
    p.add_argument("--median-length", type=int, default=600)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--num-buckets", type=int, default=8)
    p.add_argument("--census", type=int, default=0, metavar="EPOCHS",
                   help="no forward: count the jobs of an EPOCHS-epoch run that meet a new batch shape")
    p.add_argument("--census-sequences", type=lambda v: [int(x) for x in v.split(",")], default=[10000, 100000],
                   help="--census: the dataset sizes, comma-separated")
    p.add_argument("--smoke", action="store_true", help="tiny target, few jobs, on the CPU")
    p.add_argument("--out", help="also write the JSON into this folder")
    args = p.parse_args()
    if args.smoke:
        args.target, args.preset, args.dtype = None, "tiny", "float32"
        args.jobs, args.sequences, args.median_length, args.max_length = 6, 200, 40, 128
        args.token_budget = 512
    if args.census:
        print_census(args)
        return
    if args.variant:
        print(json.dumps(run_variant(args)), flush=True)
        return
    rows = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            p.error(f"--variants: {variant!r} is not one of {VARIANTS}")
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant],
                               capture_output=True, text=True)
        if child.returncode != 0:
            print(child.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"variant {variant} failed (exit {child.returncode})")
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
        print(f"{variant}: {rows[-1]}", file=sys.stderr, flush=True)
    print("| variant | jobs | distinct shapes | computed / real tokens | ms per forward, pass 1 | pass 2 "
          "| pass 1 - pass 2 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['jobs']} | {r['shapes']} | {r['computed_per_real']:.3f} | {r['pass1_ms']:.1f} "
              f"| {r['pass2_ms']:.1f} | {r['pass1_ms'] - r['pass2_ms']:.1f} |")
    result = dict(bench="target_shapes", commit=git_commit(), target=args.target or args.preset,
                  num_layers=args.num_layers, token_budget=args.token_budget, median_length=args.median_length,
                  rows=rows)
    if args.out:
        write_result(result, "target_shapes", Path(args.target).name if args.target else args.preset, args.out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
