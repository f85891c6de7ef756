"""The CPU thread count: each process takes its share of the free cores, an explicit setting wins, and a command on
the CPU applies and logs it."""

from __future__ import annotations

import logging

import pytest
import torch

from dflash_trainer.cli import main
from dflash_trainer.errors import ConfigError
from dflash_trainer.config import load_config
from dflash_trainer.runtime.cpu_threads import choose_cpu_threads


@pytest.mark.parametrize("cores, load, processes, threads", [
    (2, 0.0, 1, 2),    # an idle 2-core machine: both cores
    (2, 1.0, 1, 1),    # another job keeps one core busy: the free one only
    (2, 7.5, 1, 1),    # overloaded: still one thread, never zero
    (16, 0.2, 4, 4),   # four processes share 16 idle cores
    (16, 4.0, 4, 3),   # 12 free cores among four processes
    (8, 0.4, 3, 2),    # a remainder is left idle rather than oversubscribed
])
def test_each_process_takes_its_share_of_the_free_cores(cores, load, processes, threads):
    choice = choose_cpu_threads(None, cores=cores, load=load, processes=processes, omp_env=None)
    assert choice.threads == threads
    assert f"{cores} cores" in choice.reason and f"{processes} process" in choice.reason


def test_an_explicit_setting_wins():
    assert choose_cpu_threads(3, cores=2, load=5.0, processes=2, omp_env="1").threads == 3
    omp = choose_cpu_threads(None, cores=16, load=0.0, processes=1, omp_env="2")
    assert (omp.threads, omp.reason) == (2, "OMP_NUM_THREADS")
    assert choose_cpu_threads(None, cores=4, load=0.0, processes=1, omp_env="many").threads == 4


def test_a_bad_count_is_named():
    with pytest.raises(ConfigError, match="run.cpu_threads must be >= 1"):
        load_config("demo", ["run.cpu_threads=0"])


def test_a_command_on_the_cpu_sets_and_logs_its_threads(monkeypatch, caplog, tmp_path):
    """`plan` on the CPU: the thread count is applied before the command runs, with the log line saying why."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    caplog.set_level(logging.INFO)
    try:
        main(["report", str(tmp_path / "none")])  # no config: nothing is set
        assert "CPU threads" not in caplog.text
        monkeypatch.setattr("dflash_trainer.commands.plan.run", lambda config, args: 0)
        assert main(["plan", "--config", "demo", "run.device=cpu", "run.cpu_threads=1"]) == 0
        assert torch.get_num_threads() == 1
        assert "CPU threads: 1 per process (run.cpu_threads" in caplog.text
    finally:
        torch.set_num_threads(before)
