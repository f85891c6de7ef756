"""`dflash-train train`: one process (colocated) or every rank under torchrun."""

from __future__ import annotations

from dflash_trainer.config import Config


def run(config: Config, args) -> int:
    from dflash_trainer.runtime.launch import run_training

    return run_training(config, resume_changes=getattr(args, "resume_changes", ()))
