"""`dflash-train export --checkpoint PATH --out DIR [--format dflash|speculators]`: a training checkpoint in an
inference format: DFlash (SGLang, the DFlash reference code; the default) or speculators (vLLM)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Optional

from dflash_trainer.commands.export_dirs import check_export_dirs, staged
from dflash_trainer.commands.out_dir import checked_out_dir
from dflash_trainer.commands.serve_command import export_dtype, serve_lines
from dflash_trainer.config import Config
from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import check_input_dir


def run(config: Config, args) -> int:
    from dflash_trainer.drafter.export import export_drafter
    from dflash_trainer.drafter.export_speculators import export_speculators, local_verifier, verifier_reference
    from dflash_trainer.target.load import target_model_config
    from dflash_trainer.train.checkpoint_drafter import drafter_from_checkpoint, is_checkpoint

    if not args.checkpoint or not args.out:
        raise ConfigError("export needs --checkpoint CHECKPOINT_DIR and --out DIR")
    fmt = getattr(args, "format", "dflash")
    given, save_target = getattr(args, "verifier", None), getattr(args, "save_target", None)
    if save_target and given:
        raise ConfigError("pass --verifier or --save-target, not both (--save-target records the folder it writes)")
    if fmt != "speculators" and given:
        raise ConfigError(f"--verifier {given} does nothing in --format {fmt}, which records no target: add --format "
                          "speculators to record it, or drop --verifier (--save-target DIR writes a target to serve "
                          "the drafter with)")
    out_dir = checked_out_dir(args.out)
    save_dir = checked_out_dir(save_target, flag="--save-target") if save_target else None
    check_export_dirs(out_dir, save_dir)
    check_input_dir("--checkpoint", args.checkpoint)
    ckpt = Path(args.checkpoint)
    if not is_checkpoint(ckpt):
        raise ConfigError(f"--checkpoint {ckpt} is not a complete training checkpoint (checkpoints/step_N)")
    verifier = None  # the speculators format records the target to serve with; resolved before the work
    if fmt == "speculators":
        verifier = local_verifier(save_dir, f"--save-target {save_target}") if save_dir else \
            verifier_reference(given, config.target)
    model, averaged = drafter_from_checkpoint(config, ckpt, flag="--checkpoint")
    if averaged:
        print(f"exporting the weight average (train.ema_decay) that {ckpt} holds")
    target_config = target_model_config(config.target)
    # Everything is written into staging folders and moved into place at the end: a refused drafter (checked
    # before its files are written) leaves neither --out nor --save-target touched.
    with staged(out_dir, "drafter") as out_stage, \
            (staged(save_dir, "target") if save_dir else nullcontext()) as target_stage:
        if verifier is not None:
            target_folder = config.target.path and Path(config.target.path).expanduser().resolve()
            is_target = save_dir is not None or not given or Path(verifier) == target_folder
            export_speculators(model, out_stage, verifier=verifier, target_config=target_config,
                               verifier_is_target=is_target)
        else:
            export_drafter(model, out_stage, target_config=target_config)
        if save_dir is not None:
            _saved_target(config, target_stage)
    if save_dir is not None:
        what = "the verifier this export records" if fmt == "speculators" else "the target to serve it with"
        print(f"saved the target to {save_dir} ({what})")
    print(f"exported {ckpt} -> {out_dir} (config.json, model.safetensors)")
    target = str(save_dir) if save_dir is not None else _served_target(config)
    for line in serve_lines(variant=model.spec.variant, draft_length=model.spec.draft_length, export_dir=out_dir,
                            fmt=fmt, target=target, verifier=verifier,
                            verifier_is_hub=verifier is not None and not Path(verifier).is_dir(),
                            dtype=export_dtype(out_dir)):
        print(line)
    return 0


def _served_target(config: Config) -> Optional[str]:
    """The model to serve a DFlash-format export with: the config's target folder (absolute) or hub id; None for a
    random target (no folder)."""
    if not config.target.path:
        return None
    path = Path(config.target.path).expanduser()
    return str(path.resolve()) if path.is_dir() else config.target.path


def _saved_target(config: Config, folder: Path) -> Path:
    """This config's target (its weights, config and tokenizer) saved to `folder`, a verifier that fits the drafter
    exactly (a random-init target, such as the demo's, has no hub id to name)."""
    from dflash_trainer.data.tokenizer import load_tokenizer
    from dflash_trainer.target.load import load_target

    target = load_target(config.target, "cpu", seed=config.run.seed)
    target.save_pretrained(folder)
    load_tokenizer(config.target, config.data.chat_template).save_pretrained(folder)
    return folder
