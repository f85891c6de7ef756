"""Target forward benchmark: tokens/s and MFU of the tap-capture forward, early-exit savings, capture overhead.

    python bench/target/target_forward.py                 # CUDA: Qwen3-8B shape, random bf16 weights made on the GPU
    python bench/target/target_forward.py --preset qwen3-30b-a3b   # a MoE shape (FLOPs by active experts)
    python bench/target/target_forward.py --smoke         # tiny target on the CPU (checks the script runs)
    python bench/target/target_forward.py --quantize none,fp8             # bf16 and FP8 targets in the same run
    python bench/target/target_forward.py --preset llama3-70b --quantize fp8 --budgets 8192,16384
    python bench/target/target_forward.py --smoke --preset tiny-moe   # the same with a tiny MoE target
    python bench/target/target_forward.py --preset qwen3-30b-a3b --budgets 16384 --profile   # GPU time by kernel kind

For each token budget, 3072-token sequences (the last one shorter) fill the budget exactly; they are
right-padded into one batch as the target worker does. Modes, each eager and with compiled decoder layers:
  full      the causal LM to logits (every layer, final norm, LM head): the baseline
  to_tap    decoder stopped after the last tap by a hook, no capture
  capture   TapCapture.run: to_tap + one gather-copy per tap into the packed buffer
Derived: early-exit saving = 1 - capture/full; capture overhead = capture/to_tap - 1 (target < 3%).
MFU counts useful FLOPs only (real tokens; causal attention within each sequence) against --peak-tflops
(the bf16 peak, for FP8 rows too: an FP8 row's MFU above the bf16 one is its speedup).
--quantize runs each listed target in turn (target.quantize: `none` or `fp8`); FP8 targets with random weights
are built on the meta device and made real one decoder layer at a time, each quantized as it is made, so a
Llama-3-70B shape (141 GB in bf16) is ~72 GB on the GPU. Derived: fp8 speedup = bf16 capture time / FP8
capture time at the same budget and compilation. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import allocated_gb, peak_gb, reset_memory, target_attention  # noqa: E402  (bench/common.py)
from bench.flops import target_forward_flops  # noqa: E402  (bench/flops.py: the FLOP formulas)
from bench.kernel_profile import print_profile, profile_dict, profile_steps  # noqa: E402  (bench/kernel_profile.py)

from dflash_trainer.data.types import TokenizedSequence  # noqa: E402
from dflash_trainer.transport.wire import WireSpec, allocate  # noqa: E402
from dflash_trainer.target.capture import TapCapture, compile_decoder_layers, prepare_inputs  # noqa: E402
from dflash_trainer.target.checks import choose_tap_layer_ids  # noqa: E402
from dflash_trainer.target.config import TargetConfig  # noqa: E402
from dflash_trainer.target.load import find_decoder, load_target  # noqa: E402
from dflash_trainer.target.presets import PRESETS  # noqa: E402


class _Stop(Exception):
    pass


def make_sequences(budget: int, seq_len: int, vocab: int, seed: int) -> list[TokenizedSequence]:
    g = torch.Generator().manual_seed(seed)
    lengths = [seq_len] * (budget // seq_len) + ([budget % seq_len] if budget % seq_len else [])
    return [
        TokenizedSequence(input_ids=torch.randint(0, vocab, (n,), generator=g), loss_mask=torch.ones(n, dtype=torch.bool))
        for n in lengths
    ]


def timed(fn, *, iters: int, warmup: int, device: torch.device) -> float:
    """Seconds per call: CUDA events around `iters` calls after `warmup` (wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()  # benchmark boundary: read the elapsed device time
        return start.elapsed_time(end) / 1000.0 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny target on the CPU, small budgets, no compile")
    p.add_argument("--preset", choices=sorted(PRESETS), help="default qwen3-8b (tiny with --smoke, which takes "
                   "only the tiny presets)")
    p.add_argument("--quantize", default="none", help="comma list of target.quantize values to run: none, fp8")
    p.add_argument("--budgets", default="8192,16384,32768")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--taps", help="tap layer ids, e.g. 1,9,17,25,33 (default: 5 spread as the trainer does)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--coordinate-descent", action="store_true", help="compile the layers with Inductor's "
                   "coordinate-descent autotuning (longer compiles; torchao's set_inductor_config turns it on for "
                   "the whole process, which target.quantize=fp8 keeps off)")
    p.add_argument("--profile", action="store_true", help="profile 2 more capture forwards per budget and "
                   "compilation: GPU time by kernel kind (where a MoE target's time goes)")
    p.add_argument("--peak-tflops", type=float, default=789.0, help="measured bf16 matmul peak of one H200 (issue calibration: 789)")
    args = p.parse_args(argv)
    if args.smoke:
        if args.preset is not None and not args.preset.startswith("tiny"):
            p.error(f"--smoke runs on the CPU: pick a tiny preset, not {args.preset}")
        args.preset, args.budgets, args.seq_len, args.taps = args.preset or "tiny", "256,512", 96, "0,2,4"
        args.iters, args.warmup, args.no_compile = 2, 1, True
    args.preset = args.preset or "qwen3-8b"
    return args


def progress(line: str) -> None:
    """A line on stderr as each part ends, so that a run stopped by its time limit still says how far it got."""
    print(line, file=sys.stderr, flush=True)


def run_target(args, quantize: str, device: torch.device, dtype: str, budgets: list[int]) -> tuple[list, dict]:
    """Rows of every mode x budget x compilation of one target, and what it holds in memory."""
    reset_memory(device)
    attention = target_attention(args.preset, device)
    t0 = time.perf_counter()
    model = load_target(TargetConfig(random_init=args.preset, dtype=dtype, attn_implementation=attention,
                                     quantize=None if quantize == "none" else quantize), device, seed=0)
    config = model.config
    taps = ([int(t) for t in args.taps.split(",")] if args.taps
            else choose_tap_layer_ids(config.num_hidden_layers, 5))
    memory = dict(quantize=quantize, taps=taps, attn_implementation=attention, weights_gb=allocated_gb(device))
    progress(f"{args.preset} target, quantize {quantize}: built in {time.perf_counter() - t0:.0f} s, "
             f"weights {memory['weights_gb'] or 0:.1f} GiB")
    decoder, stop_layer = find_decoder(model), max(taps)
    capture = TapCapture(model, taps)

    def to_tap(inputs) -> None:
        def stop(module, a, out):
            raise _Stop

        handle = decoder.layers[stop_layer].register_forward_hook(stop)
        try:
            with torch.no_grad():
                decoder(input_ids=inputs.input_ids, use_cache=False)
        except _Stop:
            pass
        finally:
            handle.remove()

    def full(inputs) -> None:
        with torch.no_grad():
            model(input_ids=inputs.input_ids, use_cache=False)

    rows = []
    for compiled in [False] if args.no_compile else [False, True]:
        if compiled:
            compile_decoder_layers(model, **({"options": {"coordinate_descent_tuning": True}}
                                             if args.coordinate_descent else {}))
        for budget in budgets:
            sequences = make_sequences(budget, args.seq_len, config.vocab_size, seed=budget)
            lengths = [s.num_tokens for s in sequences]
            spec = WireSpec(token_budget=budget, max_seqs=len(lengths), num_taps=len(taps),
                            hidden=config.hidden_size, dtype=model.dtype, has_last_hidden=False)
            out = allocate(spec, device)
            inputs = prepare_inputs(sequences, out)
            modes = {
                "full": (lambda: full(inputs), config.num_hidden_layers, True),
                "to_tap": (lambda: to_tap(inputs), stop_layer + 1, False),
                "capture": (lambda: capture.run(inputs, out), stop_layer + 1, False),
            }
            for mode, (fn, layers_run, head) in modes.items():
                seconds = timed(fn, iters=args.iters, warmup=args.warmup, device=device)
                flops = target_forward_flops(config, lengths, num_layers=layers_run, lm_head=head)
                rows.append(dict(quantize=quantize, budget=budget, compiled=compiled, mode=mode, ms=seconds * 1e3,
                                 tokens_per_s=sum(lengths) / seconds, padded_tokens=inputs.padded_tokens,
                                 mfu=flops / seconds / (args.peak_tflops * 1e12)))
                progress(f"{quantize} budget {budget} compiled {compiled} {mode}: {seconds * 1e3:.1f} ms")
            if args.profile:
                kernels = profile_steps(lambda i: capture.run(inputs, out), 2, device)
                print_profile(f"{args.preset} {quantize} capture, budget {budget}, compiled {compiled}", kernels)
                capture_row = next(r for r in reversed(rows) if r["mode"] == "capture")  # this budget's
                capture_row["profile"] = profile_dict(kernels)
            out = inputs = modes = None  # free this budget's buffers before the next one's
            if device.type == "cuda":
                torch.cuda.empty_cache()
    memory.update(peak_gb=peak_gb(device), layers=config.num_hidden_layers, hidden=config.hidden_size,
                  arch=type(model).__name__)
    model = capture = decoder = None  # free this target before the next one loads
    torch._dynamo.reset()  # the next target's layers compile afresh
    return rows, memory


def summarize(rows: list[dict]) -> list[dict]:
    """Per target, compilation and budget: early-exit saving, capture overhead, and the FP8 speedup."""
    ms = {(r["quantize"], r["compiled"], r["budget"], r["mode"]): r["ms"] for r in rows}
    summary = []
    for quantize, compiled, budget in dict.fromkeys((r["quantize"], r["compiled"], r["budget"]) for r in rows):
        at = {mode: ms[(quantize, compiled, budget, mode)] for mode in ("full", "to_tap", "capture")}
        base = ms.get(("none", compiled, budget, "capture"))
        summary.append(dict(quantize=quantize, budget=budget, compiled=compiled,
                            early_exit_saving=1 - at["capture"] / at["full"],
                            capture_overhead=at["capture"] / at["to_tap"] - 1,
                            fp8_speedup=base / at["capture"] if quantize == "fp8" and base else None))
    return summary


def main() -> int:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    budgets = [int(b) for b in args.budgets.split(",")]
    if "fp8" in args.quantize.split(",") and device.type != "cuda":
        print("--quantize fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9+)", file=sys.stderr)
        return 2
    rows, targets = [], []
    for quantize in args.quantize.split(","):
        target_rows, memory = run_target(args, quantize, device, dtype, budgets)
        rows += target_rows
        targets.append(memory)
    summary = summarize(rows)

    for t in targets:
        print(f"target {args.preset} ({t['arch']}, {t['layers']} layers, H={t['hidden']}) on {device}, {dtype}, "
              f"{t['attn_implementation']} attention, quantize {t['quantize']}, taps {t['taps']}, sequences of {args.seq_len}, weights "
              f"{t['weights_gb'] or 0:.1f} GiB, peak {t['peak_gb'] or 0:.1f} GiB")
    print(f"{'quantize':>8} {'budget':>7} {'compiled':>8} {'mode':>8} {'ms':>9} {'tokens/s':>11} {'MFU':>6}")
    for r in rows:
        print(f"{r['quantize']:>8} {r['budget']:>7} {str(r['compiled']):>8} {r['mode']:>8} {r['ms']:>9.2f} "
              f"{r['tokens_per_s']:>11.0f} {r['mfu'] * 100:>5.1f}%")
    print(f"{'quantize':>8} {'budget':>7} {'compiled':>8} {'early-exit saving':>18} {'capture overhead':>17} "
          f"{'fp8 speedup':>12}")
    for s in summary:
        speedup = f"{s['fp8_speedup']:.2f}x" if s["fp8_speedup"] else "-"
        print(f"{s['quantize']:>8} {s['budget']:>7} {str(s['compiled']):>8} {s['early_exit_saving'] * 100:>17.1f}% "
              f"{s['capture_overhead'] * 100:>16.2f}% {speedup:>12}")
    print(json.dumps(dict(bench="target_forward", preset=args.preset, device=str(device), dtype=dtype,
                          seq_len=args.seq_len, peak_tflops=args.peak_tflops,
                          coordinate_descent=args.coordinate_descent, targets=targets, rows=rows, summary=summary)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
