"""Drafter training step (forward + backward) at the Qwen3-8B shape: flex + torch.compile vs an eager SDPA baseline.

Run on a CUDA machine:  python bench/drafter_step.py [--steps N]     (about 1-2 minutes)
Smoke test anywhere:    python bench/drafter_step.py --smoke          (tiny shapes, CPU if no GPU)

Shape (default): H=4096, 32 heads / 8 kv heads, head_dim 128, intermediate 12288, 5 layers, K=5 taps,
vocab 151936, B=16, T=3072 packed tokens (2 sequences), 512 blocks; bf16 weights; frozen random embedding
and head. One step = sample blocks + build masks + drafter forward + chunked loss + backward (no optimizer).

Model FLOPs per step (useful work only; activation-checkpoint recomputation and masked-out scores are not
counted), with Q = N*B block tokens, T context tokens, P = visible (query, key) pairs:
  fc          2*T*(K*H)*H               x2 (forward + weight grad; taps need no grad)
  per layer   2*Q*H*(nh*hd) [q] + 2*2*(Q+T)*H*(nkv*hd) [k, v] + 2*Q*(nh*hd)*H [o] + 3*2*Q*H*I [mlp]
              x3 (forward + input grad + weight grad)
  attention   4*P*hd*nh (QK^T and PV)   x3
  lm head     2*N*(B-1)*H*V             x2 (forward + input grad; the head is frozen)
  P = sum over valid blocks of B*(anchor_pos + B)   (full attention: context before the anchor + own block)
MFU = FLOPs / step time / 789 TFLOP/s. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from flops import PEAK_TFLOPS, drafter_step_flops  # noqa: E402  (bench/flops.py: the FLOP formulas)

from dflash_trainer.drafter.anchors import plan_blocks  # noqa: E402
from dflash_trainer.drafter.loss import drafter_loss  # noqa: E402
from dflash_trainer.drafter.model import DFlashDrafter  # noqa: E402
from dflash_trainer.drafter.spec import DrafterSpec  # noqa: E402

SHAPES = {
    "qwen3-8b": dict(H=4096, nh=32, nkv=8, hd=128, I=12288, L=5, K=5, V=151936, B=16, T=3072, N=512, seqs=(1800, 1272)),
    "smoke": dict(H=64, nh=4, nkv=2, hd=16, I=128, L=2, K=2, V=1000, B=4, T=64, N=8, seqs=(40, 20)),
}


def build(shape: dict, device: torch.device, dtype: torch.dtype):
    spec = DrafterSpec(
        hidden_size=shape["H"], num_attention_heads=shape["nh"], num_key_value_heads=shape["nkv"],
        head_dim=shape["hd"], intermediate_size=shape["I"], rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, max_position_embeddings=40960,
        num_layers=shape["L"], block_size=shape["B"], tap_layer_ids=tuple(range(1, 1 + 2 * shape["K"], 2)),
        mask_token_id=shape["V"] - 1, num_target_layers=2 * shape["K"] + 2, vocab_size=shape["V"],
        layer_types=("full_attention",) * shape["L"],
    )
    with torch.device(device):
        model = DFlashDrafter(spec).to(dtype)
        embed = (torch.randn(shape["V"], shape["H"]) * 0.02).to(dtype)
        head = (torch.randn(shape["V"], shape["H"]) * 0.02).to(dtype)
        T, seqs = shape["T"], shape["seqs"]
        max_seqs = T // (2 * shape["B"])
        cu = torch.full((max_seqs + 1,), sum(seqs), dtype=torch.int32)
        cu[: len(seqs) + 1] = torch.tensor([0, *torch.tensor(seqs).cumsum(0).tolist()], dtype=torch.int32)
        input_ids = torch.randint(0, shape["V"] - 1, (T,))
        loss_mask = torch.ones(T, dtype=torch.bool)
        start = 0
        for n in seqs:  # first 10% of each sequence is the (unsupervised) prompt
            loss_mask[start : start + n // 10] = False
            start += n
        loss_mask[start:] = False
        taps = torch.randn(T, shape["K"] * shape["H"]).to(dtype)
    return model, embed, head, dict(taps=taps, input_ids=input_ids, loss_mask=loss_mask, cu_seqlens=cu)


def run_variant(name, attention, compiled, shape, model, embed, head, batch, steps, warmup, device):
    model.attention = attention
    forward = torch.compile(model.forward_train, dynamic=False) if compiled else model.forward_train
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one_step(job_id: int):
        plan = plan_blocks(input_ids=batch["input_ids"], loss_mask=batch["loss_mask"], cu_seqlens=batch["cu_seqlens"],
                           num_blocks=shape["N"], block_size=shape["B"], mask_token_id=shape["V"] - 1,
                           seed=0, epoch=0, job_id=job_id)
        masks = model.build_masks(plan, batch["cu_seqlens"], shape["T"])
        hidden = forward(taps=batch["taps"], cu_seqlens=batch["cu_seqlens"], plan=plan, embed_weight=embed, masks=masks)
        out = drafter_loss(hidden, plan, lm_head_weight=head, gamma=7.0 if shape["B"] == 16 else 2.0, chunk_rows=2048)
        (out.loss_sum / out.weight_sum).backward()
        for p in model.parameters():
            p.grad = None
        return plan, out

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(warmup):
        plan, out = one_step(i)
    sync()  # timing boundary
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        plan, out = one_step(warmup + i)
    sync()  # timing boundary
    step_s = (time.perf_counter() - t0) / steps
    flops = drafter_step_flops(model.spec, anchor_pos=plan.anchor_pos[plan.block_valid], context_tokens=shape["T"])
    return {
        "variant": name,
        "step_ms": step_s * 1e3,
        "tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / 1e12 / PEAK_TFLOPS,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "warmup_s": compile_s,
        "loss": float((out.loss_sum / out.weight_sum).detach()),  # host sync: reporting only
        "step_tflop": flops / 1e12,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (runs on CPU)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the eager SDPA baseline")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU smoke path", file=sys.stderr)
        return 2
    shape = SHAPES["smoke" if args.smoke else "qwen3-8b"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model, embed, head, batch = build(shape, device, dtype)
    if device.type == "cuda":
        variants = [("flex+compile", "flex", True)] + ([] if args.no_baseline else [("sdpa eager", "sdpa", False)])
    else:  # flex_attention has no backward on CPU
        variants = [("sdpa eager", "sdpa", False)]
    results = []
    for name, attention, compiled in variants:
        try:
            results.append(run_variant(name, attention, compiled, shape, model, embed, head, batch,
                                       args.steps, args.warmup, device))
        except torch.cuda.OutOfMemoryError as e:
            results.append({"variant": name, "error": f"OOM: {str(e).splitlines()[0]}"})
            torch.cuda.empty_cache()

    print(f"\ndrafter step, shape={'smoke' if args.smoke else 'qwen3-8b'} device={device} dtype={dtype}")
    print(f"{'variant':<14}{'step ms':>10}{'TFLOP/s':>10}{'MFU':>8}{'peak GB':>10}{'warmup s':>10}  loss")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<14}  {r['error']}")
        else:
            print(f"{r['variant']:<14}{r['step_ms']:>10.1f}{r['tflops']:>10.1f}{r['mfu']:>8.1%}"
                  f"{r['peak_mem_gb'] or 0:>10.1f}{r['warmup_s']:>10.1f}  {r['loss']:.3f}")
    ok = [r for r in results if "error" not in r]
    speedup = ok[1]["step_ms"] / ok[0]["step_ms"] if len(ok) == 2 else None
    if speedup:
        print(f"speedup {ok[0]['variant']} vs {ok[1]['variant']}: {speedup:.2f}x")
    print(json.dumps({"bench": "drafter_step", "shape": shape, "device": str(device), "peak_tflops": PEAK_TFLOPS,
                      "results": results, "speedup": speedup}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
