"""`dflash-train eval --drafter DIR [--out DIR]`: real acceptance length (tau) of a drafter: an export, or a training
checkpoint (`RUN/checkpoints/step_N`, its weights in a drafter of the run's settings).

Loads the target, its tokenizer and the drafter, checks they fit, runs speculative decoding on the
eval prompts (`eval.prompts`, default `RUN_DIR/plan/eval.jsonl`) with plain target decoding as the
baseline, prints the report and writes `--out DIR/eval.json`, or by default `RUN_DIR/eval-<drafter folder>.json`
(beside the training's own `eval.json`, never over it).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Optional

from dflash_trainer.commands.out_dir import check_replaces_only_ours, checked_out_dir
from dflash_trainer.config import Config
from dflash_trainer.data.tokenizer import load_tokenizer
from dflash_trainer.drafter.export import load_drafter
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.drafter_eval import (  # noqa: F401 (evaluate_drafter re-exported for the trainer)
    check_drafter_fits,
    eval_prompts_path,
    evaluate_drafter,
)
from dflash_trainer.eval.evaluate import format_report, load_prompt_messages
from dflash_trainer.regen.settings import warn_regen_mismatch
from dflash_trainer.rundir import RunDir, check_input_dir
from dflash_trainer.runtime.env import choose_device
from dflash_trainer.target.head import head_from_model
from dflash_trainer.target.load import load_target
from dflash_trainer.train.checkpoint_drafter import drafter_from_checkpoint, is_checkpoint

log = logging.getLogger(__name__)


def _out_file(config: Config, args: Optional[argparse.Namespace], drafter_dir: str) -> Path:
    """`--out DIR` outside a run dir: DIR/eval.json; else (no --out, or --out a run dir) that run dir's
    `eval-<drafter folder>.json`, beside the training's own eval.json (its step and held-out figures), never over it."""
    out = getattr(args, "out", None)
    if not out and not config.run.dir:
        raise ConfigError("nowhere to write eval.json: pass --out DIR or set run.dir")
    folder = checked_out_dir(out, flag="--out") if out else checked_out_dir(config.run.dir, flag="run.dir")
    run = RunDir(folder)
    if out and not (run.is_marked() or run.config.is_file()):  # not a run dir: no training evaluation to keep
        path = folder / "eval.json"
        check_replaces_only_ours("--out", out, [path.name] if path.exists() and not _ours(path) else [], "eval")
        return path
    return folder / f"eval-{Path(drafter_dir).resolve().name or 'drafter'}.json"


def _ours(path: Path) -> bool:
    """Whether `path` is an eval.json this command wrote (its figures), not another file of that name."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and {"tau", "acceptance_histogram", "per_prompt_committed"} <= set(found)


def run(config: Config, args: Optional[argparse.Namespace] = None) -> int:
    start = time.perf_counter()
    drafter_dir = getattr(args, "drafter", None)
    if not drafter_dir:
        raise ConfigError("dflash-train eval needs --drafter DIR: an export (RUN/export, RUN/best, `dflash-train "
                          "export`'s --out) or a training checkpoint (RUN/checkpoints/step_N)")
    path = _out_file(config, args, drafter_dir)
    check_input_dir("--drafter", drafter_dir)
    prompts_path = eval_prompts_path(config)
    messages = load_prompt_messages(prompts_path, config.eval.num_prompts)
    warn_regen_mismatch(config)

    device = choose_device(config.run.device, 0)
    target = load_target(config.target, device, seed=config.run.seed)
    if is_checkpoint(Path(drafter_dir)):  # a training checkpoint, in a drafter of the run's settings
        drafter, _ = drafter_from_checkpoint(config, Path(drafter_dir), flag="--drafter")
    else:
        drafter = load_drafter(drafter_dir)
    check_drafter_fits(drafter.spec, target, where=str(drafter_dir))
    # The drafter runs in the target's dtype, as an inference engine serves it.
    drafter = drafter.to(device=device, dtype=target.get_input_embeddings().weight.dtype).eval()
    tokenizer = load_tokenizer(config.target, config.data.chat_template)

    report = evaluate_drafter(config, target, tokenizer, drafter, messages, head=head_from_model(target),
                              progress=config.logging.progress)
    print(format_report(report))
    result = report.to_json() | {
        "drafter": str(drafter_dir),
        "max_new_tokens": config.eval.max_new_tokens,
        "prompts_path": str(prompts_path),
        "thinking": config.data.thinking,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}  [{time.perf_counter() - start:.1f}s]")
    return 0
