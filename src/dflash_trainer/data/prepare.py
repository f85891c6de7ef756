"""From the config to the training set: load + mix sources, hold out the eval slice, tokenize (cached).

`prepare_data(config, run_dir)` is what `dflash-train plan` and the trainer call; then
`build_epoch_plan(prepared.train.lengths, ...)` (data/plan.py) makes each epoch's jobs.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from transformers import PreTrainedTokenizerFast

from dflash_trainer.config import Config
from dflash_trainer.data import images as images_module
from dflash_trainer.data import masks, rules, sources, stored_images, tokenize_pool, vision
from dflash_trainer.data.images import changed_image_files
from dflash_trainer.data.plan import EpochPlan, check_lengths_fit, hold_out, write_eval_conversations
from dflash_trainer.data.sources import load_conversations
from dflash_trainer.data.tokenize_pool import IMAGES_ON_TEXT_TARGET, default_num_workers
from dflash_trainer.data.tokenized import (
    TokenizedDataset,
    cache_entry_id,
    cache_key,
    cache_lock,
    cache_root,
    code_fingerprint,
    key_parts,
    load_cache,
    save_cache,
    tokenize_all,
)
from dflash_trainer.data.types import Conversation
from dflash_trainer.data.vision import ImageTokens, UnsupportedImages
from dflash_trainer.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSummary:
    """Counts over the prepared data. conversations_total = kept + eval + sum(dropped)."""

    conversations_total: int
    """Rows read from the sources (rows after a conversation limit are not read)."""
    conversations_kept: int
    """Training sequences."""
    eval_conversations: int
    dropped: dict[str, int]
    """Rows not trained on, by reason (load time, mix and tokenization together)."""
    truncated: int
    """Training sequences cut at data.max_length."""
    truncated_tokens: int
    """Tokens those cuts left out (not trained on)."""
    tokens: int
    supervised_tokens: int
    sources: tuple[str, ...]
    cache_path: str
    cache_hit: bool
    content_sha256: str
    """`TokenizedDataset.content_sha256` of the training set (resume checks it)."""


HELD_OUT_WARN_SHARE = 0.2
"""A held-out share of the data above this is warned about: it is data the drafter never trains on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedData:
    train: TokenizedDataset
    """The training set; `train[sequence_id]` is a TokenizedSequence (the ids jobs refer to)."""
    eval_conversations: tuple[Conversation, ...]
    """Held out before planning; never in any job. Also in `RUN_DIR/plan/eval.jsonl`."""
    summary: DataSummary


def drop_duplicates(conversations: Sequence[Conversation]) -> list[Conversation]:
    """The conversations without exact repeats (same messages, whichever source or row), first kept."""
    seen: set[tuple] = set()
    kept = []
    for c in conversations:
        if c.messages not in seen:
            seen.add(c.messages)
            kept.append(c)
    return kept


def _build(config: Config, tokenizer: PreTrainedTokenizerFast, images: Optional[ImageTokens],
           refused: Optional[UnsupportedImages] = None) -> tuple[TokenizedDataset, dict[str, Any]]:
    """`refused`: an image-text target whose images cannot be made into tokens: data with images is refused."""
    data = config.data
    loaded = load_conversations(data, seed=config.run.seed, images=True)
    unique = drop_duplicates(loaded.conversations)  # before holding out: a copy would leak into the eval slice
    if refused is not None and any(c.has_images for c in unique):  # never trained on their text alone
        raise ConfigError(f"{sum(c.has_images for c in unique)} conversations have images: {refused.reason}")
    # an image-text target evaluates image prompts with their images; a text target's image conversations are never
    # held out (tokenizing drops them, counted, below)
    with_images = [] if images is not None else [c for c in unique if c.has_images]
    split = hold_out([c for c in unique if images is not None or not c.has_images], data.num_eval_conversations,
                     seed=config.run.seed)
    train, held = split.train + with_images, split.eval
    if images is not None and any(c.has_images for c in unique):
        log.info("%d conversations with images train with them; %d are held out for eval (tau on their prompts, "
                 "with the images)", sum(c.has_images for c in train), sum(c.has_images for c in held))
    outcome = tokenize_all(train, tokenizer, thinking=data.thinking, max_length=data.max_length,
                           min_supervised=2 * config.drafter.block_size,
                           num_workers=data.num_workers or default_num_workers(),
                           escape_special_tokens=data.escape_special_tokens, images=images)
    if outcome.dropped.get(IMAGES_ON_TEXT_TARGET):
        log.warning("dropped %d conversations with images: the target (%s) is not an image-text model with an image "
                    "processor. Train an image-text target (e.g. Qwen3-VL; target.tokenizer names its processor), "
                    "or remove the image parts to train on the text", outcome.dropped[IMAGES_ON_TEXT_TARGET],
                    config.target.path or config.target.random_init)
    meta = {  # every cache this code can read has it: the cache key hashes this package's data code
        "content_sha256": outcome.dataset.content_sha256(),
        "conversations_total": loaded.report.records_read,
        "layout_problem": loaded.report.layout_problem,
        "dropped": dict(Counter(loaded.report.dropped) + Counter(outcome.dropped)
                        + Counter(duplicate=len(loaded.conversations) - len(unique),
                                  held_out_prompt_sibling=split.siblings_dropped)),
        "eval": [c.to_json() for c in held],
        "train_conversations": len(train),
        "truncated": outcome.truncated,
        "truncated_tokens": outcome.truncated_tokens,
    }
    image_files = sorted({(i.url, i.sha256) for c in train for m in c.messages for i in m.images if i.sha256})
    if image_files:  # the sources' digests cover data URLs, not image files: a cache hit checks these again
        meta["image_files"] = [list(f) for f in image_files]
    return outcome.dataset, meta


def _unless_images_changed(cached: Optional[tuple[TokenizedDataset, dict[str, Any]]],
                           path) -> Optional[tuple[TokenizedDataset, dict[str, Any]]]:
    """`cached`, or None (rebuilt) when an image file it was made from changed since."""
    if cached is None or not cached[1].get("image_files"):
        return cached
    changed = changed_image_files([tuple(f) for f in cached[1]["image_files"]])
    if changed is None:
        return cached
    log.warning("image %s changed since the tokenized cache %s was made: tokenizing again", changed, path)
    return None


def prepare_data(config: Config, run_dir: str | os.PathLike, *,
                 tokenizer: Optional[PreTrainedTokenizerFast] = None, write_files: bool = True) -> PreparedData:
    """Tokenized training set (from the cache when nothing changed) and the eval slice, written to the run dir."""
    check_lengths_fit(config.data.max_length, config.pipeline.token_budget)
    from dflash_trainer.data.tokenizer import load_image_tokens, load_tokenizer

    if tokenizer is None:
        tokenizer = load_tokenizer(config.target, config.data.chat_template)
    images = load_image_tokens(config.target, tokenizer)
    if isinstance(images, UnsupportedImages):  # the data's image rows are refused when read (`_build`)
        refused, images = images, None
    else:
        refused = None
    parts = key_parts(config.data, seed=config.run.seed, block_size=config.drafter.block_size, tokenizer=tokenizer,
                      images=images)
    code = code_fingerprint([__file__, masks.__file__, rules.__file__, sources.__file__, tokenize_pool.__file__,
                             vision.__file__, images_module.__file__, stored_images.__file__])
    path = cache_root(config.data.cache_dir) / cache_key(parts, code)
    cached = _unless_images_changed(load_cache(path, images), path)  # renamed into place whole: no lock needed
    built = None
    if cached is None:
        seen = cache_entry_id(path)
        with cache_lock(path):  # a process preparing the same data at once waits, then reads the cache
            # what that process wrote (a damaged entry left as it was is not read, nor warned about, twice)
            cached = _unless_images_changed(load_cache(path, images), path) if cache_entry_id(path) != seen else None
            if cached is None:
                built = _build(config, tokenizer, images, refused)
                if len(built[0]):
                    try:
                        save_cache(path, *built)
                    except OSError as e:
                        log.warning("cannot write the tokenized cache %s (%s); set data.cache_dir to a writable "
                                    "dir", path, e)
    if cached is not None:
        log.info("tokenized data from cache %s", path)
    dataset, meta = cached or built
    source_names = [s.path for s in config.data.resolved_sources()]
    held_out, n_eval = len(meta["eval"]), config.data.num_eval_conversations
    if len(dataset) == 0 and held_out and meta.get("train_conversations") == 0:
        raise DataError(
            f"no conversation left to train on in {source_names}: data.num_eval_conversations={n_eval} held out all "
            f"{held_out} of them for evaluation. Lower it (data.num_eval_conversations={max(1, held_out // 5)} keeps "
            f"most for training) or give more data"
        )
    if len(dataset) == 0 and meta.get("layout_problem"):
        raise DataError(f"no trainable sequence: {meta['layout_problem']} (dropped: {meta['dropped']})")
    if len(dataset) == 0:
        held = (f"; {held_out} more are held out for evaluation (data.num_eval_conversations={n_eval}): lower it if "
                "those are the ones that would train") if held_out else ""
        raise DataError(
            f"no trainable sequence in {source_names} (dropped: {meta['dropped']}). Check data.path and the format, "
            f"or allow more: each sequence needs >= 2 * drafter.block_size = {2 * config.drafter.block_size} "
            f"supervised tokens within data.max_length = {config.data.max_length}{held}"
        )
    if meta["truncated"]:
        log.warning("%d conversations were cut at data.max_length=%d (%d tokens left out, not trained on); raise "
                    "data.max_length (and pipeline.token_budget) to keep them", meta["truncated"],
                    config.data.max_length, meta["truncated_tokens"])
    held = tuple(Conversation.from_json(r) for r in meta["eval"])
    if write_files and len(held) > HELD_OUT_WARN_SHARE * (len(held) + len(dataset)):  # once: the writing rank
        log.warning("%d of %d usable conversations (%.0f%%) are held out for evaluation (data.num_eval_conversations="
                    "%d), leaving %d to train on: lower data.num_eval_conversations, or give more data", len(held),
                    len(held) + len(dataset), 100 * len(held) / (len(held) + len(dataset)),
                    config.data.num_eval_conversations, len(dataset))
    if write_files:  # one rank writes; the others read the same cache
        write_eval_conversations(run_dir, held)
    summary = DataSummary(
        conversations_total=meta["conversations_total"], conversations_kept=len(dataset),
        eval_conversations=len(held), dropped=dict(meta["dropped"]), truncated=meta["truncated"],
        truncated_tokens=meta["truncated_tokens"], tokens=dataset.num_tokens,
        supervised_tokens=dataset.num_supervised, sources=tuple(source_names), cache_path=str(path),
        cache_hit=cached is not None, content_sha256=meta["content_sha256"],
    )
    return PreparedData(train=dataset, eval_conversations=held, summary=summary)


def summary_json(summary: DataSummary, plan: EpochPlan) -> dict[str, Any]:
    """The content of `plan/summary.json`: the data counts plus the plan of `plan.epoch`."""
    return {
        **asdict(summary),
        "sources": list(summary.sources),
        "epoch": plan.epoch,
        "jobs": len(plan.jobs),
        "padding_waste": plan.padding_waste,
        "token_budget": plan.token_budget,
        "max_seqs": plan.max_seqs,
        "buckets": [asdict(b) for b in plan.buckets],
    }
