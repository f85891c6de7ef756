"""Configuration of `dflash-train synthesize`: how the target writes user turns and which ones are kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dflash_trainer.errors import ConfigError


@dataclass
class SynthesizeConfig:
    """The prompts part of `synthesize`; the answers between (and after) them are made as `regenerate` makes
    them (`regenerate.backend`, `url`, `temperature`, `thinking`, `max_new_tokens`, ...)."""

    num_prompts: int = 1000
    """Conversations to keep (after the filters); a rerun with a larger number adds to the output."""
    num_turns: int = 1
    """User turns per conversation: > 1 has the target answer, then write the next user turn."""
    answer: bool = True
    """The target answers the last user turn too, so `train` reads the output as it is. False: prompts only
    (answer them with `dflash-train regenerate`, e.g. several sampled replies each)."""
    temperature: float = 1.0
    """Sampling temperature of the user turns (Magpie samples at 1.0; lower repeats more)."""
    top_p: float = 1.0
    """Nucleus of the user-turn sampling (1.0: the whole distribution)."""
    seed: Optional[int] = None
    """Seed of the user-turn sampling (None: run.seed)."""
    max_new_tokens: int = 256
    """Cap on each user turn's tokens; a turn that reaches it without ending is dropped as truncated."""
    keep_truncated: bool = False
    """Keep turns cut at max_new_tokens (a random-weight target never ends a turn: the demo sets this)."""
    system_prompt: Optional[str] = None
    """A system message rendered before the user turn (None: the template's default, if any)."""
    min_chars: int = 10
    """Shorter user turns are dropped (too_short)."""
    max_chars: Optional[int] = 8000
    """Longer user turns are dropped (too_long); None: no cap."""
    min_tokens: Optional[int] = None
    """Drop user turns of fewer target tokens (None: no floor)."""
    max_tokens: Optional[int] = None
    """Drop user turns of more target tokens (None: no cap but max_new_tokens)."""
    near_dup_threshold: Optional[float] = 0.7
    """First user turns whose word-bigram Jaccard similarity to a kept one reaches this are dropped
    (near_duplicate); None: exact duplicates only."""
    max_attempts: Optional[int] = None
    """Stop after this many first turns sampled even when fewer than num_prompts were kept (None: 10x)."""
    batch_size: int = 32
    """Conversations per chunk: decoded together (local) or in flight (regenerate.concurrency requests); the
    rows of a chunk are written when it ends, so a kill loses at most one chunk."""
    shard_rows: int = 256
    """Rows per output shard."""

    def __post_init__(self) -> None:
        for key in ("num_prompts", "num_turns", "max_new_tokens", "batch_size", "shard_rows"):
            if getattr(self, key) < 1:
                raise ConfigError(f"synthesize.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("max_chars", "min_tokens", "max_tokens", "max_attempts"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"synthesize.{key} must be >= 1 or null, got {getattr(self, key)}")
        if self.min_chars < 0:
            raise ConfigError(f"synthesize.min_chars must be >= 0, got {self.min_chars}")
        if self.max_chars is not None and self.max_chars < self.min_chars:
            raise ConfigError(f"synthesize.max_chars ({self.max_chars}) must be >= synthesize.min_chars "
                              f"({self.min_chars})")
        if self.min_tokens is not None and self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ConfigError(f"synthesize.max_tokens ({self.max_tokens}) must be >= synthesize.min_tokens "
                              f"({self.min_tokens})")
        if self.temperature <= 0:
            raise ConfigError(f"synthesize.temperature must be > 0 (greedy would write one prompt again and "
                              f"again), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"synthesize.top_p must be in (0, 1], got {self.top_p}")
        if self.near_dup_threshold is not None and not 0 < self.near_dup_threshold <= 1:
            raise ConfigError(f"synthesize.near_dup_threshold must be in (0, 1] or null, got "
                              f"{self.near_dup_threshold}")
        if self.max_attempts is not None and self.max_attempts < self.num_prompts:
            raise ConfigError(f"synthesize.max_attempts ({self.max_attempts}) must be >= synthesize.num_prompts "
                              f"({self.num_prompts}) or null")

    @property
    def attempts_cap(self) -> int:
        """First turns sampled at most."""
        return self.max_attempts if self.max_attempts is not None else 10 * self.num_prompts
