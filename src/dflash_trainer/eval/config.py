"""Configuration of acceptance-length evaluation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dflash_trainer.errors import ConfigError


@dataclass
class EvalConfig:
    interval: int = 0
    """Measure real tau every this many optimizer steps (0: never during training)."""
    at_end: bool = True
    """Measure real tau on the final drafter at the end of training (colocated runs)."""
    prompts: Optional[str] = None
    """JSONL of {"messages": [...]}; default: the run's plan/eval.jsonl."""
    num_prompts: int = 16
    max_new_tokens: int = 128
    temperature: float = 0.0
    batch_size: int = 64
    """Prompts decoded together (rows of one batch accept independently)."""
    prompt_lookup: bool = True
    """Also measure prompt lookup (n-gram copying, no training) on the same prompts: the baseline to beat."""
    lattice_head: bool = True
    """LiLiCorr drafters: false drafts each slot's top-1 (the backbone alone, the lattice head unused), which
    measures what the head adds; the engines always walk the lattice."""

    def __post_init__(self) -> None:
        if self.interval < 0:
            raise ConfigError(f"eval.interval must be >= 0, got {self.interval}")
        if self.num_prompts < 1 or self.max_new_tokens < 1:
            raise ConfigError(f"eval.num_prompts and eval.max_new_tokens must be >= 1, got {self.num_prompts} and "
                              f"{self.max_new_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"eval.batch_size must be >= 1, got {self.batch_size}")
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0, got {self.temperature}")
