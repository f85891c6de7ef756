"""Choose and create the run directory, and record the resolved config in it."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from dflash_trainer.config import Config, save_config
from dflash_trainer.errors import ConfigError


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
