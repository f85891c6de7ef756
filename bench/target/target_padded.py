"""Why the target forward idles on mixed-length batches: one padded batch, profiled, under a few settings.

    python bench/target/target_padded.py            # CUDA: Qwen3-8B shape, random bf16 weights, ~1 min
    python bench/target/target_padded.py --smoke    # tiny target on the CPU (checks the script runs)

The batch holds 12 sequences of mixed lengths (150 to 3072 tokens) right-padded to the longest, as the
target worker does: a worst case for padding (2.9x the real tokens; the epoch plan's length buckets keep
real jobs near 10%). Each variant runs TapCapture.run (early exit, tap gather) under torch.profiler and reports
wall time, GPU kernel time and idle time per forward:
  padded        the batch as the worker builds it (right-padded, no attention mask: causal fast path)
  padding mask  the same batch with the textbook (B, S) padding mask passed to the decoder (the worker's
                way before commit "target: padded batches run without an attention mask")
  no cudnn sdpa the padding-mask variant with the cuDNN SDPA backend disabled (memory-efficient instead)
  equal         as many tokens in equal-length sequences (no padding)
Then the same weights in fp32 run each sequence alone: the taps of every variant on the mixed batch are
compared with that reference, tap layer by tap layer (padding without a mask must be as exact as with one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.kernel_profile import print_profile, profile_dict, profile_steps  # noqa: E402

from dflash_trainer.data.types import TokenizedSequence  # noqa: E402
from dflash_trainer.transport.wire import WireSpec, allocate  # noqa: E402
from dflash_trainer.target.capture import TapCapture, prepare_inputs  # noqa: E402
from dflash_trainer.target.config import TargetConfig  # noqa: E402
from dflash_trainer.target.load import load_target  # noqa: E402

LENGTHS = {"qwen3-8b": [3072, 2210, 1705, 1490, 1180, 930, 705, 540, 410, 300, 210, 150],
           "tiny": [64, 40, 33, 20]}


def sequences(lengths: list[int], vocab: int) -> list[TokenizedSequence]:
    g = torch.Generator().manual_seed(0)
    return [TokenizedSequence(input_ids=torch.randint(0, vocab, (n,), generator=g),
                              loss_mask=torch.ones(n, dtype=torch.bool)) for n in lengths]


def run_capture(capture: TapCapture, inputs, out, mask) -> None:
    """TapCapture.run, with `mask` handed to the decoder as its attention_mask when one is given."""
    if mask is None:
        return capture.run(inputs, out)
    forward = capture.decoder.forward
    capture.decoder.forward = lambda **kw: forward(attention_mask=mask, **kw)
    try:
        capture.run(inputs, out)
    finally:
        del capture.decoder.forward  # back to the class's forward


def taps_alone(capture: TapCapture, batch: list[TokenizedSequence], device: torch.device) -> torch.Tensor:
    """The taps of each sequence run alone (batch of one, no padding) in the model's dtype, packed: (n, K*H)."""
    rows = []
    for seq in batch:
        spec = WireSpec(token_budget=seq.num_tokens, max_seqs=1, num_taps=len(capture.tap_layer_ids),
                        hidden=capture.hidden, dtype=next(capture.decoder.parameters()).dtype, has_last_hidden=False)
        out = allocate(spec, device)
        capture.run(prepare_inputs([seq], out), out)
        rows.append(out.taps.float())
    return torch.cat(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    preset = "tiny" if args.smoke else "qwen3-8b"
    dtype = "float32" if args.smoke else "bfloat16"
    model = load_target(TargetConfig(random_init=preset, dtype=dtype), device)
    taps = [1, 3] if args.smoke else [1, 9, 17, 25, 33]
    capture = TapCapture(model, taps)
    lengths = LENGTHS[preset]
    total = sum(lengths)
    equal = [total // len(lengths)] * len(lengths)
    vocab = model.config.vocab_size - 1000
    results, taps_of = {}, {}
    variants = (("padded", lengths), ("padding mask", lengths), ("no cudnn sdpa", lengths), ("equal", equal))
    for name, lens in variants:
        spec = WireSpec(token_budget=total, max_seqs=len(lens), num_taps=len(taps), hidden=model.config.hidden_size,
                        dtype=model.dtype, has_last_hidden=False)
        out = allocate(spec, device)
        batch = sequences(lens, vocab)
        cudnn = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(name != "no cudnn sdpa")
        mask = None
        if name in ("padding mask", "no cudnn sdpa"):
            mask = (torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]).to(device)  # (B, S)
        try:
            run = lambda i: run_capture(capture, prepare_inputs(batch, out), out, mask)  # noqa: E731
            for i in range(2):  # warmup (kernel selection, caches)
                run(i)
            prof = profile_steps(run, args.steps, device)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        print_profile(f"{name}: {len(lens)} sequences, {sum(lens)} tokens, padded to {max(lens)}", prof)
        results[name] = profile_dict(prof)
        if lens is lengths:
            taps_of[name] = out.taps[: sum(lens)].float().clone()  # (n, K*H)
    # The mask changes no real token's taps, so every variant must be as close to an fp32 run of each
    # sequence alone (same weights) as the others: differences are kernel rounding, layer by layer.
    model.float()
    reference = taps_alone(capture, sequences(lengths, vocab), device)  # (n, K*H) fp32
    h = model.config.hidden_size
    errors = {name: [((t[:, k * h:(k + 1) * h] - reference[:, k * h:(k + 1) * h]).abs().mean()
                      / reference[:, k * h:(k + 1) * h].abs().mean()).item() for k in range(len(taps))]
              for name, t in taps_of.items()}
    print("\ntaps against each sequence alone in fp32: mean |error| / mean |tap|, per tap layer")
    print(f"{'variant':<16}" + "".join(f"{f'layer {t}':>10}" for t in taps))
    for name, errs in errors.items():
        print(f"{name:<16}" + "".join(f"{e:>10.4f}" for e in errs))
    print(f"\n{'variant':<16}{'wall ms':>10}{'kernel ms':>11}{'idle ms':>10}")
    for name, r in results.items():
        busy = sum(r["by_kind_ms"].values())
        print(f"{name:<16}{r['wall_ms']:>10.1f}{busy:>11.1f}{max(r['wall_ms'] - busy, 0):>10.1f}")
    print(json.dumps({"bench": "target_padded", "model": preset, "lengths": lengths, "results": results,
                      "tap_relative_error_vs_fp32_alone": errors}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
