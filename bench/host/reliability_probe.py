"""Reliability probe: bad inputs and faults against `dflash-train`, the way a user meets them on a fresh clone.

    python bench/host/reliability_probe.py [--only GROUP|CASE ...] [--list] [--scratch DIR] [--keep] [--out DIR]

Each case runs our CLI (or `torchrun`, or `scripts/slurm/train.sbatch`) in a subprocess, in a folder of its own under
a scratch folder, on the CPU with the demo's tiny random target and the bundled ShareGPT data. It records the exit
code, the wall time, whether the output holds a Python traceback of ours (torchrun's own report of a failed child is
not ours), the message, and whether a file that was there before (a user's model, a run) changed, and classifies it:

- ok:        what a user should see (a refusal as one line naming the input and the fix, files left as they were;
             a success where the case should succeed);
- silent:    a wrong result without a word (exit 0 where it should stop, a file we did not make replaced, a job
             launched on a typo, a restart that trained a new run);
- hung:      the case ran past its timeout, or one node ended more than the liveness timeout after the other;
- traceback: a Python traceback of ours instead of a message;
- unclear:   it stopped, but not with one line naming the input (and a fix), or with another exit code.

The groups are the seven classes of issue 65 and the older bad inputs (`--list` shows every case). It prints a
table and, as its last line, one JSON object; the same JSON goes to `--out` (bench/results/host/). Standard library
only (and `dflash_trainer.faults`' process helpers, themselves standard library): it runs the package from `src/` with
the Python that runs it (`--python` for another).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))

from dflash_trainer.faults import descendants, kill_tree  # noqa: E402 (standard library only, as this script)

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
RESULTS = ROOT / "bench" / "results" / "host"

LIVENESS_S = 10.0
"""pipeline.liveness_timeout_s of the torchrun cases: every node must end within it of the first."""

VERDICTS = ("ok", "silent", "hung", "traceback", "unclear")


# -- what a case runs and what it expects ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Proc:
    """One process to start (one per node for several nodes)."""

    argv: list[str]
    cwd: Path
    env: dict[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A case's commands and what a user should see.

    `expect`: refuse (non-zero, one line naming `names` and a fix), refuse_or_warn (that, or exit 0 with a warning
    naming `names`), fail (non-zero, `names` somewhere in the output: an injected bug or a killed rank), interrupt
    (a signal during start-up: 128 + signal, a line saying so), succeed (exit 0)."""

    procs: list[Proc]
    expect: str
    names: tuple[str, ...] = ()
    protect: tuple[Path, ...] = ()
    """Files and folders that were there before and must be byte for byte the same after (none added)."""
    absent: tuple[Path, ...] = ()
    """Paths that must not exist after (what a refused command must not leave written)."""
    timeout_s: float = 60.0
    signal: Optional[tuple[float, int]] = None
    """(seconds after start, signal): sent to the first process's process group, as a terminal's Ctrl-C is."""
    kill_worker: Optional[tuple[int, float]] = None
    """(node, seconds): SIGKILL that node's torchrun worker that long after it appears (before it joins the others)."""
    within_s: Optional[float] = None
    """Every process (node) must end within this many seconds of the first one that ends."""
    traceback_ok: bool = False
    codes: tuple[int, ...] = ()
    """The exit codes allowed (a torchrun child's exit code, from torchrun's report, where torchrun runs it)."""
    check: Optional[Callable[["Outcome"], Optional[str]]] = None
    """A further check: returns why the result is silently wrong, or None."""


@dataclass(slots=True, kw_only=True)
class Outcome:
    codes: list[Optional[int]]
    ended_s: list[Optional[float]]
    elapsed_s: float
    output: str
    timed_out: bool
    folder: Path

    @property
    def code(self) -> Optional[int]:
        """The first non-zero exit code, else 0."""
        return next((c for c in self.codes if c), 0)

    def child_codes(self) -> list[int]:
        """Under torchrun: the exit codes of the root-cause children in torchrun's reports, one per node (none
        elsewhere)."""
        return [int(c) for c in re.findall(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", self.output, re.S)]


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    name: str
    group: str
    what: str
    plan: Callable[["Ctx", Path], Plan]


CASES: list[Case] = []

GROUPS = {
    "1-overwrite": "an export (or another command) replacing files we did not make",
    "2-verifier": "a wrong thing accepted as the verifier (or as the drafter)",
    "3-launcher": "the SLURM launcher acting on a typo",
    "4-restart": "a torchrun restart that loses its run",
    "5-ignored": "options that do nothing, accepted",
    "6-torchrun": "errors under torchrun: tracebacks, hangs, every node stopping",
    "7-causes": "causes named where they are (weights, checkpoints, refused exports, Ctrl-C)",
    "0-inputs": "older bad inputs: paths, config values, typos",
}


def case(group: str, name: str, what: str):
    def register(fn: Callable[["Ctx", Path], Plan]):
        CASES.append(Case(name=name, group=group, what=what, plan=fn))
        return fn

    return register


# -- the scratch folder and its shared inputs --------------------------------------------------------------------


SMALL = ("logging.progress=false", "logging.report=false", "data.max_conversations=60",
         "data.num_eval_conversations=4", "data.max_length=256", "pipeline.token_budget=512", "drafter.num_layers=1",
         "eval.at_end=false")
"""The demo recipe shrunk (the multi-process tests' size): 15 jobs of <= 512 tokens, a one-layer drafter."""


class Ctx:
    """The scratch folder, the environment every command runs with, and inputs shared by the cases (built on first
    use: a trained run with checkpoints, a speculators export with its saved target)."""

    def __init__(self, scratch: Path, python: str) -> None:
        self.scratch = scratch
        self.python = python
        self.shared = scratch / "_shared"
        self.shared.mkdir(parents=True, exist_ok=True)
        self.cache = self.shared / "cache"
        self._built: dict[str, Path] = {}

    def env(self, folder: Path, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("DFLASH_", "SLURM_", "TORCHELASTIC_", "TORCH_DISABLE_SHARE"))}
        env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   TMPDIR=str(self.tmp(folder)), PYTHONUNBUFFERED="1")
        env.update(extra)
        return env

    @staticmethod
    def tmp(folder: Path) -> Path:
        path = folder / ".tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def cli(self, folder: Path, *args: str, env: Optional[dict[str, str]] = None) -> Proc:
        """`dflash-train ARGS` (as `python -m dflash_trainer`) in `folder`."""
        return Proc(argv=[self.python, "-m", "dflash_trainer", *args], cwd=folder, env=env or self.env(folder))

    def small(self, *extra: str) -> list[str]:
        return ["--config", "demo", *SMALL, f"data.cache_dir={self.cache}", *extra]

    def train(self, folder: Path, *extra: str, run_dir: str = "run") -> Proc:
        """A small training run (two steps if it starts) in `folder/run_dir`."""
        return self.cli(folder, "train", *self.small("train.max_steps=2", f"run.dir={run_dir}", *extra))

    def run_once(self, argv: list[str], cwd: Path, what: str) -> None:
        proc = subprocess.run(argv, cwd=cwd, env=self.env(cwd), capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"building the probe's {what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")

    def base_run(self) -> Path:
        """A finished training run: checkpoints step_2 and step_4, export/, config.yaml (read-only for the cases)."""
        if "run" not in self._built:
            run = self.shared / "run"
            if not (run / "summary.json").is_file():
                self.run_once([self.python, "-m", "dflash_trainer", "train",
                               *self.small("train.max_steps=4", "train.checkpoint_interval=2", f"run.dir={run}")],
                              self.shared, "trained run")
            self._built["run"] = run
        return self._built["run"]

    def checkpoint(self) -> Path:
        return self.base_run() / "checkpoints" / "step_4"

    def spec_export(self) -> tuple[Path, Path]:
        """(a speculators export, the target it saved with --save-target)."""
        if "spec" not in self._built:
            spec, target = self.shared / "spec", self.shared / "target"
            if not (spec / "config.json").is_file():
                self.run_once([self.python, "-m", "dflash_trainer", "export", "--checkpoint", str(self.checkpoint()),
                               "--out", str(spec), "--format", "speculators", "--save-target", str(target)],
                              self.shared, "speculators export")
            self._built["spec"] = spec
            self._built["target"] = target
        return self._built["spec"], self._built["target"]

    def copy_run(self, folder: Path, name: str = "run") -> Path:
        dest = folder / name
        shutil.copytree(self.base_run(), dest, ignore=shutil.ignore_patterns(".lock"))
        return dest

    def user_model(self, folder: Path, **config_changes) -> Path:
        """A model folder of a user's: a Qwen3 config.json like the demo target's (with `config_changes`), weights
        and a tokenizer that are not ours."""
        _, target = self.spec_export()
        folder.mkdir(parents=True, exist_ok=True)
        config = json.loads((target / "config.json").read_text())
        config.update(config_changes)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        (folder / "model.safetensors").write_bytes(b"the user's weights")
        (folder / "tokenizer.json").write_text('{"the": "user\'s tokenizer"}')
        return folder

    def export_cmd(self, folder: Path, *args: str, checkpoint: Optional[Path] = None) -> Proc:
        return self.cli(folder, "export", "--checkpoint", str(checkpoint or self.checkpoint()), *args)


# -- running one case --------------------------------------------------------------------------------------------


def _worker(agent: int) -> Optional[int]:
    """A torchrun worker of the agent `agent` (a descendant running dflash_trainer), or None yet."""
    for pid in descendants(agent):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dflash_trainer" in cmdline and b"torch.distributed.run" not in cmdline:
            return pid
    return None


def execute(plan: Plan, folder: Path) -> Outcome:
    logs = [folder / f".out{n}.txt" for n in range(len(plan.procs))]
    start = time.monotonic()
    procs = []
    for proc, log in zip(plan.procs, logs):
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(proc.argv, cwd=proc.cwd, env=proc.env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
    ended: list[Optional[float]] = [None] * len(procs)
    signalled = False
    worker_seen: Optional[float] = None
    worker_killed = False
    deadline = start + plan.timeout_s
    while None in ended and time.monotonic() < deadline:
        now = time.monotonic()
        for n, p in enumerate(procs):
            if ended[n] is None and p.poll() is not None:
                ended[n] = now - start
        if plan.signal and not signalled and now - start >= plan.signal[0] and ended[0] is None:
            os.killpg(procs[0].pid, plan.signal[1])
            signalled = True
        if plan.kill_worker and not worker_killed:
            node, after = plan.kill_worker
            pid = _worker(procs[node].pid)
            if pid is not None and worker_seen is None:
                worker_seen = now
            if pid is not None and now - worker_seen >= after:
                os.kill(pid, signal.SIGKILL)
                worker_killed = True
        time.sleep(0.05)
    timed_out = None in ended
    for n, p in enumerate(procs):
        if ended[n] is None:
            kill_tree(p.pid)
            p.wait(timeout=30)
    for p in procs:  # torchrun's workers run in sessions of their own: leave none behind
        kill_tree(p.pid)
    texts = [log.read_bytes().decode(errors="replace") for log in logs]
    output = texts[0] if len(texts) == 1 else "\n".join(f"--- node {n} ---\n{t}" for n, t in enumerate(texts))
    # exit codes as a shell reports them: a process ended by signal N is 128 + N (Python's handled Ctrl-C at start-up
    # can end by SIGINT itself once KeyboardInterrupt was raised in code torch runs at import: the same 130 there)
    codes = [(128 - p.returncode if p.returncode < 0 else p.returncode) if e is not None else None
             for p, e in zip(procs, ended)]
    return Outcome(codes=codes, ended_s=ended,
                   elapsed_s=time.monotonic() - start, output=output, timed_out=timed_out, folder=folder)


def snapshot(paths: tuple[Path, ...]) -> dict[str, str]:
    found = {}
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
        for f in files:
            if f.name == ".lock":  # a lock file we hold while a command runs: its content never changes
                continue
            try:
                found[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
            except OSError:
                found[str(f)] = "(unreadable)"
    return found


ERROR_LINE = re.compile(r"^(?:\[rank \d+\] )?(?:dflash-train(?: \S+)?: (?:error|stopped)\b|train\.sbatch: )")
USAGE_LINE = re.compile(r"^usage: ")
FIX_WORDS = re.compile(
    r"\b(give|pass|set|use|remove|add|choose|drop|delete|move|rerun|run|lower|raise|install|export|put|submit|name|"
    r"must|allowed|one of|did you mean|expected|instead|either|wait|check|needs?|resume|start|only|keep|fix|point|"
    r"rename|edit)\b", re.I)


def our_tracebacks(text: str) -> list[str]:
    """The last line (the exception) of each traceback in `text` that is not torchrun's own report of its launch
    (ChildFailedError, SignalException: torch.distributed.elastic's, which no code of ours can change)."""
    found = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "Traceback (most recent call last):":
            continue
        last = next((l for l in lines[i + 1:] if l and not l.startswith(" ")), "")
        if "torch.distributed.elastic." not in last:
            found.append(last.strip()[:200])
    return found


def message_lines(text: str) -> list[str]:
    lines = [l.strip() for l in text.splitlines()]
    errors = [l for l in lines if ERROR_LINE.match(l)]
    return errors or [l for l in lines if USAGE_LINE.match(l)][:1]


def classify(plan: Plan, out: Outcome, before: dict[str, str]) -> tuple[str, str, Optional[str]]:
    """(verdict, why, the message a user reads)."""
    lines = message_lines(out.output)
    message = lines[0] if lines else None
    if out.timed_out:
        running = [n for n, e in enumerate(out.ended_s) if e is None]
        return "hung", f"still running after {plan.timeout_s:.0f} s (process {running})", message
    if plan.within_s is not None and len(out.ended_s) > 1:
        spread = max(out.ended_s) - min(out.ended_s)
        if spread > plan.within_s:
            return "hung", f"nodes ended {spread:.0f} s apart (liveness timeout {plan.within_s:.0f} s)", message
    tracebacks = our_tracebacks(out.output)
    if tracebacks and not plan.traceback_ok:
        return "traceback", tracebacks[0], message
    after = snapshot(plan.protect)
    changed = sorted({*before, *after} - {k for k in before if before.get(k) == after.get(k)})
    if changed:
        return "silent", "changed: " + ", ".join(Path(c).relative_to(out.folder).as_posix() if Path(c).is_relative_to(
            out.folder) else c for c in changed[:4]), message
    left = [p for p in plan.absent if p.exists() or p.is_symlink()]
    if left:
        return "silent", "left behind: " + ", ".join(p.relative_to(out.folder).as_posix() for p in left), message
    if plan.check is not None and (why := plan.check(out)):
        return "silent", why, message
    codes = out.child_codes() or [out.code]
    code = next((c for c in codes if c in plan.codes), codes[0])  # the node whose rank found the mistake
    if plan.expect == "succeed" or (plan.expect == "refuse_or_succeed" and out.code == 0):
        if out.code != 0:
            return "unclear", f"exit {out.code}: {message or 'no message'}", message
        return "ok", "", message
    if plan.expect == "refuse_or_warn" and out.code == 0:
        warned = [l for l in out.output.splitlines() if "WARNING" in l and all(n in l for n in plan.names)]
        if warned:
            return "ok", "warned", warned[0][warned[0].find("WARNING"):][:300]
        return "silent", "exit 0 without a warning naming " + ", ".join(plan.names), message
    if out.code == 0:
        return "silent", "exit 0", message
    if plan.expect == "interrupt":
        said = [l for l in out.output.splitlines() if re.search(r"interrupted|SIGINT|SIGTERM|stopping", l)]
        if plan.codes and code not in plan.codes:
            return "unclear", f"exit {code}, not {'/'.join(map(str, plan.codes))}", said[0] if said else message
        if not said:
            return "unclear", "no line saying it was interrupted", message
        return "ok", "", said[0].strip()[:300]
    if plan.expect == "fail":
        missing = [n for n in plan.names if n not in out.output]
        if missing:
            return "unclear", "the output does not name " + ", ".join(missing), message
        if plan.codes and code not in plan.codes:
            return "unclear", f"exit {code}, not {'/'.join(map(str, plan.codes))}", message
        return "ok", "", message
    # refuse, refuse_or_warn with a non-zero exit
    if not lines:
        return "unclear", f"exit {code} with no error line", None
    if len(lines) > 1:
        return "unclear", f"{len(lines)} error lines", message
    missing = [n for n in plan.names if n not in message]
    if missing:
        return "unclear", "the message does not name " + ", ".join(missing), message
    if not USAGE_LINE.match(message) and not FIX_WORDS.search(message.split(":", 2)[-1]):
        return "unclear", "the message names no fix", message
    if plan.codes and code not in plan.codes:
        return "unclear", f"exit {code}, not {'/'.join(map(str, plan.codes))}", message
    return "ok", "", message


def run_case(ctx: Ctx, c: Case) -> dict:
    folder = ctx.scratch / c.name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    plan = c.plan(ctx, folder)
    before = snapshot(plan.protect)
    out = execute(plan, folder)
    verdict, why, message = classify(plan, out, before)
    return {"case": c.name, "group": c.group, "what": c.what, "verdict": verdict, "why": why,
            "exit": out.code, "child_exits": out.child_codes(), "seconds": round(out.elapsed_s, 1),
            "traceback": bool(our_tracebacks(out.output)), "message": (message or "")[:400],
            "command": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(plan.procs[0].argv))[:300]}


# -- helpers the cases share -------------------------------------------------------------------------------------


def launched(marker: Path) -> Callable[[Outcome], Optional[str]]:
    return lambda out: f"launched the job ({marker.name} written by the stand-in srun)" if marker.exists() else None


def nan_safetensors(path: Path, count: int = 3) -> None:
    """Write NaN into the first `count` values of the first float32 tensor of a safetensors file (stdlib only:
    an 8-byte header length, a JSON header, the raw data)."""
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    name = next(k for k, v in sorted(header.items()) if k != "__metadata__" and v["dtype"] == "F32")
    begin = 8 + size + header[name]["data_offsets"][0]
    data[begin:begin + 4 * count] = struct.pack("<f", float("nan")) * count
    path.write_bytes(bytes(data))


def rewrite_complete(checkpoint: Path) -> None:
    """Record the checkpoint's files as they are now in its COMPLETE marker (damage the checksums cannot see)."""
    files = {}
    for f in sorted(checkpoint.iterdir()):
        if f.is_file() and f.name != "COMPLETE":
            files[f.name] = {"bytes": f.stat().st_size, "crc32": f"{zlib.crc32(f.read_bytes()):08x}"}
    (checkpoint / "COMPLETE").write_text(json.dumps({"files": files}, indent=1) + "\n")


def torchrun(ctx: Ctx, folder: Path, nproc: int, *overrides: str, nnodes: int = 1, node_dirs: Optional[list[Path]] = None,
             node_args: Optional[list[list[str]]] = None, max_restarts: int = 0, script: Optional[Path] = None,
             env: Optional[dict[str, str]] = None, run_dir: str = "run") -> list[Proc]:
    """`torchrun` of a small training run on `nnodes` stand-in nodes on this machine (agents meeting at a c10d
    rendezvous on node 0, as several machines do; `node_dirs`: each node's working folder)."""
    import socket

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    if nnodes == 1:
        rendezvous = [["--master_addr", "127.0.0.1", "--master_port", str(free_port())]]
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        rendezvous = [["--nnodes", str(nnodes), "--node_rank", str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       endpoint, "--rdzv-id", f"probe-{folder.name}", "--rdzv-conf", f"is_host={n == 0}"]
                      for n in range(nnodes)]
    entry = [str(script)] if script else ["-m", "dflash_trainer"]
    train = ["train", *ctx.small(f"pipeline.liveness_timeout_s={LIVENESS_S}", "pipeline.timeout_s=60",
                                 f"run.dir={run_dir}", *overrides)]
    procs = []
    for n in range(nnodes):
        cwd = node_dirs[n] if node_dirs else folder
        procs.append(Proc(argv=[ctx.python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                *rendezvous[n], *(["--max-restarts", str(max_restarts)] if max_restarts else []),
                                *entry, *train, *(node_args[n] if node_args else [])],
                          cwd=cwd, env=env or ctx.env(folder)))
    return procs


# == 1. an export (or another command) replacing files we did not make ============================================


def _refused_export(ctx: Ctx, folder: Path, *args: str, names: tuple[str, ...], protect=(), absent=()) -> Plan:
    return Plan(procs=[ctx.export_cmd(folder, *args)], expect="refuse", names=names, protect=tuple(protect),
                absent=tuple(absent), codes=(2,))


@case("1-overwrite", "save-target-into-user-model", "--save-target DIR where DIR holds someone's model")
def _(ctx, f):
    user = ctx.user_model(f / "their-model")
    return _refused_export(ctx, f, "--out", str(f / "export"), "--format", "speculators", "--save-target", str(user),
                           names=("--save-target",), protect=[user], absent=[f / "export"])


@case("1-overwrite", "save-target-equals-out", "--save-target the same folder as --out")
def _(ctx, f):
    return _refused_export(ctx, f, "--out", str(f / "x"), "--format", "speculators", "--save-target", str(f / "x"),
                           names=("--save-target", "--out"), absent=[f / "x"])


@case("1-overwrite", "save-target-equals-out-spelled-apart", "--save-target x/ and --out ./x (one folder, two spellings)")
def _(ctx, f):
    return _refused_export(ctx, f, "--out", "./x", "--format", "speculators", "--save-target", "x/",
                           names=("--save-target",), absent=[f / "x"])


@case("1-overwrite", "save-target-inside-out", "--save-target a folder inside --out")
def _(ctx, f):
    return _refused_export(ctx, f, "--out", str(f / "x"), "--format", "speculators", "--save-target",
                           str(f / "x" / "target"), names=("--save-target",), absent=[f / "x"])


@case("1-overwrite", "out-inside-save-target", "--out a folder inside --save-target")
def _(ctx, f):
    return _refused_export(ctx, f, "--out", str(f / "x" / "drafter"), "--format", "speculators", "--save-target",
                           str(f / "x"), names=("--save-target",), absent=[f / "x"])


@case("1-overwrite", "save-target-dflash-format-into-user-model", "--save-target into someone's model, DFlash format")
def _(ctx, f):
    user = ctx.user_model(f / "their-model")
    return _refused_export(ctx, f, "--out", str(f / "export"), "--save-target", str(user),
                           names=("--save-target",), protect=[user], absent=[f / "export"])


@case("1-overwrite", "out-into-user-model", "--out DIR where DIR holds someone's model")
def _(ctx, f):
    user = ctx.user_model(f / "their-model")
    return _refused_export(ctx, f, "--out", str(user), names=("--out",), protect=[user])


@case("1-overwrite", "out-into-unrelated-folder", "--out a folder holding a user's notes")
def _(ctx, f):
    (f / "notes").mkdir()
    (f / "notes" / "todo.txt").write_text("keep me")
    return _refused_export(ctx, f, "--out", str(f / "notes"), names=("--out",), protect=[f / "notes"])


@case("1-overwrite", "out-is-a-run-dir", "--out the run dir the checkpoint belongs to")
def _(ctx, f):
    run = ctx.copy_run(f)
    return Plan(procs=[ctx.export_cmd(f, "--out", str(run), checkpoint=run / "checkpoints" / "step_4")],
                expect="refuse", names=("--out",), protect=(run,), codes=(2,))


@case("1-overwrite", "out-is-the-checkpoint", "--out the very checkpoint being exported")
def _(ctx, f):
    run = ctx.copy_run(f)
    ckpt = run / "checkpoints" / "step_4"
    return Plan(procs=[ctx.export_cmd(f, "--out", str(ckpt), checkpoint=ckpt)], expect="refuse", names=("--out",),
                protect=(run,), codes=(2,))


@case("1-overwrite", "out-is-a-file", "--out names an existing file")
def _(ctx, f):
    (f / "model.bin").write_bytes(b"someone's file")
    return _refused_export(ctx, f, "--out", str(f / "model.bin"), names=("--out",), protect=[f / "model.bin"])


@case("1-overwrite", "save-target-into-our-drafter-export", "--save-target the drafter export of an earlier run")
def _(ctx, f):
    run = ctx.copy_run(f)
    return _refused_export(ctx, f, "--out", str(f / "export"), "--format", "speculators", "--save-target",
                           str(run / "export"), names=("--save-target",), protect=[run], absent=[f / "export"])


@case("1-overwrite", "eval-out-into-user-folder", "eval --out a folder holding someone's eval.json")
def _(ctx, f):
    (f / "theirs").mkdir()
    (f / "theirs" / "eval.json").write_text('{"their": "results"}')
    return Plan(procs=[ctx.cli(f, "eval", "--drafter", str(ctx.base_run() / "export"), "--out", str(f / "theirs"),
                               "eval.num_prompts=2", "eval.max_new_tokens=8")],
                expect="refuse", names=("--out",), protect=(f / "theirs",), codes=(2,))


@case("1-overwrite", "report-out-into-user-folder", "report --out a folder holding someone's index.html")
def _(ctx, f):
    (f / "site").mkdir()
    (f / "site" / "index.html").write_text("<p>their page</p>")
    return Plan(procs=[ctx.cli(f, "report", str(ctx.base_run()), "--out", str(f / "site"))], expect="refuse",
                names=("--out",), protect=(f / "site",), codes=(2,))


@case("1-overwrite", "train-into-user-folder", "train run.dir= a folder holding someone's config.yaml")
def _(ctx, f):
    (f / "project").mkdir()
    (f / "project" / "config.yaml").write_text("their: settings\n")
    (f / "project" / "metrics.jsonl").write_text('{"their": 1}\n')
    return Plan(procs=[ctx.train(f, run_dir=str(f / "project"))], expect="refuse", names=("run.dir",),
                protect=(f / "project",), codes=(2,))


@case("1-overwrite", "train-into-user-config-folder", "train run.dir= a folder holding only someone's config.yaml")
def _(ctx, f):
    (f / "project").mkdir()
    (f / "project" / "config.yaml").write_text("their: settings\n")
    return Plan(procs=[ctx.train(f, run_dir=str(f / "project"))], expect="refuse", names=("run.dir",),
                protect=(f / "project",), codes=(2,), timeout_s=90)


@case("1-overwrite", "regenerate-out-into-user-folder", "regenerate --out a folder holding someone's data")
def _(ctx, f):
    (f / "data").mkdir()
    (f / "data" / "train.jsonl").write_text('{"messages": []}\n')
    return Plan(procs=[ctx.cli(f, "regenerate", *ctx.small("data.max_conversations=4", "regenerate.max_new_tokens=4"),
                               "--out", str(f / "data"))],
                expect="refuse", names=("--out",), protect=(f / "data",), codes=(2,))


@case("1-overwrite", "plan-into-user-folder", "plan run.dir= a folder holding someone's files")
def _(ctx, f):
    (f / "mine").mkdir()
    (f / "mine" / "config.yaml").write_text("their: settings\n")
    return Plan(procs=[ctx.cli(f, "plan", *ctx.small(f"run.dir={f / 'mine'}"))], expect="refuse", names=("run.dir",),
                protect=(f / "mine",), codes=(2,))


# == 2. a wrong thing accepted as the verifier ====================================================================


def _verifier(ctx: Ctx, f: Path, verifier: str, *names: str) -> Plan:
    return _refused_export(ctx, f, "--out", str(f / "export"), "--format", "speculators", "--verifier", verifier,
                           names=(verifier.rstrip("/").removeprefix("./"), *names), absent=[f / "export"])


@case("2-verifier", "verifier-is-dflash-export", "--verifier naming a DFlash drafter export")
def _(ctx, f):
    return _verifier(ctx, f, str(ctx.base_run() / "export"))


@case("2-verifier", "verifier-is-speculators-export", "--verifier naming a speculators drafter export")
def _(ctx, f):
    return _verifier(ctx, f, str(ctx.spec_export()[0]))


@case("2-verifier", "verifier-other-hidden-size", "--verifier a model of another hidden size")
def _(ctx, f):
    return _verifier(ctx, f, str(ctx.user_model(f / "wide", hidden_size=128, head_dim=32)))


@case("2-verifier", "verifier-other-vocabulary", "--verifier a model with another vocabulary size")
def _(ctx, f):
    return _verifier(ctx, f, str(ctx.user_model(f / "vocab", vocab_size=32000)))


@case("2-verifier", "verifier-too-shallow", "--verifier a model with fewer layers than the drafter taps")
def _(ctx, f):
    return _verifier(ctx, f, str(ctx.user_model(f / "shallow", num_hidden_layers=2, layer_types=["full_attention"] * 2)))


@case("2-verifier", "verifier-not-a-causal-lm", "--verifier a model that is not a causal LM (BERT)")
def _(ctx, f):
    folder = f / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert",
                                                    "hidden_size": 64, "vocab_size": 1088, "num_hidden_layers": 6}))
    return _verifier(ctx, f, str(folder))


@case("2-verifier", "verifier-missing-folder", "--verifier ./typo (a folder that does not exist)")
def _(ctx, f):
    return _verifier(ctx, f, "./traget")


@case("2-verifier", "verifier-empty-folder", "--verifier a folder without config.json")
def _(ctx, f):
    (f / "empty").mkdir()
    return _verifier(ctx, f, str(f / "empty"))


@case("2-verifier", "verifier-with-dflash-format", "--verifier with --format dflash (which records no verifier)")
def _(ctx, f):
    _, target = ctx.spec_export()
    return Plan(procs=[ctx.export_cmd(f, "--out", str(f / "export"), "--verifier", str(target))],
                expect="refuse_or_warn", names=("--verifier",), codes=(2,))


@case("2-verifier", "eval-drafter-is-a-target", "eval --drafter naming a target model folder")
def _(ctx, f):
    _, target = ctx.spec_export()
    return Plan(procs=[ctx.cli(f, "eval", "--drafter", str(target), "--config", str(ctx.base_run() / "config.yaml"),
                               "--out", str(f / "out"))], expect="refuse", names=(str(target), "a target model"),
                codes=(2,), absent=(f / "out",))


@case("2-verifier", "eval-drafter-speculators", "eval --drafter naming a speculators export")
def _(ctx, f):
    spec, _ = ctx.spec_export()
    return Plan(procs=[ctx.cli(f, "eval", "--drafter", str(spec), "--config", str(ctx.base_run() / "config.yaml"),
                               "--out", str(f / "out"))], expect="refuse", names=(str(spec),), codes=(2,),
                absent=(f / "out",))


# == 3. the SLURM launcher acting on a typo =======================================================================


ALLOCATION = dict(SLURM_JOB_ID="731", SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="8")


def _sbatch(ctx: Ctx, f: Path, *args: str, expect: str = "refuse", names: tuple[str, ...] = (), dry: str = "0",
            **env: str) -> Plan:
    """scripts/slurm/train.sbatch inside a pretend allocation, with stand-ins for `scontrol` (lists the nodes) and
    `srun` (writes a marker: the job was launched)."""
    bin_dir = f / "bin"
    bin_dir.mkdir()
    marker = f / "LAUNCHED"
    (bin_dir / "srun").write_text(f"#!/bin/sh\necho \"$@\" > {marker}\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'gpu-a17\\ngpu-a18\\n'\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    full = ctx.env(f, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", DFLASH_PYTHON=ctx.python, **ALLOCATION)
    full.update({"DFLASH_DRY_RUN": dry, **env})
    full = {k: v for k, v in full.items() if v is not None}
    proc = Proc(argv=["bash", str(SBATCH), *args], cwd=ROOT, env=full)
    if expect == "succeed":  # a dry run: prints the command, launches nothing
        def printed_only(out: Outcome) -> Optional[str]:
            if marker.exists():
                return "launched the job on a dry run"
            if not out.output.startswith("srun "):
                return "printed no srun command"
            return None

        return Plan(procs=[proc], expect="succeed", check=printed_only, timeout_s=30)
    return Plan(procs=[proc], expect="refuse", names=names, absent=(marker,), codes=(2,), timeout_s=30)


RUN_ARGS = ("configs/demo.yaml", "/shared/runs/probe")

for _value in ("true", "yes", "TRUE", "On"):
    case("3-launcher", f"dry-run-{_value}", f"DFLASH_DRY_RUN={_value}: print, launch nothing")(
        lambda ctx, f, v=_value: _sbatch(ctx, f, *RUN_ARGS, expect="succeed", dry=v))

for _name, _key, _value in [
    ("dry-run-typo", "DFLASH_DRY_RUN", "ture"),
    ("dry-run-number", "DFLASH_DRY_RUN", "2"),
    ("nodes-zero", "SLURM_NNODES", "0"),
    ("gpus-per-node-word", "DFLASH_GPUS_PER_NODE", "eight"),
    ("gpus-per-node-zero", "DFLASH_GPUS_PER_NODE", "0"),
    ("gpus-per-node-spaces", "DFLASH_GPUS_PER_NODE", " 8"),
    ("max-restarts-negative", "DFLASH_MAX_RESTARTS", "-1"),
    ("max-restarts-word", "DFLASH_MAX_RESTARTS", "three"),
    ("port-too-high", "DFLASH_RDZV_PORT", "70000"),
    ("port-zero", "DFLASH_RDZV_PORT", "0"),
    ("python-missing", "DFLASH_PYTHON", "/nonexistent/python"),
    ("job-id-not-a-number", "SLURM_JOB_ID", "abc"),
]:
    case("3-launcher", _name, f"{_key}={_value!r}")(
        lambda ctx, f, k=_key, v=_value: _sbatch(ctx, f, *RUN_ARGS, names=(k,), **{k: v}))


@case("3-launcher", "config-typo", "a CONFIG path that does not exist (configs/demo.yml)")
def _(ctx, f):
    return _sbatch(ctx, f, "configs/demo.yml", "/shared/runs/probe", names=("configs/demo.yml",))


@case("3-launcher", "override-typo", "an override naming no key (train.lrr=1)")
def _(ctx, f):
    return _sbatch(ctx, f, *RUN_ARGS, "train.lrr=1", names=("train.lrr",))


@case("3-launcher", "override-without-value", "an argument that is no override (train.lr)")
def _(ctx, f):
    return _sbatch(ctx, f, *RUN_ARGS, "train.lr", names=("train.lr",))


@case("3-launcher", "missing-run-dir", "one argument (no RUN_DIR)")
def _(ctx, f):
    return _sbatch(ctx, f, "configs/demo.yaml", names=("RUN_DIR",))


@case("3-launcher", "outside-allocation", "no SLURM allocation and no dry run")
def _(ctx, f):
    return _sbatch(ctx, f, *RUN_ARGS, names=("SLURM_JOB_ID",), SLURM_JOB_ID=None, SLURM_JOB_NODELIST=None)


# == 4. a torchrun restart that loses its run =====================================================================


BETWEEN = '''"""Stand-in for whatever changes a run dir between two torchrun incarnations: in the second incarnation (restart
count 1), the first rank to get here applies PROBE_BETWEEN to the run dir, the others wait; then dflash_trainer."""
import os, shutil, sys, time
from pathlib import Path

action, run = os.environ.get("PROBE_BETWEEN", ""), Path(os.environ.get("PROBE_RUN_DIR", "."))
if action and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "1":
    done = run.with_name(run.name + ".between-done")
    try:
        os.close(os.open(str(run.with_name(run.name + ".between-lock")), os.O_CREAT | os.O_EXCL))
        if action == "delete":
            shutil.rmtree(run)
        elif action == "empty":
            for p in run.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        elif action == "replace-run":
            shutil.rmtree(run)
            shutil.copytree(os.environ["PROBE_OTHER_RUN"], run, ignore=shutil.ignore_patterns(".lock"))
        elif action == "replace-user":
            shutil.rmtree(run)
            run.mkdir()
            (run / "notes.txt").write_text("someone's folder")
        elif action == "unmark":
            (run / ".dflash-run").unlink()
        elif action == "no-record":
            (run / ".elastic.json").unlink()
        elif action == "no-checkpoints":
            shutil.rmtree(run / "checkpoints")
        elif action == "cut-config":
            text = (run / "config.yaml").read_bytes()
            (run / "config.yaml").write_bytes(text[: len(text) // 2])
        done.write_text("done")
    except FileExistsError:
        deadline = time.time() + 60
        while not done.exists() and time.time() < deadline:
            time.sleep(0.05)
os.execv(sys.executable, [sys.executable, "-m", "dflash_trainer", *sys.argv[1:]])
'''


def _restart(ctx: Ctx, f: Path, action: str, *names: str) -> Plan:
    """Two colocated ranks under `--max-restarts 1`; rank 0 is killed after step 3 (checkpoint at 2) in the first
    incarnation; before the second starts, `action` changes the run dir."""
    script = f / "between.py"
    script.write_text(BETWEEN)
    run = f / "run"
    env = ctx.env(f, PROBE_BETWEEN=action, PROBE_RUN_DIR=str(run), DFLASH_TEST_FAULT="kill:3@0",
                  DFLASH_TEST_FAULT_RESTART="0")
    if action == "replace-run":
        env["PROBE_OTHER_RUN"] = str(ctx.base_run())
    procs = torchrun(ctx, f, 2, "pipeline.colocated=true", "train.checkpoint_interval=2", max_restarts=1,
                     script=script, env=env, run_dir=str(run))
    summary = run / "summary.json"
    other = (ctx.base_run() / "summary.json").read_bytes() if action == "replace-run" else None

    def not_ok(out: Outcome) -> Optional[str]:
        try:
            text = summary.read_bytes()
            status = json.loads(text).get("status")
        except (OSError, ValueError):
            return None
        if text == other:  # the summary of the run put there in its place, not one this job wrote
            return None
        return "the restart trained a run that ends status: ok" if status == "ok" else None

    if not action:
        def continued(out: Outcome) -> Optional[str]:
            if "continuing" not in out.output:
                return "the second incarnation did not say it continues the run"
            return None if json.loads(summary.read_text()).get("status") == "ok" else "summary not ok"

        return Plan(procs=procs, expect="succeed", timeout_s=180, check=continued)
    return Plan(procs=procs, expect="refuse", names=names, timeout_s=180, check=not_ok, codes=(2,))


for _action, _names, _what in [
    ("", (), "nothing changes between the incarnations: the run continues (the control)"),
    ("delete", ("is gone",), "the run dir deleted between incarnations"),
    ("empty", (), "the run dir emptied between incarnations"),
    ("replace-run", ("replaced",), "the run dir replaced by another run of ours"),
    ("replace-user", (), "the run dir replaced by a folder of someone's"),
    ("unmark", (), "the run's marker (.dflash-run) deleted"),
    ("no-record", (), "the restart record (.elastic.json) deleted"),
    ("no-checkpoints", ("checkpoint",), "the run's checkpoints deleted"),
    ("cut-config", ("config.yaml",), "the run's config.yaml cut in half"),
]:
    case("4-restart", f"restart-{_action or 'control'}", _what)(
        lambda ctx, f, a=_action, n=_names: _restart(ctx, f, a, *n))


# == 5. options that do nothing, accepted =========================================================================


for _name, _overrides, _key in [
    ("dflash2-selector-top-k-on-dflash", ["drafter.selector_top_k=4"], "drafter.selector_top_k"),
    ("dflash2-conv-group-on-dflash", ["drafter.conv_group_size=8"], "drafter.conv_group_size"),
    ("dflash2-selector-weight-on-dflash", ["drafter.selector_weight=0.5"], "drafter.selector_weight"),
    ("dflash2-selector-missing-on-dflash", ["drafter.selector_missing=ignore"], "drafter.selector_missing"),
    ("dspark-markov-rank-on-dflash2", ["drafter.variant=dflash2", "drafter.markov_rank=8"], "drafter.markov_rank"),
    ("lilicorr-option-on-dspark", ["drafter.variant=dspark", "drafter.lilicorr_w_ce=0.5"], "drafter.lilicorr_w_ce"),
    ("conv-on-lilicorr-without-conv", ["drafter.variant=lilicorr", "drafter.conv_kernel_size=3"],
     "drafter.conv_kernel_size"),
    ("noise-std-without-noise", ["drafter.noise_std=0.1"], "drafter.noise_std"),
    ("noise-schedule-without-noise", ["drafter.noise_std_final=0.1"], "drafter.noise_std_final"),
    ("dpace-alpha-without-dpace", ["drafter.dpace_alpha=0.3"], "drafter.dpace_alpha"),
    ("sliding-window-without-layers", ["drafter.sliding_window=4"], "drafter.sliding_window"),
    ("muon-lr-with-adamw", ["train.muon_lr=0.01"], "train.muon_lr"),
    ("muon-momentum-with-adamw", ["train.muon_momentum=0.9"], "train.muon_momentum"),
    ("muon-table-lr-with-adamw", ["train.muon_table_lr=0.001"], "train.muon_table_lr"),
    ("decay-ratio-with-cosine", ["train.decay_ratio=0.5"], "train.decay_ratio"),
    ("num-targets-when-colocated", ["pipeline.num_targets=2"], "pipeline.num_targets"),
]:
    case("5-ignored", _name, " ".join(_overrides))(
        lambda ctx, f, o=_overrides, k=_key: Plan(procs=[ctx.train(f, *o)], expect="refuse_or_warn", names=(k,),
                                                  codes=(2,), timeout_s=90))


@case("5-ignored", "regenerate-url-with-local-backend", "regenerate.url with regenerate.backend=local")
def _(ctx, f):
    return Plan(procs=[ctx.cli(f, "regenerate", *ctx.small("data.max_conversations=4", "regenerate.max_new_tokens=4",
                                                           "regenerate.url=http://127.0.0.1:9/v1"),
                               "--out", str(f / "data"))], expect="refuse_or_warn", names=("regenerate.url",),
                codes=(2,), timeout_s=90)


# == 6. errors under torchrun =====================================================================================


def _torchrun_refusal(ctx: Ctx, f: Path, nproc: int, *overrides: str, names: tuple[str, ...], **kw) -> Plan:
    return Plan(procs=torchrun(ctx, f, nproc, *overrides, **kw), expect="refuse", names=names, codes=(2,),
                within_s=LIVENESS_S, timeout_s=150)


@case("6-torchrun", "deterministic-two-targets", "pipeline.deterministic=true with two target ranks (3 ranks)")
def _(ctx, f):
    return _torchrun_refusal(ctx, f, 3, "pipeline.colocated=false", "pipeline.num_targets=2",
                             "pipeline.deterministic=true", names=("pipeline.deterministic",))


@case("6-torchrun", "config-typo-every-rank", "a key typo (train.lrr=1) read by both ranks: one line, not two")
def _(ctx, f):
    return _torchrun_refusal(ctx, f, 2, "train.lrr=1", names=("train.lrr",))


@case("6-torchrun", "missing-data-every-rank", "data.path that does not exist, two ranks")
def _(ctx, f):
    return _torchrun_refusal(ctx, f, 2, "data.path=/nonexistent/data.jsonl", names=("/nonexistent/data.jsonl",))


@case("6-torchrun", "node-command-line-differs", "two nodes; node 1's command line has pipeline.timeout_s=0")
def _(ctx, f):
    return _torchrun_refusal(ctx, f, 1, nnodes=2, node_args=[[], ["pipeline.timeout_s=0"]],
                             names=("pipeline.timeout_s",))


@case("6-torchrun", "node-does-not-see-run-dir",
      "two nodes; node 1 has its own (empty) storage where the run dir is (a mount namespace: needs root)")
def _(ctx, f):
    storage = f / "storage"
    storage.mkdir()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise RuntimeError("skipped: node 1's own storage is a tmpfs mounted in a mount namespace (unshare -m), "
                           "which needs root")
    procs = torchrun(ctx, f, 1, "pipeline.timeout_s=20", nnodes=2, run_dir=str(storage / "run"))
    hidden = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs none "{storage}" && exec "$@"', "sh", *procs[1].argv]
    procs[1] = Proc(argv=hidden, cwd=procs[1].cwd, env=procs[1].env)
    return Plan(procs=procs, expect="refuse", names=("run.dir",), codes=(2,), within_s=LIVENESS_S, timeout_s=150)


@case("6-torchrun", "two-nodes-relative-run-dir-two-folders",
      "two nodes in two working folders, run.dir relative: one run dir for both, or refused naming run.dir")
def _(ctx, f):
    nodes = [f / "node0", f / "node1"]
    for n in nodes:
        n.mkdir()
    return Plan(procs=torchrun(ctx, f, 1, "pipeline.timeout_s=20", "train.max_steps=3", nnodes=2, node_dirs=nodes),
                expect="refuse_or_succeed", names=("run.dir",), codes=(2,), within_s=LIVENESS_S, timeout_s=150)


@case("6-torchrun", "two-nodes-relative-run-dir", "two nodes in one working folder, run.dir relative: trains")
def _(ctx, f):
    return Plan(procs=torchrun(ctx, f, 1, "train.max_steps=3", nnodes=2), expect="succeed", within_s=LIVENESS_S,
                timeout_s=150)


def _killed_before_join(ctx: Ctx, f: Path, **env: str) -> Plan:
    return Plan(procs=torchrun(ctx, f, 1, nnodes=2, env=ctx.env(f, **env)), expect="fail", kill_worker=(1, 1.0),
                names=("rendezvous was closed",), within_s=LIVENESS_S, timeout_s=150)


@case("6-torchrun", "rank-killed-before-join", "two nodes; node 1's rank SIGKILLed before it joins")
def _(ctx, f):
    return _killed_before_join(ctx, f)


@case("6-torchrun", "rank-killed-before-join-rank0-store",
      "the same with the store hosted by rank 0 (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")
def _(ctx, f):
    return _killed_before_join(ctx, f, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


@case("6-torchrun", "rank-raises-a-bug", "an exception (injected) in rank 1's target forward, two ranks")
def _(ctx, f):
    return Plan(procs=torchrun(ctx, f, 2, env=ctx.env(f, DFLASH_TEST_FAULT="target_forward:1@1")), expect="fail",
                names=("InjectedFault",), traceback_ok=True, within_s=LIVENESS_S, timeout_s=150)


@case("6-torchrun", "rank-killed-mid-run", "rank 1 SIGKILLed after step 2, no restarts")
def _(ctx, f):
    return Plan(procs=torchrun(ctx, f, 2, "train.max_steps=null", env=ctx.env(f, DFLASH_TEST_FAULT="kill:2@1")),
                expect="fail", names=("rank 1",), within_s=LIVENESS_S, timeout_s=150)


# == 7. causes named where they are ===============================================================================


def _nan_export(ctx: Ctx, f: Path) -> Path:
    export = f / "nan-export"
    shutil.copytree(ctx.base_run() / "export", export)
    nan_safetensors(export / "model.safetensors")
    return export


def _nan_checkpoint(ctx: Ctx, f: Path, *, legacy: bool) -> Path:
    run = ctx.copy_run(f, "nan-run")
    ckpt = run / "checkpoints" / "step_4"
    nan_safetensors(ckpt / "drafter.safetensors")
    if legacy:
        (ckpt / "COMPLETE").write_text("ok\n")
    else:
        rewrite_complete(ckpt)
    return ckpt


@case("7-causes", "init-from-nan-export", "drafter.init_from an export whose weights hold NaN")
def _(ctx, f):
    export = _nan_export(ctx, f)
    return Plan(procs=[ctx.train(f, f"drafter.init_from={export}")], expect="refuse",
                names=(str(export / "model.safetensors"),), codes=(2,), timeout_s=90)


@case("7-causes", "init-from-nan-checkpoint", "drafter.init_from a checkpoint whose weights hold NaN")
def _(ctx, f):
    ckpt = _nan_checkpoint(ctx, f, legacy=False)
    return Plan(procs=[ctx.train(f, f"drafter.init_from={ckpt}")], expect="refuse",
                names=("drafter.safetensors",), codes=(2,), timeout_s=90)


@case("7-causes", "resume-legacy-marker-nan", "resume a run whose newest checkpoint (old-style marker) holds NaN")
def _(ctx, f):
    ckpt = _nan_checkpoint(ctx, f, legacy=True)
    return Plan(procs=[ctx.cli(f, "train", "--resume", f"run.dir={ckpt.parent.parent}", "train.max_steps=6")],
                expect="refuse", names=("drafter.safetensors",), codes=(2,), timeout_s=90)


@case("7-causes", "export-nan-checkpoint", "export a checkpoint whose weights hold NaN (checksums recomputed)")
def _(ctx, f):
    ckpt = _nan_checkpoint(ctx, f, legacy=False)
    return Plan(procs=[ctx.export_cmd(f, "--out", str(f / "export"), checkpoint=ckpt)], expect="refuse",
                names=("drafter.safetensors",), absent=(f / "export",), codes=(2,))


def _damaged_checkpoint(ctx: Ctx, f: Path, how: str) -> Path:
    """A copy of the shared run whose newest checkpoint's weights are cut in half or have one byte changed (its
    COMPLETE marker left as saved: the checksums can see it)."""
    ckpt = ctx.copy_run(f) / "checkpoints" / "step_4"
    data = bytearray((ckpt / "drafter.safetensors").read_bytes())
    if how == "cut":
        data = data[: len(data) // 2]
    else:
        data[-5] ^= 0x40
    (ckpt / "drafter.safetensors").write_bytes(bytes(data))
    return ckpt


@case("7-causes", "export-cut-checkpoint", "export a checkpoint whose weights file was cut short")
def _(ctx, f):
    ckpt = _damaged_checkpoint(ctx, f, "cut")
    return Plan(procs=[ctx.export_cmd(f, "--out", str(f / "export"), checkpoint=ckpt)], expect="refuse",
                names=("drafter.safetensors",), absent=(f / "export",), codes=(2,))


@case("7-causes", "export-flipped-byte", "export a checkpoint with one weight byte changed after saving")
def _(ctx, f):
    ckpt = _damaged_checkpoint(ctx, f, "flip")
    return Plan(procs=[ctx.export_cmd(f, "--out", str(f / "export"), checkpoint=ckpt)], expect="refuse",
                names=("drafter.safetensors",), absent=(f / "export",), codes=(2,))


@case("7-causes", "resume-cut-checkpoint", "resume a run whose newest checkpoint is cut: falls back, named")
def _(ctx, f):
    run = _damaged_checkpoint(ctx, f, "cut").parent.parent

    def named(out: Outcome) -> Optional[str]:
        return None if "step_4" in out.output and "drafter.safetensors" in out.output else \
            "resumed without naming the damaged checkpoint"

    return Plan(procs=[ctx.cli(f, "train", "--resume", f"run.dir={run}", "train.max_steps=5")], expect="succeed",
                check=named, timeout_s=90)


@case("7-causes", "eval-nan-export", "eval --drafter an export whose weights hold NaN")
def _(ctx, f):
    export = _nan_export(ctx, f)
    return Plan(procs=[ctx.cli(f, "eval", "--drafter", str(export), "--config", str(ctx.base_run() / "config.yaml"),
                               "--out", str(f / "out"))], expect="refuse", names=(str(export / "model.safetensors"),),
                codes=(2,), absent=(f / "out",))


@case("7-causes", "eval-cut-export", "eval --drafter an export whose weights file was cut short")
def _(ctx, f):
    export = f / "cut-export"
    shutil.copytree(ctx.base_run() / "export", export)
    data = (export / "model.safetensors").read_bytes()
    (export / "model.safetensors").write_bytes(data[: len(data) // 2])
    return Plan(procs=[ctx.cli(f, "eval", "--drafter", str(export), "--config", str(ctx.base_run() / "config.yaml"),
                               "--out", str(f / "out"))], expect="refuse", names=("model.safetensors",), codes=(2,),
                absent=(f / "out",))


@case("7-causes", "refused-mixed-drafter-leaves-nothing",
      "export --format speculators --save-target of a drafter mixing full and sliding layers")
def _(ctx, f):
    run = f / "mixed"
    proc = subprocess.run([ctx.python, "-m", "dflash_trainer", "train",
                           *ctx.small("drafter.num_layers=2", "drafter.sliding_layers=[1]", "drafter.sliding_window=4",
                                      "train.max_steps=2", f"run.dir={run}")],
                          cwd=f, env=ctx.env(f), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"training the mixed drafter failed:\n{proc.stderr[-3000:]}")
    ckpt = max((run / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1]))
    return Plan(procs=[ctx.export_cmd(f, "--out", str(f / "new" / "export"), "--format", "speculators",
                                      "--save-target", str(f / "new" / "target"), checkpoint=ckpt)],
                expect="refuse", names=("sliding",), absent=(f / "new",), codes=(2,))


@case("7-causes", "refused-verifier-leaves-nothing", "an export refused for its verifier leaves neither folder")
def _(ctx, f):
    return _refused_export(ctx, f, "--out", str(f / "new" / "export"), "--format", "speculators", "--verifier",
                           str(ctx.base_run() / "export"), names=(str(ctx.base_run() / "export"),),
                           absent=[f / "new"])


@case("7-causes", "init-from-missing", "drafter.init_from a folder that does not exist")
def _(ctx, f):
    return Plan(procs=[ctx.train(f, "drafter.init_from=/nonexistent/export")], expect="refuse",
                names=("drafter.init_from",), codes=(2,), timeout_s=90)


@case("7-causes", "init-from-other-shape", "drafter.init_from an export of a two-layer drafter into one layer")
def _(ctx, f):
    run = f / "deeper"
    proc = subprocess.run([ctx.python, "-m", "dflash_trainer", "train",
                           *ctx.small("drafter.num_layers=2", "train.max_steps=1", f"run.dir={run}")],
                          cwd=f, env=ctx.env(f), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"training the deeper drafter failed:\n{proc.stderr[-3000:]}")
    return Plan(procs=[ctx.train(f, f"drafter.init_from={run / 'export'}")], expect="refuse",
                names=("drafter.init_from",), codes=(2,), timeout_s=90)


LONG = ("train.max_steps=null", "train.num_epochs=50")
"""A run that cannot finish before the signal arrives."""

for _at in (0.3, 1.5, 3.0, 5.0):
    case("7-causes", f"ctrl-c-train-at-{_at}s", f"Ctrl-C (SIGINT) {_at} s into `train`")(
        lambda ctx, f, at=_at: Plan(procs=[ctx.cli(f, "train", *ctx.small(*LONG, "run.dir=run"))], expect="interrupt",
                                    signal=(at, signal.SIGINT), codes=(130,), timeout_s=90))

for _cmd, _at in (("export", 2.0), ("eval", 3.0), ("regenerate", 3.0), ("plan", 2.0), ("report", 1.0)):
    def _interrupted(ctx, f, cmd=_cmd, at=_at):
        args = {"export": lambda: ["--checkpoint", str(ctx.checkpoint()), "--out", str(f / "export")],
                "eval": lambda: ["--drafter", str(ctx.base_run() / "export"), "--out", str(f / "out")],
                "regenerate": lambda: [*ctx.small("data.max_conversations=40"), "--out", str(f / "data")],
                "plan": lambda: [*ctx.small("run.dir=run")],
                "report": lambda: [str(ctx.copy_run(f)), "--out", str(f / "report")]}[cmd]()
        return Plan(procs=[ctx.cli(f, cmd, *args)], expect="interrupt", signal=(at, signal.SIGINT), codes=(130,),
                    timeout_s=60)

    case("7-causes", f"ctrl-c-{_cmd}-at-{_at}s", f"Ctrl-C (SIGINT) {_at} s into `{_cmd}`")(_interrupted)


@case("7-causes", "sigterm-train-at-5s", "SIGTERM 5 s into `train` (its signal handling installed)")
def _(ctx, f):
    return Plan(procs=[ctx.cli(f, "train", *ctx.small(*LONG, "run.dir=run"))], expect="interrupt",
                signal=(5.0, signal.SIGTERM), codes=(143,), timeout_s=90)


@case("7-causes", "ctrl-c-torchrun-at-4s", "Ctrl-C (SIGINT) to torchrun 4 s into a two-rank `train`")
def _(ctx, f):
    return Plan(procs=torchrun(ctx, f, 2, *LONG), expect="interrupt", signal=(4.0, signal.SIGINT), timeout_s=120)


# == 0. older bad inputs ===========================================================================================


for _name, _args, _names in [
    ("recipe-unknown", ["--config", "demoo"], ("demoo",)),
    ("config-file-missing", ["--config", "./my.yaml"], ("my.yaml",)),
    ("key-typo", ["train.lrr=1"], ("train.lrr",)),
    ("section-typo", ["trian.lr=1"], ("trian",)),
    ("value-not-a-number", ["train.lr=abc"], ("train.lr",)),
    ("value-negative", ["train.lr=-1"], ("train.lr",)),
    ("value-nan", ["train.lr=nan"], ("train.lr",)),
    ("override-without-value", ["train.lr"], ("train.lr",)),
    ("block-size-one", ["drafter.block_size=1"], ("drafter.block_size",)),
    ("tap-out-of-range", ["drafter.tap_layer_ids=[1,99]"], ("tap_layer_ids",)),
    ("tap-on-last-layer", ["drafter.tap_layer_ids=[1,5]"], ("tap_layer_ids",)),
    ("random-init-unknown", ["target.random_init=tiny-nope"], ("tiny-nope",)),
    ("target-path-missing", ["target.random_init=null", "target.path=/nonexistent/model"], ("/nonexistent/model",)),
    ("data-path-missing", ["data.path=/nonexistent/data.jsonl"], ("/nonexistent/data.jsonl",)),
    ("max-steps-zero", ["train.max_steps=0"], ("train.max_steps",)),
    ("token-budget-tiny", ["pipeline.token_budget=8"], ("pipeline.token_budget",)),
    ("device-cuda-without-gpu", ["run.device=cuda"], ("run.device",)),
    ("resume-missing-checkpoint", ["train.resume=/nonexistent/step_3"], ("/nonexistent/step_3",)),
    ("grad-accum-zero", ["train.grad_accum=0"], ("train.grad_accum",)),
    ("eval-interval-negative", ["eval.interval=-5"], ("eval.interval",)),
    ("unknown-variant", ["drafter.variant=dflash3"], ("drafter.variant",)),
    ("num-epochs-float", ["train.num_epochs=1.5"], ("train.num_epochs",)),
]:
    def _bad(ctx, f, a=_args, n=_names):
        if a[0] == "--config":
            return Plan(procs=[ctx.cli(f, "train", *a, "run.dir=run")], expect="refuse", names=n, codes=(2,))
        return Plan(procs=[ctx.train(f, *a)], expect="refuse", names=n, codes=(2,), timeout_s=90)

    case("0-inputs", _name, " ".join(_args))(_bad)


@case("0-inputs", "config-yaml-broken", "--config a YAML file with a syntax error")
def _(ctx, f):
    (f / "bad.yaml").write_text("train:\n  lr: [1e-3\n")
    return Plan(procs=[ctx.cli(f, "train", "--config", "bad.yaml", "run.dir=run")], expect="refuse",
                names=("bad.yaml",), codes=(2,))


@case("0-inputs", "data-empty-file", "data.path an empty JSONL file")
def _(ctx, f):
    (f / "empty.jsonl").write_text("")
    return Plan(procs=[ctx.train(f, f"data.path={f / 'empty.jsonl'}")], expect="refuse", names=("empty.jsonl",),
                codes=(2,), timeout_s=90)


@case("0-inputs", "data-garbage", "data.path a JSONL file of garbage lines")
def _(ctx, f):
    (f / "junk.jsonl").write_text("not json\n{\"also\": \n\x00\x01\n")
    return Plan(procs=[ctx.train(f, f"data.path={f / 'junk.jsonl'}")], expect="refuse", names=("junk.jsonl",),
                codes=(2,), timeout_s=90)


@case("0-inputs", "run-dir-is-a-file", "run.dir names an existing file")
def _(ctx, f):
    (f / "afile").write_text("x")
    return Plan(procs=[ctx.train(f, run_dir=str(f / "afile"))], expect="refuse", names=("run.dir",),
                protect=(f / "afile",), codes=(2,), timeout_s=90)


@case("0-inputs", "train-into-finished-run", "train run.dir= a finished run without --resume or --overwrite")
def _(ctx, f):
    run = ctx.copy_run(f)
    return Plan(procs=[ctx.train(f, run_dir=str(run))], expect="refuse", names=("run.dir",), protect=(run,),
                codes=(2,), timeout_s=90)


@case("0-inputs", "resume-nothing", "train --resume into a folder that holds no run")
def _(ctx, f):
    (f / "fresh").mkdir()
    return Plan(procs=[ctx.cli(f, "train", "--resume", f"run.dir={f / 'fresh'}")], expect="refuse", names=("run.dir",),
                codes=(2,))


@case("0-inputs", "export-checkpoint-typo", "export --checkpoint RUN/checkpoints/step_44 (a typo)")
def _(ctx, f):
    return Plan(procs=[ctx.cli(f, "export", "--checkpoint", str(ctx.base_run() / "checkpoints" / "step_44"),
                               "--out", str(f / "export"))], expect="refuse", names=("step_44",), codes=(2,),
                absent=(f / "export",))


@case("0-inputs", "export-checkpoint-is-run-dir", "export --checkpoint RUN (the run dir, not a checkpoint)")
def _(ctx, f):
    return Plan(procs=[ctx.cli(f, "export", "--checkpoint", str(ctx.base_run()), "--out", str(f / "export"))],
                expect="refuse", names=("--checkpoint",), codes=(2,), absent=(f / "export",))


@case("0-inputs", "eval-drafter-typo", "eval --drafter RUN/exprt (a typo)")
def _(ctx, f):
    return Plan(procs=[ctx.cli(f, "eval", "--drafter", str(ctx.base_run() / "exprt"))], expect="refuse",
                names=("exprt",), codes=(2,))


@case("0-inputs", "eval-prompts-missing", "eval eval.prompts= a file that does not exist")
def _(ctx, f):
    return Plan(procs=[ctx.cli(f, "eval", "--drafter", str(ctx.base_run() / "export"), "--out", str(f / "out"),
                               "eval.prompts=/nonexistent/prompts.jsonl")], expect="refuse",
                names=("/nonexistent/prompts.jsonl",), codes=(2,), absent=(f / "out",))


@case("0-inputs", "report-not-a-run", "report on a folder that is not a run")
def _(ctx, f):
    (f / "nope").mkdir()
    return Plan(procs=[ctx.cli(f, "report", str(f / "nope"))], expect="refuse", names=("nope",), codes=(2,))


@case("0-inputs", "export-format-unknown", "export --format onnx")
def _(ctx, f):
    return Plan(procs=[ctx.export_cmd(f, "--out", str(f / "export"), "--format", "onnx")], expect="refuse",
                names=("--format",), codes=(2,), absent=(f / "export",))


@case("0-inputs", "subcommand-unknown", "dflash-train trian")
def _(ctx, f):
    return Plan(procs=[ctx.cli(f, "trian")], expect="refuse", names=("trian",), codes=(2,))


# -- the table, the JSON ------------------------------------------------------------------------------------------


def selected(only: list[str]) -> list[Case]:
    if not only:
        return list(CASES)
    picked = [c for c in CASES if any(o == c.group or c.group.startswith(f"{o}-") or o == c.group.split("-", 1)[1]
                                      or o == c.name for o in only)]
    unknown = [o for o in only if not any(o == c.group or c.group.startswith(f"{o}-") or
                                          o == c.group.split("-", 1)[1] or o == c.name for c in CASES)]
    if unknown:
        raise SystemExit(f"--only {' '.join(unknown)}: no such group or case (groups: {', '.join(GROUPS)}; "
                         "--list shows the cases)")
    return picked


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", default=[], metavar="GROUP|CASE",
                   help="groups (1-overwrite, 1, overwrite, ...) or case names to run")
    p.add_argument("--list", action="store_true", help="list the groups and cases and exit")
    p.add_argument("--scratch", default=None, help="scratch folder (default: a new temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (each case's output is in it)")
    p.add_argument("--python", default=sys.executable, help="the Python that runs dflash_trainer and torchrun")
    p.add_argument("--out", default=str(RESULTS), help="folder for the JSON ('' for none)")
    args = p.parse_args(argv)
    cases = selected(args.only)
    if args.list:
        for group, what in GROUPS.items():
            print(f"{group}: {what}")
            for c in (c for c in cases if c.group == group):
                print(f"    {c.name:48s} {c.what}")
        return 0
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="dflash-reliability-"))
    scratch.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(scratch, args.python)
    rows = []
    started = time.monotonic()
    print(f"{len(cases)} cases in {scratch}", flush=True)
    try:
        for c in cases:
            try:
                row = run_case(ctx, c)
            except Exception as e:  # the probe's own set-up failed: a row that says so, not a verdict on the CLI
                row = {"case": c.name, "group": c.group, "what": c.what, "verdict": "setup-failed",
                       "why": f"{type(e).__name__}: {e}"[:400], "exit": None, "child_exits": [], "seconds": 0,
                       "traceback": False, "message": "", "command": ""}
            rows.append(row)
            print(f"{row['verdict']:10s} {row['seconds']:6.1f}s  {c.group:12s} {c.name:44s} "
                  f"{row['why'][:90] if row['verdict'] != 'ok' else ''}", flush=True)
    finally:
        if not args.keep and args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    counts = {g: {v: sum(1 for r in rows if r["group"] == g and r["verdict"] == v) for v in (*VERDICTS, "setup-failed")}
              for g in GROUPS if any(r["group"] == g for r in rows)}
    print("\n| class | cases | " + " | ".join(VERDICTS) + " |")
    print("|---|---|" + "---|" * len(VERDICTS))
    for g, n in counts.items():
        print(f"| {g} | {sum(n.values())} | " + " | ".join(str(n[v]) for v in VERDICTS) + " |")
    total = {v: sum(n[v] for n in counts.values()) for v in (*VERDICTS, "setup-failed")}
    print(f"| all | {len(rows)} | " + " | ".join(str(total[v]) for v in VERDICTS) + " |")
    bad = [r for r in rows if r["verdict"] != "ok"]
    if bad:
        print("\nnot ok:")
        for r in bad:
            print(f"  {r['case']} [{r['verdict']}] {r['why']}\n      message: {r['message'][:300]}")
    result = {"bench": "reliability_probe", "seconds": round(time.monotonic() - started, 1),
              "python": args.python, "only": args.only, "counts": counts, "total": total, "cases": rows,
              "commit": os.environ.get("BENCH_COMMIT") or _commit()}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.now().strftime("%Y-%m-%dT%H%M%S")
        what = "all" if not args.only else "-".join(args.only)[:60]
        (out / f"{stamp}-reliability_probe-{what}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}))
    return 0


def _commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    raise SystemExit(main())
