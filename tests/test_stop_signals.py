"""SIGTERM and SIGINT stop a run cleanly, in one process and under torchrun: every rank stops after the same
step, the final checkpoint is that step, summary.json says `stopped`, and the exit code is 128 + the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pipeline_helpers import SRC, free_port, kill_tree, metrics, overrides, summary

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


def test_sigterm_to_torchrun_stops_every_rank_cleanly(tmp_path):
    """The launcher forwards SIGTERM to its ranks: a split run (target + drafter) stops, not fails."""
    run_dir = tmp_path / "run"
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()), "-m", "dflash_trainer", "train", "--config", "demo",
                   *overrides(run_dir, *LONG, "pipeline.colocated=false", "pipeline.num_targets=1")])
    out = _stop_after_steps(proc, run_dir, 3, signal.SIGTERM)
    assert proc.returncode != 0, out[-3000:]
    _assert_stopped(run_dir, "SIGTERM")
