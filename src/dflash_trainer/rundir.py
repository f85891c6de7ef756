"""Choose and create the run directory, and record the resolved config in it."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

from dflash_trainer.config import Config, save_config
from dflash_trainer.errors import ConfigError
from dflash_trainer.layout import RunDir


def make_run_dir(config: Config) -> Path:
    """`run.dir`, or `runs/<run.name>-<YYYYmmdd-HHMMSS>` (a numeric suffix if taken). Creates it and writes
    `config.yaml` with `run.dir` filled in, so the saved config resumes in the same place."""
    if config.run.dir:
        path = Path(config.run.dir).expanduser()
    else:
        base = Path("runs") / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        path, n = base, 1
        while path.exists():
            path, n = base.with_name(f"{base.name}-{n}"), n + 1
    try:
        path.mkdir(parents=True, exist_ok=True)
        resolved = dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(path)))
        save_config(resolved, path)
    except OSError as e:
        raise ConfigError(f"cannot create or write the run directory {str(path)!r} ({e.strerror or e}); "
                          "set run.dir to a writable directory") from None
    return path


def claim_run_dir(config: Config) -> Path:
    """The run dir for `dflash-train train`: a fresh one, or one that holds only a plan (`dflash-train plan`);
    one that holds a training run only with `train.resume` (continue it) or `train.overwrite` (its outputs and
    epoch plans are deleted first). Refusing is the default: a second run would replace the checkpoints and
    append to the first run's metrics."""
    path = Path(config.run.dir).expanduser() if config.run.dir else None
    if path is not None and not config.train.resume:
        layout = RunDir(path)
        found = [p.name for p in layout.training_outputs() if p.exists()]
        if found and not config.train.overwrite:
            raise ConfigError(
                f"run.dir={str(path)!r} holds a training run ({', '.join(found)}): add --resume to continue it, set "
                "run.dir to a new directory, or pass --overwrite to replace it"
            )
        for name in found:
            target = path / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        if found:
            for plan in layout.plan.glob("epoch_*.json"):
                plan.unlink()
    path = make_run_dir(config)
    _check_writable(RunDir(path).checkpoints)  # now, not at the first checkpoint after hours of training
    return path


def _check_writable(folder: Path) -> None:
    probe = folder / f".write-test-{time.time_ns()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write checkpoints to {str(folder)!r} ({e.strerror or e}); make it writable or set "
                          "run.dir to a writable directory") from None
