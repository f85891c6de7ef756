"""`dflash-train export --checkpoint PATH --out DIR [--format dflash|speculators]`: a training checkpoint in an
inference format: DFlash (SGLang, the DFlash reference code; the default) or speculators (vLLM)."""

from __future__ import annotations

from pathlib import Path

from dflash_trainer.commands.out_dir import checked_out_dir
from dflash_trainer.config import Config
from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import check_input_dir


def run(config: Config, args) -> int:
    import torch

    from dflash_trainer.data.tokenizer import load_tokenizer
    from dflash_trainer.drafter.export import export_drafter
    from dflash_trainer.drafter.export_speculators import export_speculators, verifier_reference
    from dflash_trainer.drafter.model import DFlashDrafter
    from dflash_trainer.drafter.spec import drafter_spec, first_spare_row
    from dflash_trainer.target.load import target_model_config
    from dflash_trainer.train.checkpoint import COMPLETE, checkpoint_problem
    from dflash_trainer.train.ema import PREFIX as EMA_PREFIX
    from dflash_trainer.train.ema import split_averaged

    if not args.checkpoint or not args.out:
        raise ConfigError("export needs --checkpoint CHECKPOINT_DIR and --out DIR")
    out_dir = checked_out_dir(args.out)
    check_input_dir("--checkpoint", args.checkpoint)
    ckpt = Path(args.checkpoint)
    if not (ckpt / COMPLETE).is_file() or not (ckpt / "drafter.safetensors").is_file():
        raise ConfigError(f"--checkpoint {ckpt} is not a complete training checkpoint (checkpoints/step_N)")
    verifier = None  # the speculators format records the target to serve with; resolved before the work
    if getattr(args, "format", "dflash") == "speculators":
        verifier = verifier_reference(getattr(args, "verifier", None), config.target)
    elif getattr(args, "verifier", None):
        raise ConfigError("--verifier is for --format speculators (the DFlash format does not record the target)")
    problem = checkpoint_problem(ckpt)
    if problem is not None:
        raise ConfigError(f"--checkpoint {ckpt} is damaged: {problem}; export another checkpoint")
    target_config = target_model_config(config.target)
    mask = None if config.drafter.mask_token_id is not None else first_spare_row(
        load_tokenizer(config.target, config.data.chat_template))
    spec = drafter_spec(target_config, config.drafter, mask_token_id=mask)
    model = DFlashDrafter(spec, attention="sdpa")
    weights, averaged = split_averaged(_read_weights(ckpt))
    if averaged:  # the run evaluated and exported its weight average (train.ema_decay): so does this export
        weights = weights | {k[len(EMA_PREFIX):]: v for k, v in averaged.items()}
        print(f"exporting the weight average (train.ema_decay) that {ckpt} holds")
    own = model.state_dict()
    bad = sorted(set(own) ^ set(weights)) + [k for k in own if k in weights and own[k].shape != weights[k].shape]
    if bad:
        raise ConfigError(
            f"checkpoint {ckpt} does not fit the drafter of this config ({bad[:4]}): pass the --config the "
            "run was trained with (RUN_DIR/config.yaml)"
        )
    model.load_state_dict(weights)
    model.to(getattr(torch, config.target.dtype))
    if verifier is not None:
        target_folder = config.target.path and Path(config.target.path).expanduser().resolve()
        is_target = not getattr(args, "verifier", None) or Path(verifier) == target_folder
        out = export_speculators(model, out_dir, verifier=verifier, target_config=target_config,
                                 verifier_is_target=is_target)
    else:
        out = export_drafter(model, out_dir, target_config=target_config)
    print(f"exported {ckpt} -> {out} (config.json, model.safetensors)")
    return 0


def _read_weights(ckpt: Path) -> dict:
    """The checkpoint's drafter weights; a file that safetensors cannot read (cut short under a marker that records
    no checksums) is named, with the finished checkpoints beside it (not checksummed here: gigabytes each)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dflash_trainer.train.checkpoint import COMPLETE

    path = ckpt / "drafter.safetensors"
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        def step(p: Path) -> tuple[int, str]:
            digits = "".join(c for c in p.name if c.isdigit())
            return (int(digits) if digits else -1, p.name)

        siblings = sorted((p for p in ckpt.parent.iterdir() if p != ckpt and (p / COMPLETE).is_file()), key=step)
        others = ", ".join(str(p) for p in siblings) or "none beside it"
        raise ConfigError(f"--checkpoint {ckpt}: its weights file {path} cannot be read ({e}): it is damaged (cut "
                          f"short?); export another checkpoint instead ({others})") from None
