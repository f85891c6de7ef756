"""Which written user turns are kept: the drop reasons, and exact and near-duplicate detection.

A turn is checked on its own (`TurnFilter`), then, when it opens a conversation, against the openings kept
before it (`Deduplicator`). The first reason that applies, in the order of `REASONS`, is the one counted.

Near duplicates: the Jaccard similarity of two texts' sets of word bigrams (of the normalised text), found
with MinHash and locality-sensitive hashing so that each new text is compared with a few candidates, not with
every kept one. Bigrams rather than longer shingles: one edited word in a 15-word prompt leaves a similarity
of 0.75 (trigrams: 0.63), while "the capital of France" and "... of Spain" stay below 0.7.
"""

from __future__ import annotations

import re
import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from dflash_trainer.regen.turns import Continuation
from dflash_trainer.synth.config import SynthesizeConfig

REASONS = {
    "empty": "nothing but whitespace",
    "truncated": "reached synthesize.max_new_tokens before the end of the user turn",
    "template": "repeats the chat template (a role header, a special token) or the system prompt",
    "too_short": "under synthesize.min_chars characters or synthesize.min_tokens tokens",
    "too_long": "over synthesize.max_chars characters or synthesize.max_tokens tokens",
    "duplicate": "the same text as a kept prompt (case, punctuation and spacing aside)",
    "near_duplicate": "word-bigram Jaccard similarity >= synthesize.near_dup_threshold with a kept prompt",
}
"""Drop reason key (counted in the manifest's `rows_skipped`) -> what it means."""

SHINGLE_WORDS = 2
NUM_PERM = 128
MISS_PROBABILITY = 0.005
"""The bands are chosen so that a pair right at the threshold is missed at most this often."""
_PRIME = (1 << 31) - 1
"""Mersenne prime of the MinHash functions: (a * x + b) mod p stays inside uint64 for a, b, x < p."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Drop:
    """Why a written turn is not kept."""

    reason: str
    """A key of `REASONS`."""
    detail: str
    """By how much (e.g. `4 characters`), for the drop log."""


def normalise(text: str) -> str:
    """Lower-case words joined by single spaces: what two texts must share to be exact duplicates."""
    return " ".join(re.findall(r"\w+", text.casefold()))


class TurnFilter:
    """Checks one written user turn on its own: empty, truncated, a template repeat, too short or too long."""

    def __init__(self, config: SynthesizeConfig, *, markers: Sequence[str], system_prompt: Optional[str],
                 count_tokens: Optional[Callable[[str], int]] = None) -> None:
        self.config = config
        self.markers = tuple(markers)
        self.system = normalise(system_prompt) if system_prompt else None
        self.count_tokens = count_tokens
        if count_tokens is None and (config.min_tokens is not None or config.max_tokens is not None):
            raise ValueError("synthesize.min_tokens / max_tokens need count_tokens")

    def problem(self, turn: Continuation) -> Drop | None:
        c = self.config
        text = turn.text.strip()
        if not text:
            return Drop(reason="empty", detail="")
        if not turn.finished and not c.keep_truncated:
            return Drop(reason="truncated", detail=f"{c.max_new_tokens} tokens without an end of turn")
        marker = next((m for m in self.markers if m in text), None)
        if marker is not None:
            return Drop(reason="template", detail=f"holds {marker!r}")
        if self.system is not None and normalise(text) == self.system:
            return Drop(reason="template", detail="the system prompt again")
        if len(text) < c.min_chars:
            return Drop(reason="too_short", detail=f"{len(text)} characters")
        if c.max_chars is not None and len(text) > c.max_chars:
            return Drop(reason="too_long", detail=f"{len(text)} characters")
        if self.count_tokens is not None:
            tokens = self.count_tokens(text)
            if c.min_tokens is not None and tokens < c.min_tokens:
                return Drop(reason="too_short", detail=f"{tokens} tokens")
            if c.max_tokens is not None and tokens > c.max_tokens:
                return Drop(reason="too_long", detail=f"{tokens} tokens")
        return None


def shingles(text: str) -> frozenset[int]:
    """The crc32s of the word bigrams of `text` normalised (a text of one word: that word)."""
    words = normalise(text).split()
    grams = [" ".join(words[i : i + SHINGLE_WORDS]) for i in range(max(1, len(words) - SHINGLE_WORDS + 1))]
    return frozenset(zlib.crc32(g.encode()) for g in grams if g)


def jaccard(a: frozenset[int], b: frozenset[int]) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def band_rows(threshold: float, num_perm: int = NUM_PERM) -> int:
    """Rows per LSH band: the most (fewest false candidates) that still find a pair at `threshold` with
    probability >= 1 - MISS_PROBABILITY, bands being num_perm // rows."""
    best = 1
    for rows in range(1, num_perm + 1):
        if 1 - (1 - threshold**rows) ** (num_perm // rows) >= 1 - MISS_PROBABILITY:
            best = rows
    return best


class NearDuplicates:
    """Texts added so far, and whether a new one is a near duplicate of one of them.

    A text's MinHash signature (the minimum of `NUM_PERM` hash functions over its shingles) is cut into bands;
    texts sharing a whole band are candidates, and a candidate counts only when the exact Jaccard similarity of
    the two shingle sets reaches the threshold: nothing under it is ever reported.
    """

    def __init__(self, threshold: float, *, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.threshold = threshold
        self.a = rng.integers(1, _PRIME, size=NUM_PERM, dtype=np.uint64)[:, None]
        self.b = rng.integers(0, _PRIME, size=NUM_PERM, dtype=np.uint64)[:, None]
        self.rows = band_rows(threshold)
        self.bands = NUM_PERM // self.rows
        self.buckets: dict[bytes, list[int]] = defaultdict(list)
        self.kept: list[frozenset[int]] = []

    def _keys(self, grams: frozenset[int]) -> list[bytes]:
        x = np.fromiter(grams, dtype=np.uint64, count=len(grams)) % _PRIME
        signature = ((self.a * x[None, :] + self.b) % _PRIME).min(axis=1)  # (NUM_PERM,)
        bands = signature[: self.bands * self.rows].reshape(self.bands, self.rows)
        return [i.to_bytes(2, "little") + band.tobytes() for i, band in enumerate(bands)]

    def add_if_new(self, text: str) -> float | None:
        """The similarity to the closest kept text at or over the threshold (and `text` is not kept); else
        None, and `text` is kept."""
        grams = shingles(text)
        if not grams:
            return None
        keys = self._keys(grams)
        candidates = {j for key in keys for j in self.buckets.get(key, ())}
        best = max((jaccard(grams, self.kept[j]) for j in candidates), default=0.0)
        if best >= self.threshold:
            return best
        self._keep(grams, keys)
        return None

    def add(self, text: str) -> None:
        """Keep `text` whatever it resembles (the kept prompts of an earlier run)."""
        grams = shingles(text)
        if grams:
            self._keep(grams, self._keys(grams))

    def _keep(self, grams: frozenset[int], keys: list[bytes]) -> None:
        for key in keys:
            self.buckets[key].append(len(self.kept))
        self.kept.append(grams)


class Deduplicator:
    """The openings kept so far: a new one that repeats one exactly or nearly is dropped."""

    def __init__(self, near_dup_threshold: Optional[float]) -> None:
        self.exact: set[str] = set()
        self.near = NearDuplicates(near_dup_threshold) if near_dup_threshold is not None else None

    def add(self, text: str) -> None:
        self.exact.add(normalise(text))
        if self.near is not None:
            self.near.add(text)

    def problem(self, text: str) -> Drop | None:
        """Why `text` repeats a kept opening; None when it does not, and it is kept from now on."""
        key = normalise(text)
        if key in self.exact:
            return Drop(reason="duplicate", detail="")
        if self.near is not None:
            similarity = self.near.add_if_new(text)
            if similarity is not None:
                return Drop(reason="near_duplicate", detail=f"Jaccard similarity {similarity:.2f}")
        self.exact.add(key)
        return None
