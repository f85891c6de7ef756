"""Where a step's GPU time goes: run a few steps under torch.profiler and group the kernels by kind.

Kinds are read from kernel names (cuBLAS/CUTLASS GEMMs, inductor's flex-attention templates, inductor's
fused pointwise/reduction kernels, ATen's own elementwise/reduction kernels, the fused optimizer, copies).
The table says, per kind, the GPU milliseconds per step and the share of the step's wall time; `idle` is
the wall time with no kernel running (host syncs, launch gaps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

KINDS = (  # (kind, substrings of the kernel name; the first kind that matches wins)
    ("flex attention", ("flex",)),
    # SDPA's kernels (flash, memory-efficient cutlass fmha, cuDNN), before gemm: some of their names say cutlass
    ("other attention", ("flash_fwd", "flash_bwd", "fmha", "attention", "cudnn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm80_")),
    ("inductor fused", ("triton_",)),
    ("optimizer", ("multi_tensor_apply", "fused_adam", "FusedAdam")),
    ("copy / fill", ("memcpy", "memset", "copy", "fill")),
    ("aten elementwise / reduce", ("elementwise", "reduce_kernel", "vectorized", "index", "scatter", "gather",
                                   "softmax", "logsumexp", "argmax", "cat", "sort", "topk", "radix")),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelProfile:
    """GPU kernel time of `steps` profiled steps."""

    steps: int
    wall_ms: float
    """Wall time per step (host included) while profiling."""
    by_kind: dict[str, float]
    """Kind -> GPU kernel ms per step."""
    top: list[tuple[str, float, int]]
    """(kernel name, ms per step, calls per step), the largest first."""
    gaps: list[tuple[float, str, str]]
    """The longest stretches with no kernel running: (ms, kernel before, kernel after), longest first."""


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def profile_steps(step: Callable[[int], None], steps: int, device: torch.device, top: int = 20) -> KernelProfile:
    """Run `step(i)` for i in range(steps) under the profiler; per-step kernel time grouped by kind."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    torch.cuda.synchronize() if device.type == "cuda" else None  # profile boundary
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        torch.cuda.synchronize() if device.type == "cuda" else None  # profile boundary
        wall = time.perf_counter() - t0
    by_kind: dict[str, float] = {}
    kernels: list[tuple[str, float, int]] = []
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False) \
                or "#" in event.key:  # record_function ranges (Optimizer.step#AdamW.step) span kernels, are none
            continue
        ms = getattr(event, "self_device_time_total", 0.0) / 1e3 / steps  # profiler times are in us
        kernels.append((event.key, ms, event.count // steps))
        by_kind[kind_of(event.key)] = by_kind.get(kind_of(event.key), 0.0) + ms
    kernels.sort(key=lambda k: -k[1])
    return KernelProfile(steps=steps, wall_ms=wall * 1e3 / steps, by_kind=by_kind, top=kernels[:top],
                         gaps=idle_gaps(prof.events(), top))


def idle_gaps(events, count: int) -> list[tuple[float, str, str]]:
    """The `count` longest gaps between GPU kernels (one stream assumed: gaps are measured past the latest end)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and "#" not in e.name)
    gaps = []
    latest_end, latest_name = None, ""
    for start, end, name in spans:
        if latest_end is not None and start > latest_end:
            gaps.append(((start - latest_end) / 1e3, latest_name, name))
        if latest_end is None or end > latest_end:
            latest_end, latest_name = end, name
    return sorted(gaps, key=lambda g: -g[0])[:count]


def print_profile(title: str, p: KernelProfile) -> None:
    busy = sum(p.by_kind.values())
    print(f"\nkernel profile: {title} ({p.steps} steps, {p.wall_ms:.1f} ms wall per step, {busy:.1f} ms of kernels)")
    print(f"{'kind':<28}{'ms/step':>10}{'% wall':>9}")
    for kind, ms in sorted(p.by_kind.items(), key=lambda kv: -kv[1]):
        print(f"{kind:<28}{ms:>10.1f}{ms / p.wall_ms:>9.1%}")
    print(f"{'idle (no kernel running)':<28}{max(p.wall_ms - busy, 0.0):>10.1f}{max(p.wall_ms - busy, 0.0) / p.wall_ms:>9.1%}")
    print(f"top kernels:\n{'ms/step':>9}{'calls':>7}  name")
    for name, ms, calls in p.top:
        print(f"{ms:>9.2f}{calls:>7}  {name[:110]}")
    print(f"longest idle gaps ({p.steps} steps):\n{'ms':>9}  kernel before -> kernel after")
    for ms, before, after in p.gaps[:10]:
        print(f"{ms:>9.2f}  {before[:60]} -> {after[:60]}")


def profile_dict(p: KernelProfile) -> dict:
    return {"steps": p.steps, "wall_ms": p.wall_ms, "by_kind_ms": p.by_kind,
            "top": [{"name": n, "ms": ms, "calls": c} for n, ms, c in p.top],
            "gaps": [{"ms": ms, "before": b, "after": a} for ms, b, a in p.gaps]}
