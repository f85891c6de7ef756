"""Does flex attention's flash-attention backend (`kernel_options={"BACKEND": "FLASH"}`, FlashAttention-4) run the
drafter's attention, and does it agree with flex's Triton kernel? One packed batch's real training mask (anchors
sampled as the trainer does, `FlexMaskBuilder`'s tile-level BlockMask and its mask_mod over index buffers), GQA as
the 8B drafter (32 query heads on 8 kv heads, head dim 128), bf16; forward output and the gradients of q, k and v
compared with the Triton kernel's and, on a small problem, both with dense-mask SDPA in fp32.

    python bench/long_context/fa4_check.py [--seq-len 4096] [--blocks-per-seq 682]

Exits 1, with the error, when the backend fails or disagrees; `--out DIR` also writes the errors and the verdict as
`<date>-long_context-fa4_check.json`. Needs CUDA and FA4's packages (bench/long_context/fa4.sh installs them).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package

from dflash_trainer.drafter.anchors import plan_blocks  # noqa: E402
from dflash_trainer.drafter.attention_mask import FlexMaskBuilder, dense_mask, mask_index  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
FLASH = {"BACKEND": "FLASH"}
"""flex_attention's kernel_options for its flash-attention backend."""


def attention_inputs(seq_len: int, num_blocks: int, device: torch.device):
    """(q, k, v) leaf tensors in bf16 and the batch's MaskIndex: two packed sequences, the first 10% of each
    unsupervised (the prompt), blocks sampled as the trainer samples them."""
    gen = torch.Generator().manual_seed(0)
    half = seq_len // 2
    cu = torch.tensor([0, half, seq_len], dtype=torch.int32)
    loss_mask = torch.ones(seq_len, dtype=torch.bool)
    loss_mask[: half // 10] = False
    loss_mask[half : half + half // 10] = False
    input_ids = torch.randint(0, 1000, (seq_len,), generator=gen)
    plan = plan_blocks(input_ids=input_ids, loss_mask=loss_mask, cu_seqlens=cu, num_blocks=num_blocks,
                       block_size=BLOCK, mask_token_id=1, seed=0, epoch=0, job_id=0)
    index = mask_index(plan, cu, seq_len)
    index = type(index)(**{f: getattr(index, f).to(device) for f in type(index).__slots__})
    queries, keys = num_blocks * BLOCK, seq_len + num_blocks * BLOCK
    q = torch.randn(1, HEADS, queries, HEAD_DIM, generator=gen).to(device, torch.bfloat16)  # (1, nh, N*B, hd)
    k = torch.randn(1, KV_HEADS, keys, HEAD_DIM, generator=gen).to(device, torch.bfloat16)  # (1, nkv, T+N*B, hd)
    v = torch.randn(1, KV_HEADS, keys, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    return [t.requires_grad_() for t in (q, k, v)], index


def run(attend, q, k, v, grad_out):
    """Output and (dq, dk, dv) of `attend` for upstream gradient `grad_out`."""
    for t in (q, k, v):
        t.grad = None
    out = attend(q, k, v)
    out.backward(grad_out)
    return [out.detach().float()] + [t.grad.float() for t in (q, k, v)]


def compare(name: str, got, want) -> float:
    """The largest error relative to the reference's scale over output, dq, dk and dv; printed per tensor."""
    worst = 0.0
    for label, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()
        worst = max(worst, err)
        print(f"  {name} {label}: max |diff| / max |ref| = {err:.2e}")
    return worst


def check(args) -> dict:
    """The verdict (`ok`, and `failure` when not) with each relative error measured before it was reached."""
    from torch.nn.attention.flex_attention import flex_attention

    def flex(mask, options):
        return torch.compile(lambda a, b, c: flex_attention(a, b, c, block_mask=mask, enable_gqa=True,
                                                            kernel_options=options), dynamic=False)

    device = torch.device("cuda")
    (q, k, v), index = attention_inputs(args.seq_len, args.blocks_per_seq, device)
    mask = FlexMaskBuilder().build(index)
    grad_out = torch.randn_like(q)
    reference = run(flex(mask, None), q, k, v, grad_out)
    try:
        got = run(flex(mask, FLASH), q, k, v, grad_out)
    except Exception as e:  # noqa: BLE001 (the backend's own error is the finding)
        traceback.print_exc()
        return {"ok": False, "failure": f"the flash backend did not run the drafter's attention: {e!r}"[:2000]}
    worst = compare("flash vs triton", got, reference)
    found = {"flash_vs_triton": worst}
    if worst > args.tolerance:
        return {"ok": False, **found, "failure": f"flash and triton differ by {worst:.2e} (relative) > "
                                                 f"{args.tolerance:.0e}"}
    # a small problem against the obviously-correct dense path (fp32 SDPA with the same rule, kv heads repeated):
    # the flash backend's error there within twice the Triton kernel's
    (q2, k2, v2), index2 = attention_inputs(512, 64, device)
    mask2 = FlexMaskBuilder().build(index2)
    dense = dense_mask(index2)  # (N*B, T+N*B)

    def sdpa(a, b, c):
        groups = HEADS // KV_HEADS
        b, c = b.float().repeat_interleave(groups, dim=1), c.float().repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(a.float(), b, c, attn_mask=dense)

    grad2 = torch.randn_like(q2)
    exact = run(sdpa, q2, k2, v2, grad2)
    found["triton_vs_fp32"] = compare("triton vs dense fp32", run(flex(mask2, None), q2, k2, v2, grad2), exact)
    found["flash_vs_fp32"] = compare("flash vs dense fp32", run(flex(mask2, FLASH), q2, k2, v2, grad2), exact)
    if found["flash_vs_fp32"] > 2 * found["triton_vs_fp32"] + 1e-3:
        return {"ok": False, **found, "failure": f"against fp32, flash's error {found['flash_vs_fp32']:.2e} is "
                                                 f"over twice triton's {found['triton_vs_fp32']:.2e}"}
    return {"ok": True, **found}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--blocks-per-seq", type=int, default=682, help="blocks in the batch (512 per 3,072 tokens)")
    p.add_argument("--tolerance", type=float, default=5e-2, help="largest flash-vs-triton error accepted (bf16)")
    p.add_argument("--out", type=Path, default=None, help="folder for the result JSON (default: printed only)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("fa4_check needs CUDA")
        return 1
    verdict = check(args)
    if verdict["ok"]:
        print(f"OK: the flash backend runs the drafter's attention (vs triton {verdict['flash_vs_triton']:.2e}; "
              f"vs fp32 {verdict['flash_vs_fp32']:.2e}, triton's {verdict['triton_vs_fp32']:.2e})")
    else:
        print(f"FAIL: {verdict['failure']}")
    if args.out:
        from bench.common import write_result

        write_result({"bench": "fa4_check", "command": " ".join(sys.argv), "seq_len": args.seq_len,
                      "blocks_per_seq": args.blocks_per_seq, "tolerance": args.tolerance,
                      "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), **verdict},
                     "long_context", "fa4_check", args.out)
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
