"""A training checkpoint's drafter as a model, built from the run's config: what `export --checkpoint` writes out and
what `eval --drafter RUN/checkpoints/step_N` evaluates."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_trainer.config import Config
from dflash_trainer.data.tokenizer import load_tokenizer
from dflash_trainer.drafter.finite import check_finite
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import drafter_spec, first_spare_row
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.load import target_model_config
from dflash_trainer.train.checkpoint import COMPLETE, checkpoint_problem
from dflash_trainer.train.ema import PREFIX as EMA_PREFIX
from dflash_trainer.train.ema import split_averaged

WEIGHTS = "drafter.safetensors"


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is a finished training checkpoint (`RUN/checkpoints/step_N`), not an export."""
    return (Path(path) / COMPLETE).is_file()


def drafter_from_checkpoint(config: Config, ckpt: Path, *, flag: str) -> tuple[DFlashDrafter, bool]:
    """(the drafter, whether it is the run's weight average): the checkpoint's weights in a drafter of `config`'s
    settings, in the target's dtype. `flag` names the argument in errors (`--checkpoint`, `--drafter`)."""
    ckpt = Path(ckpt)
    if not is_checkpoint(ckpt) or not (ckpt / WEIGHTS).is_file():
        raise ConfigError(f"{flag} {ckpt} is not a complete training checkpoint (checkpoints/step_N)")
    problem = checkpoint_problem(ckpt)
    if problem is not None:
        raise ConfigError(f"{flag} {ckpt} is damaged: {problem}; use another checkpoint")
    target_config = target_model_config(config.target)
    mask = None if config.drafter.mask_token_id is not None else first_spare_row(
        load_tokenizer(config.target, config.data.chat_template))
    model = DFlashDrafter(drafter_spec(target_config, config.drafter, mask_token_id=mask), attention="sdpa")
    weights, averaged = split_averaged(_read_weights(ckpt, flag))
    if averaged:  # the run evaluated and exported its weight average (train.ema_decay): so does this
        weights = weights | {k[len(EMA_PREFIX):]: v for k, v in averaged.items()}
    own = model.state_dict()
    bad = sorted(set(own) ^ set(weights)) + [k for k in own if k in weights and own[k].shape != weights[k].shape]
    if bad:
        raise ConfigError(
            f"checkpoint {ckpt} does not fit the drafter of this config ({bad[:4]}): pass the --config the "
            "run was trained with (RUN_DIR/config.yaml)"
        )
    model.load_state_dict(weights)
    return model.to(getattr(torch, config.target.dtype)), bool(averaged)


def _read_weights(ckpt: Path, flag: str) -> dict:
    """The checkpoint's drafter weights; a file that safetensors cannot read (cut short under a marker that records
    no checksums) is named, with the finished checkpoints beside it (not checksummed here: gigabytes each)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = ckpt / WEIGHTS
    try:
        weights = load_file(str(path))
        check_finite(weights, path, fix="use another checkpoint")
        return weights
    except (SafetensorError, OSError) as e:
        def step(p: Path) -> tuple[int, str]:
            digits = "".join(c for c in p.name if c.isdigit())
            return (int(digits) if digits else -1, p.name)

        siblings = sorted((p for p in ckpt.parent.iterdir() if p != ckpt and is_checkpoint(p)), key=step)
        others = ", ".join(str(p) for p in siblings) or "none beside it"
        raise ConfigError(f"{flag} {ckpt}: its weights file {path} cannot be read ({e}): it is damaged (cut "
                          f"short?); use another checkpoint instead ({others})") from None
