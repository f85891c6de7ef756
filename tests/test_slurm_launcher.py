"""`scripts/slurm/train.sbatch` in dry-run mode, inside a pretend SLURM allocation (its variables and a `scontrol` that
lists the nodes): the command every node would run parses as torchrun's and as ours, and its config loads."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from dflash_trainer.cli import parse_args
from dflash_trainer.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"


def _sbatch(tmp_path: Path, *args: str, slurm: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run the script; `slurm`: with a `scontrol` on PATH that lists the pretend allocation's nodes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if slurm:
        scontrol = bin_dir / "scontrol"
        scontrol.write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && printf 'gpu-a17\\ngpu-a18\\ngpu-b02\\n'\n")
        scontrol.chmod(0o755)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DFLASH_"))}
    full_env.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **env)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full_env, timeout=30,
                          cwd=ROOT)


ALLOCATION = dict(SLURM_JOB_ID="731", SLURM_JOB_NODELIST="gpu-a[17-18],gpu-b02", SLURM_NNODES="3",
                  SLURM_GPUS_ON_NODE="8", DFLASH_DRY_RUN="1", DFLASH_PYTHON=sys.executable)


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
                   DFLASH_RDZV_PORT="29555", DFLASH_GPUS_PER_NODE="4", DFLASH_CACHE_DIR="/scratch/tok")
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    assert words[3:6] == [sys.executable, "-m", "torch.distributed.run"]
    torchrun = get_args_parser().parse_args(words[6:])
    assert torchrun.rdzv_endpoint == "gpu-a17:29555" and torchrun.nproc_per_node == "4"
    assert torchrun.max_restarts == 0
    assert "data.cache_dir=/scratch/tok" in torchrun.training_script_args


def test_misuse_is_named(tmp_path):
    usage = _sbatch(tmp_path, "configs/qwen3-8b.yaml", **ALLOCATION)
    assert usage.returncode == 2 and "usage: sbatch" in usage.stderr
    outside = _sbatch(tmp_path, "configs/qwen3-8b.yaml", "/shared/runs/q8b", DFLASH_DRY_RUN="0")
    assert outside.returncode != 0 and "not inside a SLURM allocation" in outside.stderr


@pytest.mark.parametrize("name, value, named", [
    ("DFLASH_DRY_RUN", "ture", "neither true"),
    ("SLURM_NNODES", "0", "SLURM_NNODES=0 must be a whole number >= 1"),
    ("DFLASH_GPUS_PER_NODE", "eight", "DFLASH_GPUS_PER_NODE=eight must be a whole number >= 1"),
    ("DFLASH_GPUS_PER_NODE", "0", "DFLASH_GPUS_PER_NODE=0"),
    ("DFLASH_MAX_RESTARTS", "-1", "DFLASH_MAX_RESTARTS=-1"),
    ("DFLASH_RDZV_PORT", "70000", "<= 65535"),
    ("DFLASH_PYTHON", "/nonexistent/python", "does not import dflash_trainer"),
])
def test_a_bad_setting_stops_everything_with_one_line_naming_it(tmp_path, name, value, named):
    """Every setting is checked before anything runs: a typo never launches, nor prints a command that cannot work."""
    for dry in ("1", "0"):  # a launch too: srun is not on PATH here, so reaching it would fail differently
        proc = _sbatch(tmp_path, "configs/qwen3-8b.yaml", "/shared/runs/q8b", **{**ALLOCATION, "DFLASH_DRY_RUN": dry,
                                                                                 name: value})
        assert proc.returncode == 2 and proc.stdout == "", (dry, proc.stdout)
        assert named in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.parametrize("value", ["true", "TRUE", "yes", "on", "1"])
def test_any_true_looking_dry_run_value_only_prints(tmp_path, value):
    proc = _sbatch(tmp_path, "configs/qwen3-8b.yaml", "/shared/runs/q8b", **{**ALLOCATION, "DFLASH_DRY_RUN": value})
    assert proc.returncode == 0 and shlex.split(proc.stdout)[0] == "srun", proc.stderr


def test_a_dry_run_works_without_slurm(tmp_path):
    """No allocation and no `scontrol`: the dry run shows one node meeting on this host, or the nodes asked for."""
    proc = _sbatch(tmp_path, "configs/qwen3-8b.yaml", "/shared/runs/q8b", DFLASH_DRY_RUN="true", SLURM_NNODES="2",
                   DFLASH_RDZV_HOST="node0", DFLASH_PYTHON=sys.executable, slurm=False)
    assert proc.returncode == 0, proc.stderr
    words = shlex.split(proc.stdout)
    torchrun = get_args_parser().parse_args(words[words.index("torch.distributed.run") + 1:])
    assert torchrun.nnodes == "2" and torchrun.rdzv_endpoint == "node0:29500" and torchrun.rdzv_id == "dflash-dry-run"
    assert "scontrol" not in proc.stderr
    launch = _sbatch(tmp_path, "configs/qwen3-8b.yaml", "/shared/runs/q8b", SLURM_JOB_ID="9", DFLASH_DRY_RUN="1",
                     SLURM_JOB_NODELIST="gpu-a[1-2]", slurm=False)
    assert launch.returncode == 2 and "scontrol is not on PATH" in launch.stderr and "DFLASH_RDZV_HOST" in launch.stderr


@pytest.mark.parametrize("args, named", [
    (["configs/qwen3-8bb.yaml", "/shared/runs/q8b"], "configs/qwen3-8bb.yaml"),
    (["configs/qwen3-8b.yaml", "/shared/runs/q8b", "train.lrr=1"], "train.lrr"),
    (["configs/qwen3-8b.yaml", "/shared/runs/q8b", "train.lr"], "train.lr"),
    (["configs/qwen3-8b.yaml", "/shared/runs/q8b", "drafter.noise_std=0.1"], "drafter.noise_std"),
])
def test_a_config_mistake_stops_before_anything_runs(tmp_path, args, named):
    """CONFIG and the overrides are loaded before the launch: a typo is one line here, not a failure on every node of
    an allocation."""
    marker = tmp_path / "launched"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    for dry in ("1", "0"):
        proc = _sbatch(tmp_path, *args, **{**ALLOCATION, "DFLASH_DRY_RUN": dry})
        assert proc.returncode == 2 and proc.stdout == "" and not marker.exists(), (dry, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("train.sbatch: ") and named in lines[0], proc.stderr
    proc = _sbatch(tmp_path, "configs/qwen3-8b.yaml", "/shared/runs/q8b", **{**ALLOCATION, "DFLASH_DRY_RUN": "0"})
    assert proc.returncode == 0 and marker.exists(), proc.stderr  # a good config launches
