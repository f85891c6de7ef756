"""What the bench scripts share: the step's shape on the command line, its config, the synthetic workload,
the trainer's drafter loop, memory and timing helpers, and the one way a result is written.

Importing this module puts `src/` on `sys.path` (the scripts need no install of the package) and sets
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` unless it is set, as training does.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Optional

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from dflash_trainer.config import Config, load_config  # noqa: E402
from dflash_trainer.data.types import Job, TokenizedSequence  # noqa: E402
from dflash_trainer.drafter.spec import DrafterSpec  # noqa: E402
from dflash_trainer.target.head import TargetHead  # noqa: E402
from dflash_trainer.target.load import has_attention_backend  # noqa: E402
from dflash_trainer.target.presets import preset_config  # noqa: E402
from dflash_trainer.train.micro_step import compile_forward_train, make_micro_step, plan_step_chunks  # noqa: E402
from dflash_trainer.train.optim import build_optimizer  # noqa: E402
from dflash_trainer.train.schedule import build_scheduler  # noqa: E402
from dflash_trainer.train.step_loop import StepLoop  # noqa: E402
from dflash_trainer.train.trainer import build_drafter  # noqa: E402

MODELS = {  # preset -> (tap layer ids or None for the default spread, mask token id: a spare embedding row)
    "qwen3-8b": ([1, 9, 17, 25, 33], 151669),
    "qwen3-1.7b": (None, 151669),
    "qwen3-30b-a3b": (None, 151669),
    "gpt-oss-20b": (None, 201087),  # the embedding's last row (random weights: any row serves)
    "tiny": ([1, 3], 1024),
    "tiny-moe": ([1, 3], 1024),
    "tiny-gpt-oss": ([1, 3], 1024),
}
SMOKE_MODELS = ("tiny", "tiny-moe", "tiny-gpt-oss")
"""The presets --smoke keeps when asked for (any other model becomes `tiny`)."""
RESULTS = ROOT / "bench" / "results"
"""Result files, one folder per claim (`bench/results/<claim>/`, the claim's scripts under `bench/<claim>/`)."""


# --------------------------------------------------------------------------------------- the step's shape


def add_shape_args(p: argparse.ArgumentParser, claim: str) -> None:
    """The packed step's shape (model preset, sequences, blocks, drafter depth), timing counts, --out (default:
    the claim's results folder, `bench/results/<claim>/`), --smoke."""
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-8b")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--seqs", type=int, default=4, help="sequences per batch (token budget = seqs * seq-len)")
    p.add_argument("--seq-len", type=int, default=3072, help="tokens per sequence (a cap for real lengths)")
    p.add_argument("--blocks-per-seq", type=int, default=512, help="num_blocks = seqs * blocks-per-seq")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drafter-layers", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / claim), help="directory for the JSON result")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, tiny preset (or --model tiny-moe / tiny-gpt-oss), 2 x 128 tokens, 32 blocks, B=8, "
                   "2 drafter layers: proves the code paths")


def apply_smoke(args: argparse.Namespace) -> None:
    """The --smoke shape (CPU-sized); call after parsing."""
    if args.smoke:
        args.model = args.model if args.model in SMOKE_MODELS else "tiny"
        args.seqs, args.seq_len, args.blocks_per_seq, args.block_size = 2, 128, 16, 8
        args.drafter_layers, args.steps, args.warmup = 2, 2, 1


def bench_device(args: argparse.Namespace) -> Optional[torch.device]:
    """CPU for --smoke, else CUDA; None (after saying why) when there is no CUDA device."""
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for the CPU code-path check", file=sys.stderr)
        return None
    return device


def bench_config(args: argparse.Namespace, device: torch.device, extra: tuple[str, ...] = ()) -> Config:
    """The run's config from the command line's shape; `extra` overrides go last (they win)."""
    taps, mask_token = MODELS[args.model]
    overrides = [
        f"run.device={device.type}", f"target.random_init={args.model}", "target.dtype=bfloat16",
        f"drafter.num_layers={args.drafter_layers}", f"drafter.block_size={args.block_size}",
        f"drafter.mask_token_id={mask_token}", f"drafter.num_blocks={args.seqs * args.blocks_per_seq}",
        f"drafter.attention={'flex' if device.type == 'cuda' else 'sdpa'}", "train.dtype=bfloat16",
        f"pipeline.token_budget={args.seqs * args.seq_len}",
        f"target.attn_implementation={target_attention(args.model, device)}",
    ]
    if taps is not None:
        overrides.append(f"drafter.tap_layer_ids=[{','.join(map(str, taps))}]")
    return load_config(None, [*overrides, *extra])


def target_attention(preset: str, device: torch.device) -> str:
    """The target's attention backend: sdpa, or for an architecture without it (gpt-oss: attention sinks)
    flex_attention on CUDA and eager on the CPU (flex attention with sinks needs CUDA)."""
    if has_attention_backend(preset_config(preset), "sdpa"):
        return "sdpa"
    return "flex_attention" if device.type == "cuda" else "eager"


# ------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """The batches a benchmark trains on: jobs over a dataset of sequences (CPU tensors)."""

    dataset: dict[int, TokenizedSequence]
    jobs: tuple[Job, ...]
    note: str


def prompt_tokens(n: int) -> int:
    """Leading tokens of an n-token sequence with loss mask 0 (10%, a stand-in prompt)."""
    return n // 10


def make_sequence(n: int, vocab: int, generator: torch.Generator) -> TokenizedSequence:
    loss_mask = torch.ones(n, dtype=torch.bool)
    loss_mask[: prompt_tokens(n)] = False
    return TokenizedSequence(input_ids=torch.randint(0, vocab, (n,), generator=generator), loss_mask=loss_mask)


def mfu_workload(num_jobs: int, seqs: int, seq_len: int, vocab: int) -> Workload:
    """`num_jobs` batches of `seqs` random sequences of exactly `seq_len` tokens, ids below `vocab`."""
    g = torch.Generator().manual_seed(0)
    dataset = {i: make_sequence(seq_len, vocab, g) for i in range(num_jobs * seqs)}
    jobs = tuple(Job(job_id=k, epoch=0, bucket_id=0, sequence_ids=tuple(range(k * seqs, (k + 1) * seqs)),
                     num_tokens=seqs * seq_len) for k in range(num_jobs))
    return Workload(dataset=dataset, jobs=jobs, note=f"{seqs} sequences of exactly {seq_len} tokens per batch")


# -------------------------------------------------------------------------------------- the drafter side


def drafter_loop(config: Config, spec: DrafterSpec, head: TargetHead, device: torch.device, *,
                 total_steps: int) -> StepLoop:
    """The trainer's drafter side on one device, from `config` as the trainer reads it: the drafter built
    by `build_drafter`, its forward compiled per `train.compile`/`train.compile_mode` (CUDA only), its optimizer
    (`train.optimizer`), the schedule, clipping."""
    model = build_drafter(config, spec, device)
    if config.train.compile and device.type == "cuda":
        compile_forward_train(model, mode=config.train.compile_mode)
    optimizer = build_optimizer(model, config.train, vocab_size=spec.vocab_size)
    scheduler = build_scheduler(optimizer, total_steps=total_steps, warmup_ratio=config.train.warmup_ratio,
                                min_lr_ratio=config.train.min_lr_ratio)
    chunks = plan_step_chunks(config, model, device)
    log(f"drafter step: {chunks.num_blocks} blocks in {chunks.num_chunks} chunk(s) of {chunks.blocks_per_chunk} "
        f"({chunks.reason})")
    micro_step = make_micro_step(config, model, head, device=device, progress=lambda: 0.0, chunks=chunks)
    return StepLoop(model=model, optimizer=optimizer, scheduler=scheduler, micro_step=micro_step,
                    job_key=lambda b: (b.epoch, b.job_id), grad_accum=1, block_size=spec.draft_length + 1,
                    grad_clip=config.train.grad_clip, group=None, device=device)


# ----------------------------------------------------------------------------------- timing and memory


@contextlib.contextmanager
def stall_dumps(every_s: float):
    """While the block runs, every thread's stack goes to stderr every `every_s` seconds (a stall, e.g. a compile
    that does not end, shows where it is); the watchdog is cancelled however the block ends. Left armed in a process
    that goes on (a test calling a script's `main`), it would dump the stacks of threads while they run, which can
    crash the interpreter."""
    faulthandler.dump_traceback_later(every_s, repeat=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()  # timing boundary (outside the timed steps' own work)


def rss_gb() -> Optional[float]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device: torch.device) -> Optional[float]:
    """Peak GiB held by tensors since the last reset (CUDA; None elsewhere): the `*_gb` fields of the JSONs."""
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def allocated_gb(device: torch.device) -> Optional[float]:
    """GiB held by tensors now (CUDA; None elsewhere)."""
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else "cpu"


# ---------------------------------------------------------------------------------------------- results


def or_dash(value, fmt: str = "{:.2f}") -> str:
    """A table cell: `value` formatted, or `-` when it was not measured."""
    return "-" if value is None else fmt.format(value)


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous (torchrun's, or a spawned process group's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git_commit() -> str:
    """$BENCH_COMMIT when set (the device machine's copy of the tree may carry a stale .git), else git's HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_result(result: dict, bench: str, what: str, *folders: Optional[Path | str]) -> None:
    """`<folder>/<date>T<time>-<bench>-<what>.json` in each folder given (the one naming scheme of results)."""
    stamp = datetime.now().strftime("%Y-%m-%dT%H%M%S")
    for folder in (Path(f) for f in folders if f):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{stamp}-{bench}-{what}.json").write_text(json.dumps(result, indent=2) + "\n")


def append_table_rows(results_md: Path, header: str, title: str, rows: list[str]) -> None:
    """Add `rows` at the end of the markdown table that starts with `header` in `results_md` (a new section
    `title` with that table when there is none)."""
    rule = "|" + "---|" * header.count(" | ") + "---|"
    text = results_md.read_text()
    if header not in text:
        text += f"\n## {title}\n\n{header}\n{rule}\n"
    lines = text.splitlines()
    at = lines.index(header) + 2
    while at < len(lines) and lines[at].startswith("|"):
        at += 1
    lines[at:at] = rows
    results_md.write_text("\n".join(lines) + "\n")
