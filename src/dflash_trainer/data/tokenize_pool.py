"""Tokenize conversations in worker processes on a cache miss.

Rendering the chat template is Python and runs in one thread (minutes for a large dataset; bench/RESULTS.md),
so a large dataset is split into chunks that spawned processes tokenize. The result is identical to one process:
chunks are consumed in their order. The workers read the tokenizer from a file, so they start at once.

Pool invariant: at most `num_workers` processes; at most `2 * num_workers` chunks submitted and not yet
consumed (bounded memory); every wait for a chunk is bounded by `chunk_timeout_s`; a worker's exception is
raised here, a dead worker or a stuck chunk becomes a `DataError` that names `data.num_workers`; the workers
are joined on return and terminated on every error, Ctrl-C included, and when the pool turns out slower than
the caller's own rate (`slower_than`) or, with that rate given, a chunk is stuck: the conversations done so far
are returned, the caller does the rest.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.masks import TurnEnds, Unmaskable, tokenize_conversation
from dflash_trainer.data.types import Conversation, ImageRef, TokenizedSequence
from dflash_trainer.data.vision import ImageTokens, fit_images, image_text, images_of
from dflash_trainer.errors import DataError

CHUNK_SIZE = 128
"""Conversations per task: big enough to amortise the pickling, small enough to balance the workers."""
CHUNK_TIMEOUT_S = 120.0
"""Bound on the wait for one chunk (~1 s of work, plus a worker's start, ~3 s): long enough for slow
templates and disks, short enough that a dead worker (the pool never finishes its task) fails soon."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeSettings:
    """What every conversation is tokenized with (sent once to each worker)."""

    thinking: bool
    end_of_turn: str | TurnEnds
    """What ends an assistant reply (`masks.turn_ends`; a str: one token the template writes after every reply)."""
    max_length: int
    min_supervised: int
    escape_special_tokens: bool = False
    """Special-token text of user and system turns kept plain text (`data.escape_special_tokens`)."""
    images: Optional[ImageTokens] = None
    """The image-text target's image processing (`vision.py`); None: a conversation with images is dropped
    (`IMAGES_ON_TEXT_TARGET`)."""


IMAGES_ON_TEXT_TARGET = "images_need_image_text_target"
"""Drop reason of a conversation with images when the target has no image processor."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizedRow:
    """One conversation's result as it crosses the process boundary: numpy, not torch (no shared-memory
    file descriptor per tensor)."""

    input_ids: Optional[np.ndarray]
    """(n,) int64, or None when the conversation was dropped."""
    loss_mask: Optional[np.ndarray]
    """(n,) bool, or None when dropped."""
    dropped_reason: Optional[str]
    """The `Unmaskable` reason when dropped."""
    truncated_tokens: int = 0
    images: tuple[ImageRef, ...] = ()
    """The images the sequence holds (`TokenizedSequence.images`)."""
    image_grid_thw: Optional[np.ndarray] = None
    """(num_images, 3) int64, or None."""


Result = Union[TokenizedSequence, str]
"""A tokenized sequence, or the reason its conversation was dropped."""


log = logging.getLogger(__name__)
_explained: set[str] = set()


def tokenize_one(conversation: Conversation, tokenizer: PreTrainedTokenizerFast, settings: TokenizeSettings) -> Result:
    if conversation.has_images and settings.images is None:
        return IMAGES_ON_TEXT_TARGET
    try:
        processed = settings.images.process(images_of(conversation.messages)) if conversation.has_images else None
        sequence = tokenize_conversation(conversation, tokenizer, thinking=settings.thinking,
                                         end_of_turn=settings.end_of_turn, max_length=settings.max_length,
                                         min_supervised=settings.min_supervised,
                                         escape_special_tokens=settings.escape_special_tokens,
                                         images=None if processed is None else image_text(settings.images, processed))
        if processed is not None:
            sequence = fit_images(sequence, processed, settings.images.image_token_id,
                                  min_supervised=settings.min_supervised)
        return sequence
    except Unmaskable as e:
        if e.detail and e.reason not in _explained:  # the first of each reason (per process), with what broke it
            _explained.add(e.reason)
            log.warning("dropped %s:%d (%s): %s", conversation.source, conversation.source_index, e.reason, e.detail)
        return e.reason


def default_num_workers() -> int:
    """One per CPU this process may run on, at most 16."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(16, cpus))


_worker: dict = {}


def _init_worker(tokenizer_file: str, settings: TokenizeSettings) -> None:
    """Rebuild the tokenizer here, not in the pool's bootstrap: a failure is kept and raised by the first
    chunk (an initializer that raises makes `multiprocessing.Pool` restart the worker forever). It comes as a
    file the caller wrote, not as an argument: a spawned worker's arguments go through a pipe that the parent
    writes into until the worker, once its imports are done, reads them, so arguments larger than the pipe's
    buffer (a tokenizer's pickle is hundreds of KB) would start the workers one after another."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    torch.set_num_threads(1)
    try:
        # our own pickle, written by the parent into its private temporary directory
        _worker.update(tokenizer=pickle.loads(Path(tokenizer_file).read_bytes()), settings=settings, error=None)
    except Exception as e:  # e.g. a remote-code tokenizer whose module this process cannot import
        _worker.update(error=e)


def _tokenize_chunk(chunk: list[Conversation]) -> list[TokenizedRow]:
    if _worker["error"] is not None:
        raise DataError(f"a tokenizer worker could not rebuild the tokenizer ({_worker['error']!r}); "
                        "set data.num_workers=1 to tokenize in the main process")
    rows = []
    for conversation in chunk:
        result = tokenize_one(conversation, _worker["tokenizer"], _worker["settings"])
        if isinstance(result, str):
            rows.append(TokenizedRow(input_ids=None, loss_mask=None, dropped_reason=result))
        else:
            numpy = lambda t: None if t is None else t.numpy()  # noqa: E731
            rows.append(TokenizedRow(input_ids=result.input_ids.numpy(), loss_mask=result.loss_mask.numpy(),
                                     dropped_reason=None, truncated_tokens=result.truncated_tokens,
                                     images=result.images, image_grid_thw=numpy(result.image_grid_thw)))
    return rows


def _from_row(row: TokenizedRow) -> Result:
    if row.dropped_reason is not None:
        return row.dropped_reason
    tensor = lambda a: None if a is None else torch.from_numpy(a)  # noqa: E731
    return TokenizedSequence(input_ids=torch.from_numpy(row.input_ids), loss_mask=torch.from_numpy(row.loss_mask),
                             truncated_tokens=row.truncated_tokens, images=row.images,
                             image_grid_thw=tensor(row.image_grid_thw))


def tokenize_in_workers(conversations: Sequence[Conversation], tokenizer: PreTrainedTokenizerFast,
                        settings: TokenizeSettings, *, num_workers: int, chunk_timeout_s: float = CHUNK_TIMEOUT_S,
                        slower_than: Optional[float] = None, check_after_s: float = 30.0) -> list[Result]:
    """`tokenize_one` of a prefix of the conversations, in order, computed by `num_workers` spawned processes:
    all of them, unless `slower_than` (this process's conversations per second) is given and, `check_after_s` or
    more after the pool's start, the pool tokenizes fewer a second since its first chunk (its start-up is spent
    by then), or no chunk comes within `chunk_timeout_s`: then it stops with those it has done."""
    # the workers read the tokenizer from a file that outlives the pool (a replaced worker reads it again)
    with tempfile.TemporaryDirectory(prefix="dflash-tokenizer-") as tmp:
        tokenizer_file = Path(tmp) / "tokenizer.pickle"
        try:
            tokenizer_file.write_bytes(pickle.dumps(tokenizer))
        except OSError as e:
            raise DataError(f"cannot write the tokenizer for the worker processes into {tmp} ({e}); set TMPDIR to "
                            "a writable folder with space, or data.num_workers=1") from e
        return _run_pool(conversations, str(tokenizer_file), settings, num_workers=num_workers,
                         chunk_timeout_s=chunk_timeout_s, slower_than=slower_than, check_after_s=check_after_s)


def _run_pool(conversations: Sequence[Conversation], tokenizer_file: str, settings: TokenizeSettings, *,
              num_workers: int, chunk_timeout_s: float, slower_than: Optional[float],
              check_after_s: float) -> list[Result]:
    chunks = [list(conversations[i : i + CHUNK_SIZE]) for i in range(0, len(conversations), CHUNK_SIZE)]
    results: list[Result] = []
    start = time.perf_counter()
    first_at, first_rows = None, 0  # when the first chunk came, and its size: the pool's steady rate starts there
    # spawn, not fork: the parent may hold CUDA, torch's thread pools or the tokenizer's own threads.
    pool = multiprocessing.get_context("spawn").Pool(num_workers, initializer=_init_worker,
                                                     initargs=(tokenizer_file, settings))
    pending: deque[AsyncResult] = deque()
    next_chunk = 0
    try:
        while next_chunk < len(chunks) or pending:
            while next_chunk < len(chunks) and len(pending) < 2 * num_workers:
                pending.append(pool.apply_async(_tokenize_chunk, (chunks[next_chunk],)))
                next_chunk += 1
            try:
                rows = pending.popleft().get(timeout=chunk_timeout_s)  # a worker's exception is raised here
            except multiprocessing.TimeoutError:
                # multiprocessing.Pool replaces a dead worker but never finishes its task: this catches both.
                if slower_than is not None:  # the caller can do the rest itself
                    log.warning("no result from a tokenizer worker in %g s: stopped after %d of %d conversations, "
                                "the rest is tokenized in the main process", chunk_timeout_s, len(results),
                                len(conversations))
                    pool.terminate()
                    return results
                raise DataError(f"no result from a tokenizer worker in {chunk_timeout_s:g} s ({CHUNK_SIZE} "
                                "conversations): it died (out of memory?) or hangs; set data.num_workers=1 "
                                "to tokenize in the main process") from None
            results.extend(_from_row(row) for row in rows)
            now = time.perf_counter()
            if first_at is None:  # the workers' start-up (spawn, imports, the tokenizer) was in this wait
                first_at, first_rows = now, len(rows)
                log.info("tokenizer workers: first of %d chunks after %.1f s", len(chunks), now - start)
                continue
            rate = (len(results) - first_rows) / max(now - first_at, 1e-9)
            if slower_than is not None and now - start >= check_after_s and rate < slower_than:
                log.warning("tokenizer worker processes did %.0f conversations/s, fewer than one process (%.0f/s): "
                            "stopped after %d of %d, the rest is tokenized in the main process", rate, slower_than,
                            len(results), len(conversations))
                pool.terminate()
                return results
        pool.close()
    except BaseException:
        pool.terminate()  # stop the workers now, whatever they were doing
        raise
    finally:
        pool.join()
    return results
