"""The experts of one MoE layer, compiled: transformers' `grouped_mm` forward against other ways to combine.

    python bench/large_targets/moe_experts.py                 # CUDA: the Qwen3-30B-A3B shape, 18,432 tokens (16K + padding)
    python bench/large_targets/moe_experts.py --smoke         # a tiny shape on the CPU: the variants agree (checks the script)

The combine step of transformers' `grouped_mm` experts (each token's top-k expert outputs gathered back from
expert order by the inverse permutation, then summed) is where the kernel profile of a MoE target's forward
points (`bench/RESULTS.md`). Each variant below is the whole experts forward (sort by expert, grouped GEMMs,
gating, combine) under torch.compile; only the combine differs:
  grouped_mm    transformers' own (`config._experts_implementation = "grouped_mm"`): the baseline
  index_copy    expert rows copied into token order (a permutation, so deterministic), weighted, summed over k
  index_add     expert rows weighted in expert order, then added into an fp32 (tokens, H) buffer by token index
Prints ms per call and each variant's largest difference from the baseline; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

from dflash_trainer.target.presets import preset_config  # noqa: E402


def _grouped_linear(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(S, in) rows in expert order times each expert's (out, in) weight: (S, out). The GEMM transformers runs."""
    if rows.is_cuda:
        return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
    starts = [0, *offsets.tolist()]  # the CPU smoke: one matmul per expert
    return torch.cat([rows[a:b] @ w.T for a, b, w in zip(starts, starts[1:], weight)])


def _expert_rows(experts, hidden: torch.Tensor, top_k_index: torch.Tensor):
    """Hidden states in expert order through both grouped GEMMs: (S, H) rows, perm (S,) of flat (token, k) ids."""
    k = top_k_index.shape[1]
    expert_ids, perm = torch.sort(top_k_index.reshape(-1))  # (S,), (S,)
    counts = torch.histc(expert_ids.int() if hidden.is_cuda else expert_ids.float(), bins=experts.num_experts,
                         min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # (E,)
    rows = hidden[perm // k]  # (S, H)
    rows = experts._apply_gate(_grouped_linear(rows, experts.gate_up_proj, offsets))  # (S, I)
    return _grouped_linear(rows, experts.down_proj, offsets), perm  # (S, H)


def index_copy_forward(experts, hidden, top_k_index, top_k_weights):
    rows, perm = _expert_rows(experts, hidden, top_k_index)
    t, k = top_k_index.shape
    by_token = rows.new_empty(rows.shape).index_copy_(0, perm, rows).view(t, k, -1)  # (T, k, H)
    return (by_token.float() * top_k_weights[..., None].float()).sum(1).to(hidden.dtype)  # (T, H)


def index_add_forward(experts, hidden, top_k_index, top_k_weights):
    rows, perm = _expert_rows(experts, hidden, top_k_index)
    k = top_k_index.shape[1]
    weighted = rows.float() * top_k_weights.reshape(-1)[perm, None].float()  # (S, H)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # (T, H)
    return out.index_add_(0, perm // k, weighted).to(hidden.dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b"],
                   help="a Qwen3-MoE shape (its experts class is the one built here)")
    p.add_argument("--tokens", type=int, default=18432)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    preset = "tiny-moe" if args.smoke else args.preset
    config = preset_config(preset)
    if args.smoke:  # top 3 of 8 experts: groups of uneven sizes, some perhaps empty, 3 terms to each sum
        config.num_experts, config.num_experts_per_tok = 8, 3
    tokens = 64 if args.smoke else args.tokens
    dtype = torch.float32 if args.smoke else torch.bfloat16
    config._experts_implementation = "grouped_mm"
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to(device, dtype)
    for w in (experts.gate_up_proj, experts.down_proj):
        torch.nn.init.normal_(w, std=0.02)
    hidden = torch.randn(tokens, config.hidden_size, device=device, dtype=dtype)  # (T, H)
    logits = torch.randn(tokens, config.num_experts, device=device)  # (T, E): a router's scores
    top_k_weights, top_k_index = torch.topk(logits.softmax(-1), config.num_experts_per_tok, dim=-1)  # (T, k)
    top_k_weights = (top_k_weights / top_k_weights.sum(-1, keepdim=True)).to(dtype)

    variants = {"grouped_mm": lambda *a: experts(*a), "index_copy": lambda *a: index_copy_forward(experts, *a),
                "index_add": lambda *a: index_add_forward(experts, *a)}
    rows, want = [], None
    for name, fn in variants.items():
        compiled = fn if args.smoke else torch.compile(fn, dynamic=False)
        with torch.no_grad():
            out = compiled(hidden, top_k_index, top_k_weights)
            want = out if want is None else want
            # read on the host once per variant, before timing
            diff = float((out.float() - want.float()).abs().max() / want.float().abs().max())
            ms = None
            if not args.smoke:
                for _ in range(3):
                    compiled(hidden, top_k_index, top_k_weights)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.iters):
                    compiled(hidden, top_k_index, top_k_weights)
                end.record()
                torch.cuda.synchronize()  # the events' times are read on the host
                ms = start.elapsed_time(end) / args.iters
        rows.append({"variant": name, "ms": ms, "max_rel_diff": diff})
        print(f"{name:12s} ms {ms if ms is None else round(ms, 3)}  max rel diff from grouped_mm {diff:.2e}")
    if args.smoke:
        assert all(r["max_rel_diff"] < 1e-5 for r in rows), rows
    print(json.dumps({"bench": "moe_experts", "preset": preset, "tokens": tokens, "k": config.num_experts_per_tok,
                      "rows": rows}))


if __name__ == "__main__":
    main()
