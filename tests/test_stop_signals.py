"""SIGTERM and SIGINT stop a run cleanly, in one process and under torchrun: every rank stops after the same
step, the final checkpoint is that step, summary.json says `stopped`, and the exit code is 128 + the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline_helpers import SRC, kill_tree, metrics, overrides, summary, train_in_process
from spawn_helpers import free_port

from dflash_trainer.faults import InjectedFault
from dflash_trainer.runtime.launch import entry_point

LONG = ("train.max_steps=100000", "train.num_epochs=50", "train.checkpoint_interval=100000", "train.log_interval=1")


def _start(cmd: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.pop("DFLASH_TEST_FAULT", None)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop_after_steps(proc: subprocess.Popen, run_dir, steps: int, signum: int) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if sum("loss" in r for r in metrics(run_dir)) >= steps:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")[-3000:]
    proc.send_signal(signum)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise AssertionError("the run did not stop within 90 s of the signal")
    return out.decode(errors="replace")


def _assert_stopped(run_dir, name: str) -> None:
    s = summary(run_dir)
    assert s["status"] == "stopped" and s["stopped_by"] == name, s
    steps = [r["step"] for r in metrics(run_dir) if "loss" in r]
    assert s["steps"] == steps[-1] >= 3
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_{s['steps']}"]  # the last step
    assert s["eval"] is None  # a stop is quick: no final evaluation


@pytest.mark.parametrize("signum, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
def test_one_process_stops_cleanly_on_a_signal(tmp_path, signum, name):
    run_dir = tmp_path / "run"
    proc = _start([sys.executable, "-m", "dflash_trainer", "train", "--config", "demo", *overrides(run_dir, *LONG)])
    out = _stop_after_steps(proc, run_dir, 3, signum)
    assert proc.returncode == 128 + signum, out[-3000:]
    assert "stopping after this step" in out
    _assert_stopped(run_dir, name)
    command = f"cd {os.getcwd()} && {entry_point('dflash-train')} train --resume run.dir={run_dir.resolve()}"
    assert f"continue this run with:\n  {command}" in out and summary(run_dir)["resume_command"] == command
    if signum == signal.SIGTERM:  # the printed command, as it is (but the budget), continues the same run, run by a
        # shell whose PATH holds no virtual environment (a user's, after scripts/demo.sh activated one for itself)
        steps = summary(run_dir)["steps"]
        path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if Path(d) != Path(sys.executable).parent)
        resumed = subprocess.run(["bash", "-c", f"{command} train.max_steps={steps + 2}"], capture_output=True,
                                 text=True, timeout=120,
                                 env=dict(os.environ, PATH=path, PYTHONPATH=str(SRC), HF_HUB_OFFLINE="1"))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert summary(run_dir)["status"] == "ok" and summary(run_dir)["steps"] == steps + 2


def test_sigterm_to_torchrun_stops_every_rank_cleanly(tmp_path):
    """The launcher forwards SIGTERM to its ranks: a split run (target + drafter) stops, not fails."""
    run_dir = tmp_path / "run"
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()), "-m", "dflash_trainer", "train", "--config", "demo",
                   *overrides(run_dir, *LONG, "pipeline.colocated=false", "pipeline.num_targets=1")])
    out = _stop_after_steps(proc, run_dir, 3, signal.SIGTERM)
    assert proc.returncode != 0, out[-3000:]
    _assert_stopped(run_dir, "SIGTERM")
    command = (f"cd {os.getcwd()} && {entry_point('torchrun')} --nproc_per_node 2 -m dflash_trainer train --resume "
               f"run.dir={run_dir.resolve()}")
    assert command in out and summary(run_dir)["resume_command"] == command, out[-3000:]


# -- liveness: a frozen rank, a killed rank, a long pause ---------------------------------------------------


def _worker_pid(launcher_pid: int, rank: int, timeout_s: float = 60.0) -> int:
    """The pid of torchrun's worker with RANK=rank."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if ppid == launcher_pid and f"RANK={rank}".encode() in env:
                return int(entry)
        time.sleep(0.2)
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


def _torchrun(run_dir, nproc: int, *extra: str, fault: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "-m", "dflash_trainer", "train", "--config", "demo",
           *overrides(run_dir, *extra)]
    if fault is None:
        return _start(cmd)
    os.environ["DFLASH_TEST_FAULT"] = fault
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    finally:
        del os.environ["DFLASH_TEST_FAULT"]


def test_a_frozen_rank_ends_the_job_naming_it(tmp_path):
    """kill -STOP of one drafter of a 1:2 split: the others see its heartbeat stop and end the job within
    seconds of pipeline.liveness_timeout_s, the summary naming the frozen rank (not the 30-minute timeout)."""
    run_dir = tmp_path / "run"
    proc = _torchrun(run_dir, 3, *LONG, "pipeline.colocated=false", "pipeline.num_targets=1",
                     "pipeline.liveness_timeout_s=4")
    frozen = _worker_pid(proc.pid, 2)
    try:
        deadline = time.monotonic() + 120
        while sum("loss" in r for r in metrics(run_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while time.monotonic() < stopped_at + 60:
            if (run_dir / "summary.json").is_file() and summary(run_dir).get("status") == "failed":
                break
            time.sleep(0.2)
        took = time.monotonic() - stopped_at
        s = summary(run_dir)
        assert s["status"] == "failed" and s["failed_rank"] == 2 and "stopped answering" in s["cause"], s
        assert took < 20, f"noticed after {took:.0f} s"
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)
        except ProcessLookupError:
            pass
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
    assert proc.returncode != 0


def test_a_long_pause_of_training_itself_is_not_silence(tmp_path):
    """The heartbeat is a thread's: a main thread busy for longer than the liveness timeout (here a target
    forward that sleeps 6 s) leaves the job running to its end."""
    run_dir = tmp_path / "run"
    proc = _torchrun(run_dir, 2, "pipeline.colocated=false", "pipeline.num_targets=1", "pipeline.liveness_timeout_s=2",
                     "train.max_steps=3", "eval.at_end=false", fault="delay_target:6@0")
    out, _ = proc.communicate(timeout=150)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    assert summary(run_dir)["status"] == "ok"


@pytest.mark.parametrize("stage", ["load_config", "import_module"])
def test_ctrl_c_in_the_first_seconds_is_a_clean_exit_130(stage, monkeypatch, capsys):
    """Ctrl-C while the command is still importing torch or reading its config (before training installs its
    signal handlers) exits 130 with one line, not a KeyboardInterrupt traceback."""
    from dflash_trainer import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "load_config" if stage == "load_config" else "importlib",
                        interrupted if stage == "load_config" else type("M", (), {"import_module": interrupted}))
    try:
        rc = cli.main(["train", "--config", "demo"])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped dflash-train's main (a traceback for the user)")
    assert rc == 130
    assert capsys.readouterr().err.strip() == "dflash-train train: interrupted (Ctrl-C)"


def test_training_called_from_python_gives_the_signal_handlers_back(tmp_path, monkeypatch):
    """`dflash-train train` run in a process that goes on (a notebook, a script) holds SIGINT and SIGTERM for the run
    only: once it has ended, or failed, a Ctrl-C interrupts as it did before."""
    handled = (signal.SIGINT, signal.SIGTERM)
    before = [signal.getsignal(s) for s in handled]
    assert train_in_process(tmp_path / "ok", "train.max_steps=2") == 0
    assert [signal.getsignal(s) for s in handled] == before

    monkeypatch.setenv("DFLASH_TEST_FAULT", "drafter_step:2")
    with pytest.raises(InjectedFault):
        train_in_process(tmp_path / "failed", "train.max_steps=4")
    assert summary(tmp_path / "failed")["status"] == "failed"
    assert [signal.getsignal(s) for s in handled] == before
