"""`dflash-train regenerate --out DIR`: answer the data's prompts again with the target.

Train on the result with `data.path=DIR`. Rerun the same command to resume after a crash or Ctrl-C. The command
fails (exit 2) when it wrote no row, or when rows are missing (failed on a server fault): the rows written are
kept, and the message names what failed, per kind, and how to finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections import Counter
from typing import Any

from dflash_trainer.commands.out_dir import checked_out_dir
from dflash_trainer.config import Config
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.regen.failures import Failures, what_to_do
from dflash_trainer.regen.runner import Backend, RegenSummary, regenerate
from dflash_trainer.regen.settings import settings_from_config
from dflash_trainer.regen.turns import limit_turns

log = logging.getLogger(__name__)

LONG_REPLY_TOKENS = 16384
"""From this `regenerate.max_new_tokens` on, the local backend is told to be slow: it decodes with a plain KV
cache, one token per row and step, where a serving engine batches continuously and pages its cache."""


def build_backend(config: Config) -> Backend:
    """The backend named by `regenerate.backend`, ready to run (server checked / target loaded)."""
    regen = config.regenerate
    settings = settings_from_config(config)
    if regen.backend == "openai":
        from dflash_trainer.regen.openai import OpenAIBackend

        if not regen.url:
            raise ConfigError("regenerate.backend=openai needs regenerate.url, e.g. http://127.0.0.1:8000/v1")
        backend = OpenAIBackend(
            url=regen.url,
            model=settings.model,
            max_new_tokens=regen.max_new_tokens,
            temperature=regen.temperature,
            top_p=regen.top_p,
            seed=settings.seed,
            thinking=regen.thinking,
            concurrency=regen.concurrency,
            request_timeout_s=regen.request_timeout_s,
            max_retries=regen.max_retries,
            retry_backoff_s=regen.retry_backoff_s,
        )
        backend.check_model()
        return backend
    if regen.max_new_tokens >= LONG_REPLY_TOKENS:
        log.warning(
            "regenerate.max_new_tokens=%d with the local backend: it is slow for replies this long (a plain KV "
            "cache, no continuous batching). Serve the target with vLLM or SGLang and set regenerate.backend=openai "
            "regenerate.url=http://HOST:PORT/v1 (docs/data.md, \"Regenerating the answers\")", regen.max_new_tokens)
    import torch

    from dflash_trainer.data.tokenizer import load_tokenizer
    from dflash_trainer.regen.local import LocalBackend
    from dflash_trainer.target.load import load_target

    device = config.run.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = load_tokenizer(config.target, config.data.chat_template)
    return LocalBackend(
        model=load_target(config.target, device, seed=config.run.seed),
        tokenizer=tokenizer,
        images=image_processing(config, tokenizer),
        max_new_tokens=regen.max_new_tokens,
        temperature=regen.temperature,
        thinking=regen.thinking,
        batch_size=regen.batch_size,
        seed=settings.seed,
        max_prompt_tokens=regen.max_prompt_tokens,
        top_p=regen.top_p,
    )


def image_processing(config: Config, tokenizer):
    """The target's image processing (`data/vision.py`), or None for a text target and for an image-text one whose
    images cannot be made into tokens here (its image rows are then not answered)."""
    from dflash_trainer.data.tokenizer import load_image_tokens
    from dflash_trainer.data.vision import ImageTokens

    images = load_image_tokens(config.target, tokenizer)
    return images if isinstance(images, ImageTokens) else None


def _answers_images(config: Config) -> bool:
    """Whether the backend answers prompts with their images: the openai backend (it sends them to the server, which
    refuses them if its model takes none) or the local backend of an image-text target (one with an image processor
    whose images are made into tokens here), unless `regenerate.drop_images`. Otherwise rows with images are dropped
    when read, counted (`images_not_read`)."""
    if config.regenerate.drop_images:
        return False
    if config.regenerate.backend == "openai":
        return True
    from dflash_trainer.data.tokenizer import load_tokenizer

    return image_processing(config, load_tokenizer(config.target, config.data.chat_template)) is not None


def _source_info(config: Config, conversations: list, report: Any) -> dict[str, Any]:
    per_source = Counter(c.source for c in conversations)
    return {
        "data": [s.path for s in config.data.resolved_sources()],
        "max_conversations": config.data.max_conversations,
        "conversations": dict(per_source),
        "num_samples": config.regenerate.num_samples,
        "report": dataclasses.asdict(report) if dataclasses.is_dataclass(report) else report,  # a LoadReport
    }


def run(config: Config, args: argparse.Namespace) -> int:
    out = getattr(args, "out", None)
    if not out:
        raise ConfigError("dflash-train regenerate needs --out DIR (the new dataset; train on it with data.path=DIR)")
    checked_out_dir(out)
    settings = settings_from_config(config)  # fails early on a missing model name
    from dflash_trainer.data.rules import REGENERATE
    from dflash_trainer.data.sources import load_conversations

    loaded = load_conversations(config.data, seed=config.run.seed, purpose=REGENERATE, images=_answers_images(config))
    conversations = [limit_turns(c, config.regenerate.max_turns) for c in loaded.conversations]
    report = loaded.report
    if config.data.max_conversations is not None:
        conversations = conversations[: config.data.max_conversations]
    if not conversations:
        raise DataError(f"no conversations to regenerate in {[s.path for s in config.data.resolved_sources()]} "
                        f"(dropped: {report.dropped}): check data.path / data.sources")
    if config.regenerate.thinking != config.data.thinking:
        log.warning(
            "regenerate.thinking=%s but data.thinking=%s: training renders the replies with data.thinking; "
            "set both to how the target will be served",
            config.regenerate.thinking,
            config.data.thinking,
        )
    backend = build_backend(config)
    try:
        summary = regenerate(
            conversations,
            backend=backend,
            out_dir=out,
            settings=settings,
            shard_rows=config.regenerate.shard_rows,
            source=_source_info(config, conversations, report),
            progress=config.logging.progress,
        )
    except KeyboardInterrupt:
        print(f"regenerate: interrupted; the rows written are kept in {out}. Rerun the same command to resume.")
        return 130
    print(_report(summary, config.regenerate.num_samples))
    return 0


def _left_out(skipped: dict[str, int], failed: Failures) -> str:
    """`, 2 skipped (LIMIT), 30 failed (HTTP 500: 28, timeout: 2; details in FILE)`: the rows not written, each
    count with its reason (a failure per kind); empty when every row was written."""
    text = "".join(f", {n} skipped ({limit})" for limit, n in skipped.items())
    if failed.total:
        return f"{text}, {failed.line()}"
    return f"{text} (reasons in {failed.log})" if text else ""


def _total(summary: RegenSummary, samples: int) -> str:
    if samples > 1:  # a row per reply
        return f"{summary.rows_total} rows ({summary.rows_total // samples} conversations x {samples} replies)"
    return f"{summary.rows_total} conversations"


def _report(summary: RegenSummary, samples: int) -> str:
    """The line that says what was written; a DataError when nothing was, or when rows are missing."""
    failed, total = summary.failed_requests(), _total(summary, samples)
    cut = "".join(f"; {n} of them cut short before a later turn ({limit})" for limit, n in summary.rows_cut.items())
    out_of = _left_out(summary.rows_skipped, failed)
    fix = what_to_do(failed, limit_fix="raise the limit" if summary.rows_skipped else "")
    if summary.rows_done == 0:
        raise DataError(f"regenerate wrote no row to {summary.out_dir}: of {total}{out_of}; nothing to train on. "
                        f"{fix}, then rerun the same command")
    done = f"regenerate: {summary.rows_done} rows done ({summary.rows_new} new{cut}) of {total}{out_of}"
    if not summary.complete:
        print(f"{done}; output in {summary.out_dir}")
        raise DataError(f"{summary.out_dir} is partial: {summary.rows_missing} of {total} missing, {failed.line()}. "
                        f"{fix}, then rerun the same command to finish: the {summary.rows_done} rows written are kept "
                        "and only the missing ones are asked for")
    advice = f"\nregenerate: for the {failed.total} failed: {failed.fix()}" if failed.total else ""
    return f"{done}; output in {summary.out_dir}. Train on it with data.path={summary.out_dir}{advice}"
