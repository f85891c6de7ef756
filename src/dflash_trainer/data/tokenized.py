"""The tokenized training set: sequences with loss masks, stored flat and cached on disk (safetensors + JSON).

The cache key hashes everything that can change the result (sources by the SHA-256 of their files, limits,
weights, seed, tokenizer vocabulary and chat template, thinking, max length, block size, eval split size and
the source of the loading/masking modules and `CODE_VERSION`), so a stale cache is never read. A damaged one is
never read either: each entry carries digests of its arrays and metadata, checked on every load (one read of
the arrays); an entry that fails them is rebuilt from the sources, with a warning naming the file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast

from dflash_trainer.data.masks import turn_ends
from dflash_trainer.data.sources import source_fingerprint
from dflash_trainer.data.stored_images import DatasetImages
from dflash_trainer.data.tokenize_pool import TokenizeSettings, tokenize_in_workers, tokenize_one
from dflash_trainer.data.types import Conversation, TokenizedSequence
from dflash_trainer.data.vision import ImageTokens
from dflash_trainer.errors import DataError

log = logging.getLogger(__name__)

CODE_VERSION = 2
"""Bump when loading, masking or the cache layout changes: old caches are then ignored."""

DEFAULT_CACHE_DIR = Path("~/.cache/dflash_trainer/tokenized")


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizedDataset:
    """All training sequences, concatenated. Sequence `i` is `[offsets[i], offsets[i+1])`; its id is `i`."""

    input_ids: torch.Tensor
    """(total,) int32 on CPU: every sequence's token ids, back to back."""
    loss_mask: torch.Tensor
    """(total,) bool on CPU."""
    offsets: torch.Tensor
    """(n + 1,) int64 on CPU: start of each sequence, then the total."""
    source_index: torch.Tensor
    """(n,) int64 on CPU: row index of each sequence's conversation inside its source."""
    source_id: torch.Tensor
    """(n,) int64 on CPU: index into `sources` of each sequence's source."""
    sources: tuple[str, ...]
    """Source names."""
    images: Optional[DatasetImages] = None
    """The sequences' images (an image-text target's data with image parts: references, their pixels made on
    read), or None."""

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    def __getitem__(self, i: int) -> TokenizedSequence:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence id {i} out of range [0, {len(self)})")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        pixel_values, grid = self.images.of(i) if self.images is not None else (None, None)
        return TokenizedSequence(input_ids=self.input_ids[a:b].long(), loss_mask=self.loss_mask[a:b].clone(),
                                 pixel_values=pixel_values, image_grid_thw=grid)

    def content_sha256(self) -> str:
        """Digest of the training content (ids, loss masks, sequence boundaries, and images where there are some):
        equal data, equal digest, whatever code produced it. A checkpoint resumes only on data with its digest."""
        h = hashlib.sha256()
        for t in (self.offsets, self.input_ids, self.loss_mask.to(torch.uint8)):
            h.update(t.contiguous().numpy().tobytes())
        if self.images is not None:
            self.images.update_content_digest(h)
        return h.hexdigest()

    @property
    def lengths(self) -> list[int]:
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())

    @staticmethod
    def from_sequences(items: Iterable[tuple[Conversation, TokenizedSequence]],
                       images: Optional[ImageTokens] = None) -> "TokenizedDataset":
        """The dataset of `items`; `images`: the image processing they were tokenized with (sequences with images
        need it)."""
        items = list(items)
        sources = tuple(dict.fromkeys(c.source for c, _ in items))
        lengths = torch.tensor([0] + [s.num_tokens for _, s in items], dtype=torch.long)
        empty = torch.zeros(0, dtype=torch.long)
        return TokenizedDataset(
            images=DatasetImages.from_sequences([s for _, s in items], images),
            input_ids=torch.cat([s.input_ids for _, s in items] or [empty]).to(torch.int32),
            loss_mask=torch.cat([s.loss_mask for _, s in items] or [empty.bool()]),
            offsets=torch.cumsum(lengths, 0),
            source_index=torch.tensor([c.source_index for c, _ in items], dtype=torch.long),
            source_id=torch.tensor([sources.index(c.source) for c, _ in items], dtype=torch.long),
            sources=sources,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeOutcome:
    dataset: TokenizedDataset
    dropped: dict[str, int]
    """Conversations not turned into sequences, by reason."""
    truncated: int = 0
    """Kept conversations cut at data.max_length."""
    truncated_tokens: int = 0
    """Tokens those cuts left out."""


PROBE_CONVERSATIONS = 512
"""Conversations tokenized in this process first, timed, to decide whether worker processes would pay."""
PARALLEL_MIN_SECONDS = 60.0
"""Worker processes are used only when tokenizing the rest here would take longer than this: each one imports
torch before it starts, and on a fast chat template a pool of them can be slower than this process."""
POOL_CHECK_S = 30.0
"""From this long after its start, a pool that tokenizes fewer conversations a second than this process (counted
from its first chunk: its start-up is spent by then) is stopped, and the rest done here."""


def tokenize_all(conversations: Sequence[Conversation], tokenizer: PreTrainedTokenizerFast, *, thinking: bool,
                 max_length: int, min_supervised: int, num_workers: int = 1,
                 parallel_min_s: float = PARALLEL_MIN_SECONDS, probe: Optional[int] = None,
                 escape_special_tokens: bool = False, images: Optional[ImageTokens] = None) -> TokenizeOutcome:
    """Tokenize every conversation (the same result however it is spread): the first `probe` (default
    `PROBE_CONVERSATIONS`) in this process, timed; the rest here too, or in `num_workers` processes
    (`tokenize_pool.py`) when that would take longer than `parallel_min_s` here (0: always). `images`: the
    image-text target's image processing (`vision.py`); None drops conversations with images, counted."""
    settings = TokenizeSettings(thinking=thinking, end_of_turn=turn_ends(tokenizer, thinking=thinking),
                                max_length=max_length, min_supervised=min_supervised,
                                escape_special_tokens=escape_special_tokens, images=images)
    head = conversations[: PROBE_CONVERSATIONS if probe is None else probe] if num_workers > 1 else conversations
    start = time.perf_counter()
    results = [tokenize_one(c, tokenizer, settings) for c in head]
    rest = conversations[len(head):]
    seconds_each = (time.perf_counter() - start) / max(1, len(head))
    projected_s = seconds_each * len(rest)
    if rest and (parallel_min_s <= 0 or projected_s > parallel_min_s):
        log.info("tokenizing %d more conversations in %d worker processes (~%.0f s in this one)", len(rest),
                 num_workers, projected_s)
        # parallel_min_s <= 0 asks for the pool whatever its speed: no fallback then
        own_rate = 1.0 / seconds_each if parallel_min_s > 0 and seconds_each > 0 else None
        pool_start = time.perf_counter()
        done = tokenize_in_workers(rest, tokenizer, settings, num_workers=num_workers, slower_than=own_rate,
                                   check_after_s=POOL_CHECK_S)
        pool_s = time.perf_counter() - pool_start
        log.info("worker processes tokenized %d conversations in %.0f s (%.0f/s; this process: %.0f/s)", len(done),
                 pool_s, len(done) / max(pool_s, 1e-9), 1.0 / max(seconds_each, 1e-9))
        results += done
        rest = rest[len(done):]
    results += [tokenize_one(c, tokenizer, settings) for c in rest]
    kept = [(c, r) for c, r in zip(conversations, results) if not isinstance(r, str)]
    dropped = Counter(r for r in results if isinstance(r, str))
    cut = [r.truncated_tokens for _, r in kept if r.truncated_tokens]
    return TokenizeOutcome(dataset=TokenizedDataset.from_sequences(kept, images), dropped=dict(dropped),
                           truncated=len(cut), truncated_tokens=sum(cut))


# ------------------------------------------------------------------------------------------- caching


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerFast) -> dict[str, str]:
    """The tokenizer by what it does (vocabulary and merges, special tokens, chat template), not by where it was
    loaded from."""
    vocab = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()
    return {"vocab_sha256": vocab,
            "special_tokens": json.dumps(tokenizer.special_tokens_map, sort_keys=True),
            "chat_template": str(tokenizer.chat_template)}


def code_fingerprint(module_files: Iterable[str]) -> str:
    """Hash of the source files that decide the cached content (the caller, at the top of data preparation,
    names them), so an edited loader or masker never reads a stale cache (CODE_VERSION covers the rest)."""
    h = hashlib.sha256()
    for module_file in sorted({*module_files, __file__}):
        h.update(Path(module_file).read_bytes())
    return h.hexdigest()


def cache_key(parts: dict[str, Any], code_sha256: str) -> str:
    code = {"code_version": CODE_VERSION, "code_sha256": code_sha256}
    blob = json.dumps({**code, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def key_parts(data_config, *, seed: int, block_size: int, tokenizer: PreTrainedTokenizerFast,
              images: Optional[ImageTokens] = None) -> dict[str, Any]:
    """Everything that changes the prepared data (see the module docstring); the image processing only where the
    target has one (a text target's key is as it was)."""
    return {**({"images": images.fingerprint()} if images is not None else {}),
        "sources": source_fingerprint(data_config),
        "max_conversations": data_config.max_conversations,
        "num_eval_conversations": data_config.num_eval_conversations,
        "seed": seed,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "thinking": data_config.thinking,
        "max_length": data_config.max_length,
        "block_size": block_size,
        "max_record_bytes": data_config.max_record_bytes,  # the bound on hostile rows decides what is kept
        "escape_special_tokens": data_config.escape_special_tokens,
    }


def cache_root(cache_dir: Optional[str]) -> Path:
    return Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE_DIR.expanduser()


CACHE_WAIT_S = 2 * 3600.0
"""Bound on the wait for another process tokenizing the same data (a large dataset takes minutes to an hour)."""


@contextmanager
def cache_lock(path: Path, timeout_s: float = CACHE_WAIT_S, poll_s: float = 0.5) -> Iterator[None]:
    """Hold `<path>.lock` while building the cache entry `path` (after a miss), so processes that prepare the
    same data at once (a sweep's arms) tokenize it once: the others wait, then read the cache.

    The lock is an flock, released by the kernel when its holder exits or dies: a stale lock file never blocks.
    In a torchrun job only rank 0 prepares first; the other ranks wait for it within `pipeline.timeout_s`.
    Where the cache folder cannot hold a lock, nothing is locked (each process tokenizes on its own).
    """
    lock_path = path.parent / f"{path.name}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock_path, "a")
    except OSError as e:
        log.debug("no lock for the tokenized cache %s (%s)", path, e)
        yield
        return
    with handle:
        start = time.monotonic()
        waited = locked = False
        while not locked:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:  # held by another process
                if not waited:
                    log.info("waiting for another process that tokenizes the same data (%s)", lock_path)
                    waited = True
                if time.monotonic() - start > timeout_s:
                    raise DataError(f"another process has held {lock_path} for over {timeout_s:.0f} s (it is "
                                    "tokenizing the same data, or hangs): wait for it, stop it, or set "
                                    "data.cache_dir to another folder") from None
                time.sleep(poll_s)
            except OSError as e:  # a file system without locks (some network mounts)
                log.debug("no lock for the tokenized cache %s (%s)", path, e)
                break
        try:
            yield
        finally:
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


def save_cache(path: Path, dataset: TokenizedDataset, meta: dict[str, Any]) -> None:
    """Write `path/{data.safetensors, meta.json}` atomically (a temp dir renamed into place), with the digests
    `load_cache` checks: `content_sha256` (the training content, as resume checks it), `rows_sha256` (where each
    sequence came from) and `meta_sha256` (the rest of meta.json: counts and the held-out conversations)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    meta = {**meta, "sources": list(dataset.sources), "content_sha256": dataset.content_sha256(),
            "rows_sha256": _rows_sha256(dataset)}
    try:
        images = dataset.images.tensors() if dataset.images is not None else {}
        save_file({"input_ids": dataset.input_ids, "loss_mask": dataset.loss_mask.to(torch.uint8),
                   "offsets": dataset.offsets, "source_index": dataset.source_index,
                   "source_id": dataset.source_id, **images}, str(tmp / "data.safetensors"))
        (tmp / "meta.json").write_text(json.dumps({**meta, "meta_sha256": _meta_sha256(meta)}))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _rows_sha256(dataset: TokenizedDataset) -> str:
    """Digest of each sequence's source row and source (not in `content_sha256`, which resume compares with
    checkpoints and so must stay as it is)."""
    h = hashlib.sha256()
    for t in (dataset.source_index, dataset.source_id):
        h.update(t.contiguous().numpy().tobytes())
    if dataset.images is not None:  # where each image is read from
        h.update(dataset.images.sources_json())
    return h.hexdigest()


def _meta_sha256(meta: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()


def cache_damage(dataset: TokenizedDataset, meta: dict[str, Any]) -> Optional[str]:
    """What of a cache entry does not match the digests saved with it (bytes changed on disk since it was
    written), or None when it is intact. Hashing reads the arrays once."""
    meta = dict(meta)
    if meta.pop("meta_sha256", None) != _meta_sha256(meta):
        return "meta.json"
    if meta.get("content_sha256") != dataset.content_sha256() or meta.get("rows_sha256") != _rows_sha256(dataset):
        return "data.safetensors"
    return None


def cache_entry_id(path: Path) -> Optional[tuple[int, int]]:
    """Which copy of the entry `path` is on disk (an entry is renamed into place whole, so a new one has another
    inode), or None when there is none: a caller that found it damaged reads it again only once it changed."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def load_cache(path: Path, images: Optional[ImageTokens] = None) -> Optional[tuple[TokenizedDataset, dict[str, Any]]]:
    """The cached dataset and its metadata, or None when absent, unreadable or damaged (its bytes no longer match
    the digests saved with it): then it is rebuilt from the sources, with a warning naming the file, since the
    cache is only a copy of what the sources and the config give. `images`: the image processing its images are
    read with (the one the cache key names)."""
    if not (path / "data.safetensors").is_file() or not (path / "meta.json").is_file():
        return None
    try:
        t = load_file(str(path / "data.safetensors"))
        meta = json.loads((path / "meta.json").read_bytes().decode("utf-8"))
        stored = DatasetImages.from_tensors(t, images) if "image_offsets" in t else None
        dataset = TokenizedDataset(input_ids=t["input_ids"], loss_mask=t["loss_mask"].bool(), offsets=t["offsets"],
                                   source_index=t["source_index"], source_id=t["source_id"],
                                   sources=tuple(meta["sources"]), images=stored)
    except Exception as e:  # a corrupt cache entry is rebuilt, never trusted
        log.warning("tokenized cache %s is unreadable (%s: %s): rebuilding it from the sources (if this repeats, "
                    "delete %s or set data.cache_dir to a writable folder)", path, type(e).__name__, e, path)
        return None
    damage = cache_damage(dataset, meta)
    if damage is not None:
        log.warning("tokenized cache file %s is damaged (checksum mismatch: its bytes changed after it was "
                    "written): rebuilding the cache from the sources (if this repeats, delete %s or set "
                    "data.cache_dir to a writable folder)", path / damage, path)
        return None
    return dataset, meta
