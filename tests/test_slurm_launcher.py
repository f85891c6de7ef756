"""`scripts/slurm/train.sbatch` in dry-run mode, inside a pretend SLURM allocation (its variables and a `scontrol` that
lists the nodes): the command every node would run parses as torchrun's and as ours, and its config loads."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from torch.distributed.run import get_args_parser

from dflash_trainer.cli import parse_args
from dflash_trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"


def _sbatch(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'gpu-a17\\ngpu-a18\\ngpu-b02\\n'\n")
    scontrol.chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DFLASH_"))}
    full_env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=30,
                          cwd=ROOT)


ALLOCATION = dict(SLURM_JOB_ID="731", SLURM_JOB_NODELIST="gpu-a[17-18],gpu-b02", SLURM_NNODES="3",
                  SLURM_GPUS_ON_NODE="8", DFLASH_DRY_RUN="1")


def test_every_node_runs_one_torchrun_agent_meeting_at_the_first_node(tmp_path):
    proc = _sbatch(tmp_path, "configs/qwen3-8b.yaml", "/shared/runs/q8b", "data.path=/shared/data/q8b-regen",
                   "train.max_steps=100", **ALLOCATION)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[:3] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    launcher = words.index("torch.distributed.run")
    torchrun = get_args_parser().parse_args(words[launcher + 1:])
    assert (torchrun.nnodes, torchrun.nproc_per_node) == ("3", "8")
    assert torchrun.rdzv_backend == "c10d" and torchrun.rdzv_endpoint == "gpu-a17:20731"  # the allocation's first
    assert torchrun.rdzv_id == "dflash-731" and torchrun.max_restarts == 3
    assert torchrun.module and torchrun.training_script == "dflash_trainer"

    ours = parse_args(torchrun.training_script_args)
    assert ours.command == "train" and ours.config == "configs/qwen3-8b.yaml"
    config = load_config(str(ROOT / ours.config), ours.overrides)
    assert config.run.dir == "/shared/runs/q8b" and config.data.cache_dir == "/shared/runs/.tokenized"
    assert config.data.path == "/shared/data/q8b-regen" and config.train.max_steps == 100


def test_the_settings_come_from_the_environment(tmp_path):
    proc = _sbatch(tmp_path, "configs/qwen3-8b.yaml", "/shared/runs/q8b", **ALLOCATION, DFLASH_MAX_RESTARTS="0",
                   DFLASH_RDZV_PORT="29555", DFLASH_GPUS_PER_NODE="4", DFLASH_CACHE_DIR="/scratch/tok",
                   DFLASH_PYTHON="/opt/venv/bin/python")
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[3:6] == ["/opt/venv/bin/python", "-m", "torch.distributed.run"]
    torchrun = get_args_parser().parse_args(words[6:])
    assert torchrun.rdzv_endpoint == "gpu-a17:29555" and torchrun.nproc_per_node == "4"
    assert torchrun.max_restarts == 0
    assert "data.cache_dir=/scratch/tok" in torchrun.training_script_args


def test_misuse_is_named(tmp_path):
    usage = _sbatch(tmp_path, "configs/qwen3-8b.yaml", **ALLOCATION)
    assert usage.returncode == 2 and "usage: sbatch" in usage.stderr
    outside = _sbatch(tmp_path, "configs/qwen3-8b.yaml", "/shared/runs/q8b", DFLASH_DRY_RUN="1")
    assert outside.returncode != 0 and "not inside a SLURM allocation" in outside.stderr
