"""Evaluate a DFlash drafter against its target: fit checks, prompt selection, and real tau.

`evaluate_drafter` is what both `dflash-train eval` (a drafter export, a freshly loaded target) and the
trainer (its live drafter, the colocated target object it already holds) call: it encodes the prompts with
the chat template the data was rendered with, then runs speculative decoding greedy (or at
`eval.temperature`) with plain target decoding as the baseline.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from torch import nn

from dflash_trainer.config import Config
from dflash_trainer.data.tokenizer import load_image_tokens
from dflash_trainer.data.vision import require_images
from dflash_trainer.drafter.fit import target_mismatches
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import DrafterSpec
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.evaluate import EvalReport, encode_prompts, evaluate_tau, has_image_parts
from dflash_trainer.eval.proposers import DFlashBatchProposer
from dflash_trainer.rundir import RunDir
from dflash_trainer.target.checks import check_target
from dflash_trainer.target.head import TargetHead
from dflash_trainer.target.load import find_decoder_layers, text_config
from dflash_trainer.target.stop_tokens import stop_token_ids

log = logging.getLogger(__name__)


def check_drafter_fits(spec: DrafterSpec, target: nn.Module, *, where: str) -> None:
    """The drafter can run on this target and was made for one like it: the same hidden size, vocabulary and
    depth (its taps were chosen for that depth), the mask id a row of the target's embedding, taps on existing
    layers other than the last. `where` names the drafter (an export directory) in the error, which gives both
    values: a drafter of another target would run and report a meaningless tau."""
    try:
        check_target(target, tap_layer_ids=spec.tap_layer_ids, drafter_hidden_size=spec.hidden_size,
                     mask_token_id=spec.mask_token_id)
    except ConfigError as e:
        raise ConfigError(f"drafter {where} does not fit the target: {e}") from None
    config = text_config(target.config)
    wrong = target_mismatches(spec, hidden_size=int(config.hidden_size), vocab_size=int(config.vocab_size),
                              num_layers=len(find_decoder_layers(target)))
    if wrong:
        raise ConfigError(
            f"drafter {where} was made for another target (this target's "
            f"{getattr(config, 'name_or_path', '') or 'model'} has {'; '.join(wrong)}): evaluate it with the target "
            "it was trained for (target.path, or --config RUN_DIR/config.yaml), or train a drafter for this target"
        )


def eval_prompts_path(config: Config) -> Path:
    """`eval.prompts`, else `RUN_DIR/plan/eval.jsonl` (written by `dflash-train plan`/`train`)."""
    if config.eval.prompts:
        return Path(config.eval.prompts)
    if config.run.dir:
        path = RunDir(config.run.dir).eval_conversations
        if path.is_file():
            return path
        where = f"{path} does not exist"
    else:
        where = "run.dir is not set"
    raise ConfigError(
        f"no eval prompts: eval.prompts is not set and {where}; set eval.prompts to a JSONL of "
        "{\"messages\": [...]} rows, or run.dir to a run directory made by `dflash-train plan`"
    )


def evaluate_drafter(
    config: Config,
    target: nn.Module,
    tokenizer,
    drafter: DFlashDrafter,
    prompts_messages: Sequence[list[dict]],
    *,
    head: TargetHead,
    progress: bool = False,
) -> EvalReport:
    """Real tau of `drafter` on `target` (any devices: the drafter runs where its weights are, the head is
    moved there) over `prompts_messages` (chat messages up to the last user turn), with the baseline.

    Prompts are rendered with `data.thinking` and keep their last `data.max_length - eval.max_new_tokens`
    tokens; generation stops at the tokenizer's eos / end-of-turn tokens or after `eval.max_new_tokens`.
    """
    ecfg = config.eval
    max_prompt_tokens = config.data.max_length - ecfg.max_new_tokens
    if max_prompt_tokens < 1:
        raise ConfigError(
            f"eval.max_new_tokens ({ecfg.max_new_tokens}) leaves no room for a prompt within data.max_length "
            f"({config.data.max_length}); lower eval.max_new_tokens"
        )
    spec = drafter.spec
    if spec.variant == "domino" and ecfg.temperature > 0:
        raise ConfigError("a Domino drafter drafts greedily (SGLang serves it so): evaluate it with eval.temperature=0")
    device = next(drafter.parameters()).device
    embed, lm_head = head.embed_weight.to(device), head.lm_head_weight.to(device)
    images = None
    if any(has_image_parts(m) for m in prompts_messages):  # an image-text target's prompts keep their images
        images = require_images(load_image_tokens(config.target, tokenizer))
    prompts, prompt_images = encode_prompts(tokenizer, prompts_messages, thinking=config.data.thinking,
                                            max_prompt_tokens=max_prompt_tokens, images=images)
    return evaluate_tau(
        target, lambda: DFlashBatchProposer(drafter, embed, lm_head, lattice_head=ecfg.lattice_head), prompts, block_size=spec.draft_length + 1,
        tap_layer_ids=spec.tap_layer_ids, max_new_tokens=ecfg.max_new_tokens,
        stop_token_ids=stop_token_ids(tokenizer, target), temperature=ecfg.temperature, seed=config.run.seed,
        with_baseline=True, with_prompt_lookup=ecfg.prompt_lookup, batch_size=ecfg.batch_size,
        pad_token_id=tokenizer.pad_token_id or 0, progress=progress, images=prompt_images,
    )
