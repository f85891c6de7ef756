"""A TP=2 target group's taps on the GPU path (sharded, layers compiled) against the same target on one rank.

    python bench/large_targets/target_parallel.py             # CUDA: qwen3-1.7b shape, bf16, both ranks on cuda:0 (gloo)
    python bench/large_targets/target_parallel.py --eager     # the same with eager decoder layers
    python bench/large_targets/target_parallel.py --smoke     # tiny target on the CPU, no compile (checks the script)

Where only one GPU is lent, both ranks of the group share it and talk over gloo (NCCL refuses two ranks on one
device): this checks what a multi-GPU run would meet first, transformers' tensor-parallel plan on CUDA tensors
with each decoder layer compiled as `target.compile` does (`runtime/setup.py: load_checked_target`), not speed.
Rank 0 then builds the same weights alone (same seed), runs the same batch, and compares the taps. The
timing printed is of two ranks sharing one GPU through gloo: no measure of TP speed. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import free_port  # noqa: E402  (bench/common.py)

from dflash_trainer.data.types import TokenizedSequence  # noqa: E402
from dflash_trainer.target.capture import TapCapture, compile_decoder_layers, prepare_inputs  # noqa: E402
from dflash_trainer.target.checks import choose_tap_layer_ids  # noqa: E402
from dflash_trainer.target.config import TargetConfig  # noqa: E402
from dflash_trainer.target.load import find_decoder_layers, load_target  # noqa: E402
from dflash_trainer.target.parallel import shard_target  # noqa: E402
from dflash_trainer.target.presets import preset_config  # noqa: E402
from dflash_trainer.transport.wire import WireSpec, allocate  # noqa: E402

SEED = 7


def taps_of(model, taps: list[int], lengths: list[int], vocab: int, device: torch.device, compiled: bool,
            iters: int) -> tuple[torch.Tensor, float]:
    """The packed taps (token_budget, num_taps * H) of one batch, on the host, and the mean ms of `iters` more
    forwards."""
    g = torch.Generator().manual_seed(0)
    sequences = [TokenizedSequence(input_ids=torch.randint(0, vocab, (n,), generator=g),
                                   loss_mask=torch.ones(n, dtype=torch.bool)) for n in lengths]
    hidden = model.config.hidden_size
    spec = WireSpec(token_budget=sum(lengths), max_seqs=len(lengths), num_taps=len(taps), hidden=hidden,
                    dtype=next(model.parameters()).dtype, has_last_hidden=False)
    out = allocate(spec, device)
    capture = TapCapture(model, taps)
    if compiled:
        compile_decoder_layers(model, upto=capture.stop_layer, dynamic=None)
    with torch.no_grad():
        capture.run(prepare_inputs(sequences, out), out)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the first forward (compiles included) ends before the clock starts
        start = time.perf_counter()
        for _ in range(iters):
            capture.run(prepare_inputs(sequences, out), out)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the forwards' time is read on the host
    ms = (time.perf_counter() - start) * 1e3 / max(iters, 1)
    return out.taps.float().cpu(), ms  # to the host: the ranks hand their taps over in files


def _rank(rank: int, port: int, args: argparse.Namespace, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu" if args.smoke else "cuda:0")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    target = TargetConfig(random_init=args.preset, dtype=args.dtype)
    model = load_target(target, "cpu", seed=SEED)  # as a target group's ranks do: whole on the host, then shards
    model = shard_target(model, dist.new_group([0, 1]), device)
    local = find_decoder_layers(model)[0].mlp.up_proj.weight
    got, ms = taps_of(model, args.taps, args.lengths, model.config.vocab_size, device, args.compiled, args.iters)
    torch.save({"taps": got, "ms": ms, "up_local": tuple(local.to_local().shape), "up_full": tuple(local.shape)},
               os.path.join(out_dir, f"r{rank}.pt"))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--preset", default="qwen3-1.7b")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="leave the decoder layers eager (the CPU smoke does)")
    args = p.parse_args()
    args.compiled = not (args.smoke or args.eager)
    if args.smoke:
        args.preset, args.iters = "tiny", 1
    args.dtype = "float32" if args.smoke else "bfloat16"
    args.lengths = [48, 80, 20] if args.smoke else [1500, 2048, 700]
    args.taps = choose_tap_layer_ids(preset_config(args.preset).num_hidden_layers, 3 if args.smoke else 5)
    device = torch.device("cpu" if args.smoke else "cuda:0")
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(free_port(), args, out_dir), nprocs=2, start_method="spawn")
        ranks = [torch.load(os.path.join(out_dir, f"r{i}.pt"), weights_only=True) for i in range(2)]
    # built on the host as the group's ranks built theirs: a seed gives other weights on the GPU's generator
    model = load_target(TargetConfig(random_init=args.preset, dtype=args.dtype), "cpu", seed=SEED).to(device)
    want, ms_alone = taps_of(model, args.taps, args.lengths, model.config.vocab_size, device, args.compiled, args.iters)
    n = sum(args.lengths)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a[:n] - b[:n]).norm() / b[:n].norm())

    result = {
        "bench": "target_parallel", "preset": args.preset, "dtype": args.dtype, "device": str(device),
        "compiled": args.compiled, "lengths": args.lengths, "taps": args.taps,
        "up_proj_full": ranks[0]["up_full"], "up_proj_local": ranks[0]["up_local"],
        "tp2_vs_tp1_rel_error": [rel(r["taps"], want) for r in ranks],
        "rank0_vs_rank1_rel_error": rel(ranks[0]["taps"], ranks[1]["taps"]),
        "tp1_ms": ms_alone, "tp2_ms_shared_gpu_gloo": [r["ms"] for r in ranks],
    }
    print(f"{args.preset} {args.dtype} on {device}, taps {args.taps}: TP=2 taps against TP=1, relative error "
          f"{result['tp2_vs_tp1_rel_error']}; rank 0 against rank 1 {result['rank0_vs_rank1_rel_error']:.2e}; "
          f"up_proj {result['up_proj_full']} held as {result['up_proj_local']} per rank")
    print(json.dumps(result))
    # bf16 rounds the sharded matmuls' partial sums otherwise than one rank's (fp32 on the CPU: to ~1e-7)
    tolerance = 1e-5 if args.dtype == "float32" else 0.05
    errors = [*result["tp2_vs_tp1_rel_error"], result["rank0_vs_rank1_rel_error"]]
    if max(errors) > tolerance:
        sys.exit(f"TP=2 taps differ from TP=1 (or between the ranks) beyond {tolerance}: {errors}")


if __name__ == "__main__":
    main()
