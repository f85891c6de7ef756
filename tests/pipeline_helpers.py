"""Helpers for the multi-process CPU tests: launch `torchrun ... dflash_trainer train` and read its run dir.

Every launch gets its own port and log dir and is bounded by a timeout, after which torchrun and every rank
(each in its own session under torchrun) are killed.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from spawn_helpers import free_port

from dflash_trainer.faults import kill_tree

SRC = Path(__file__).resolve().parents[1] / "src"
_CACHE_ENV = "DFLASH_TEST_TOKENIZED_CACHE"


def _session_cache_dir() -> str:
    """The test session's tokenized-data cache: made (and removed at exit) by the first process that imports this
    module; the processes it starts inherit it through the environment, so they neither make nor remove one."""
    if os.environ.get(_CACHE_ENV):
        return os.environ[_CACHE_ENV]
    path = tempfile.mkdtemp(prefix="dflash-test-tokenized-")
    os.environ[_CACHE_ENV] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


_CACHE_DIR = _session_cache_dir()
"""One tokenized-data cache for the whole test session (the first run tokenizes, the others reuse it)."""

SMALL = (
    "logging.progress=false",
    "data.max_conversations=60",
    "data.num_eval_conversations=4",
    "data.max_length=256",
    "pipeline.token_budget=512",
    "drafter.num_layers=1",
    "pipeline.timeout_s=60",
    "train.max_steps=null",
    "train.num_epochs=1",
    "eval.at_end=false",
    f"data.cache_dir={_CACHE_DIR}",
)
"""The demo recipe shrunk: 14 jobs of <= 512 tokens, a one-layer drafter, waits bounded by 60 s."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """What one `torchrun` (or in-process) training run left behind."""

    returncode: int
    output: str
    """stdout and stderr of torchrun and every rank, interleaved."""
    elapsed_s: float
    run_dir: Path
    node_ended_s: tuple[float, ...] = ()
    """When each node's torchrun ended, in seconds after the launch (one entry per node)."""


def overrides(run_dir: Path, *extra: str) -> list[str]:
    return [*SMALL, f"run.dir={run_dir}", *extra]


def torchrun(
    run_dir: Path,
    nproc: int,
    *extra: str,
    fault: Optional[str] = None,
    resume: bool = False,
    timeout_s: float = 150.0,
    max_restarts: int = 0,
    fault_restart: Optional[int] = None,
    nnodes: int = 1,
    node_dirs: Optional[list[Path]] = None,
    node_args: Optional[list[list[str]]] = None,
) -> Launch:
    """Run `torchrun --nproc_per_node nproc [--max-restarts N] -m dflash_trainer train --config demo SMALL...
    extra...`; `fault_restart`: the `fault` applies only in that restart (0: the first incarnation). `nnodes` > 1
    starts that many torchrun agents on localhost, `--node_rank` 0..nnodes-1, meeting at a c10d rendezvous (what
    several machines run); their outputs are joined, node by node, and the first non-zero exit status is kept.
    `node_dirs`: each node's working directory (default: this one), so that a relative `run_dir` names a different
    folder on each node, as on machines without shared storage (node 0's is the Launch's); `node_args`: each node's
    own extra overrides (a command line that differs between nodes). Node 0 hosts the rendezvous store, as the
    machine named in `--rdzv-endpoint` does."""
    on_node0 = (node_dirs[0] if node_dirs else Path.cwd()) / run_dir  # a relative run_dir: each node's own
    log_dir = Path(tempfile.mkdtemp(prefix="torchrun-logs-", dir=on_node0.parent))
    if nnodes == 1:
        rendezvous = [["--master_addr", "127.0.0.1", "--master_port", str(free_port())]]
    else:
        endpoint = f"127.0.0.1:{free_port()}"
        rendezvous = [["--nnodes", str(nnodes), "--node_rank", str(n), "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", endpoint, "--rdzv-id", f"test-{run_dir.name}",
                       "--rdzv-conf", f"is_host={n == 0}"] for n in range(nnodes)]
    train = ["-m", "dflash_trainer", "train", "--config", "demo", *overrides(run_dir, *extra)]
    if resume:
        train.append("--resume")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("DFLASH_TEST_FAULT", None)
    env.pop("DFLASH_TEST_FAULT_RESTART", None)
    if fault:
        env["DFLASH_TEST_FAULT"] = fault
    if fault_restart is not None:
        env["DFLASH_TEST_FAULT_RESTART"] = str(fault_restart)
    start = time.monotonic()
    logs = [log_dir / f"node{n}.out" for n in range(nnodes)]  # files, not pipes: no agent blocks on a full pipe
    procs = []
    for n, node in enumerate(rendezvous):
        with open(logs[n], "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *node,
                 "--log-dir", str(log_dir / f"node{n}"),
                 *(["--max-restarts", str(max_restarts)] if max_restarts else []), *train,
                 *(node_args[n] if node_args else [])],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                cwd=node_dirs[n] if node_dirs else None,
            ))
    ended = _ends(procs, start, start + timeout_s)
    texts = [path.read_bytes().decode(errors="replace") for path in logs]
    output = "\n".join(f"--- node {n} ---\n{text}" for n, text in enumerate(texts)) if nnodes > 1 else texts[0]
    if None in ended:
        timed_out = [n for n, at in enumerate(ended) if at is None]
        raise AssertionError(f"torchrun (node {timed_out}) did not end within {timeout_s:.0f}s "
                             f"(ended after {ended} s):\n{output[-6000:]}")
    codes = [proc.returncode for proc in procs]
    return Launch(returncode=next((c for c in codes if c != 0), 0), output=output,
                  elapsed_s=time.monotonic() - start, run_dir=on_node0, node_ended_s=tuple(ended))


def _ends(procs: list[subprocess.Popen], start: float, deadline: float) -> list[Optional[float]]:
    """When each torchrun ended (seconds after `start`), or None for one still running at the deadline, which is
    then killed with every rank."""
    ended: list[Optional[float]] = [None] * len(procs)
    while None in ended and time.monotonic() < deadline:
        for n, proc in enumerate(procs):
            if ended[n] is None and proc.poll() is not None:
                ended[n] = time.monotonic() - start
        time.sleep(0.1)
    for n, proc in enumerate(procs):
        if ended[n] is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)
    return ended


def assert_ok(launch: Launch) -> dict:
    """The run exited 0 and wrote an ok summary; returns the summary."""
    assert launch.returncode == 0, f"exit {launch.returncode}:\n{launch.output[-6000:]}"
    s = summary(launch.run_dir)
    assert s["status"] == "ok", s
    return s


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def committed_jobs(rows: list[dict]) -> list[int]:
    """Job ids committed by the given metrics rows, in order, duplicates kept."""
    return [j for row in rows for j in row.get("jobs", ())]  # eval rows carry eval_tau, no jobs


def planned_jobs(run_dir: Path, epoch: int = 0) -> list[int]:
    plan = json.loads((run_dir / "plan" / f"epoch_{epoch}.json").read_text())
    return [job["job_id"] for job in plan["jobs"]]


def checkpoints(run_dir: Path) -> list[Path]:
    found = [p for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def ledger(checkpoint: Path, epoch: int = 0) -> list[int]:
    state = json.loads((checkpoint / "state.json").read_text())
    return list(state["ledger"].get(str(epoch), []))


def inline_losses(run_dir: Path, extra: tuple[str, ...], job_order: list[int]) -> list[float]:
    """Per-step losses of a one-drafter run (grad_accum=1) replayed in this process without any transport:
    the target forward runs inline on each job of `job_order` (in that order) and the drafter trains on it.

    Uses the run dir's plan and tokenized data; builds the target and drafter from the same config and seed, and
    trains on one thread, as the ranks do.
    """
    import torch

    from dflash_trainer.config import load_config
    from dflash_trainer.data.plan import read_epoch_plan
    from dflash_trainer.data.prepare import prepare_data
    from dflash_trainer.data.tokenizer import load_tokenizer
    from dflash_trainer.drafter.spec import drafter_spec, first_spare_row
    from dflash_trainer.target.capture import TapCapture
    from dflash_trainer.target.head import head_from_model
    from dflash_trainer.target.load import load_target, target_model_config
    from dflash_trainer.target.worker import forward_job
    from dflash_trainer.train.trainer import DrafterTrainer, planned_steps
    from dflash_trainer.transport.wire import allocate, wire_spec

    config = load_config("demo", overrides(run_dir, *extra))
    assert config.train.grad_accum == 1
    device = torch.device("cpu")
    tokenizer = load_tokenizer(config.target, config.data.chat_template)
    prepared = prepare_data(config, run_dir, tokenizer=tokenizer, write_files=False)
    plan = read_epoch_plan(run_dir, 0)
    by_id = {job.job_id: job for job in plan.jobs}
    target_config = target_model_config(config.target)
    mask_id = first_spare_row(tokenizer)  # drafter_spec prefers drafter.mask_token_id when set
    spec = drafter_spec(target_config, config.drafter, mask_token_id=mask_id)
    target = load_target(config.target, device, seed=config.run.seed)
    capture = TapCapture(target, spec.tap_layer_ids)
    wire = wire_spec(config, hidden=spec.hidden_size, num_taps=spec.num_taps)
    losses: list[float] = []
    trainer = DrafterTrainer(
        config, spec=spec, head=head_from_model(target), device=device, group=None, is_leader=False,
        run_dir=run_dir, data_digest=prepared.summary.content_sha256,
        total_steps=planned_steps(config, len(plan.jobs), 1, 0), target_config=target_config,
        on_step=lambda trainer, record: losses.append(record.loss),
    )
    queue = [by_id[j] for j in job_order]

    def take():
        if not queue:
            return None
        batch, _ = forward_job(capture, prepared.train, queue.pop(0), allocate(wire, device))
        return batch, lambda: None

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order as the single-threaded torchrun ranks
    try:
        trainer.run(take)
    finally:
        torch.set_num_threads(threads)
    return losses


def train_in_process(run_dir: Path, *extra: str, resume: bool = False) -> int:
    """`dflash-train train --config demo SMALL... extra...` in this process (one process: colocated)."""
    import torch

    from dflash_trainer.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reduction order as the single-threaded torchrun ranks
    try:
        # one thread whatever the machine's load (the automatic count follows it): runs compared bit for bit sum alike
        return main(["train", "--config", "demo", *overrides(run_dir, "run.cpu_threads=1", *extra),
                     *(["--resume"] if resume else [])])
    finally:
        torch.set_num_threads(threads)
