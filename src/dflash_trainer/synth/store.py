"""The output directory of `dflash-train synthesize`: a regenerate output directory (`regen/shards.py`), so
`regenerate`, `plan` and `train` read it as they read one.

Each sampled opening is an attempt with the row id `synth:<k>`. A kept conversation is a row of the shards; a
dropped opening is a skipped row of `failed.jsonl` under its drop reason (the manifest's `rows_skipped` counts
them by reason), a failed request a failed row. On resume the attempts already made, kept or not, are not made
again: sampling continues at the next k, and the kept openings are read back for deduplication. A failed attempt
does not count toward `synthesize.max_attempts` (the server failed, not the filters), so a rerun after a server
fault can still reach `num_prompts`; until then the manifest says `complete: false`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from dflash_trainer.config import Config
from dflash_trainer.regen.settings import RegenSettings, settings_from_config
from dflash_trainer.regen.shards import RegenStore

ROW_PREFIX = "synth:"

CONTENT_KEYS = ("num_turns", "answer", "temperature", "top_p", "max_new_tokens", "keep_truncated", "system_prompt",
                "min_chars", "max_chars", "min_tokens", "max_tokens", "near_dup_threshold")
"""The `synthesize` settings that decide what is written (a resume must keep them); the number of prompts, the
attempt cap and the chunk size may change."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SynthSettings(RegenSettings):
    """The answers' settings (as `regenerate` records them, so `train` checks thinking and temperature as for
    regenerated data) and the prompts' own, stored flat as `synthesize.<key>`."""

    prompts: dict[str, Any]
    """The CONTENT_KEYS of the `synthesize` section, and its resolved seed."""

    def to_dict(self) -> dict[str, Any]:
        flat = asdict(self)
        prompts = flat.pop("prompts")
        return flat | {f"synthesize.{key}": value for key, value in prompts.items()}


def synth_settings(config: Config) -> SynthSettings:
    """The settings of `config`: one answer per conversation, every turn answered."""
    answers = dataclasses.replace(settings_from_config(config), num_samples=1, max_turns=None)
    syn = config.synthesize
    prompts = {key: getattr(syn, key) for key in CONTENT_KEYS}
    prompts["seed"] = synth_seed(config)
    return SynthSettings(**asdict(answers), prompts=prompts)


def synth_seed(config: Config) -> int:
    return int(config.synthesize.seed if config.synthesize.seed is not None else config.run.seed)


def row_id(attempt: int) -> str:
    return f"{ROW_PREFIX}{attempt}"


class SynthStore(RegenStore):
    """Regenerate's store, counting attempts toward `wanted` kept conversations."""

    COMMAND = "synthesize"

    def __init__(self, *args: Any, wanted: int, max_attempts: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wanted = wanted
        self.max_attempts = max_attempts

    @property
    def next_attempt(self) -> int:
        """The first attempt not made yet (after every kept, dropped or failed one)."""
        made = [int(rid[len(ROW_PREFIX):]) for rid in (*self.done_ids, *self.failed) if rid.startswith(ROW_PREFIX)]
        return max(made, default=-1) + 1

    @property
    def attempts_left(self) -> int:
        """Attempts still allowed: those made count, except the failed ones."""
        return self.max_attempts - (self.next_attempt - self.rows_failed)

    @property
    def complete(self) -> bool:
        """Enough conversations are kept, or no attempt is left."""
        return self.rows_done >= self.wanted or self.attempts_left <= 0

    @property
    def rows_missing(self) -> int:
        """Conversations a rerun would still try to write (none once the attempts are used up by the filters)."""
        return 0 if self.complete else self.wanted - self.rows_done

    def manifest(self) -> dict[str, Any]:
        return super().manifest() | {
            "rows_total": self.wanted,
            "synthesize": {"conversations_wanted": self.wanted, "attempts": self.next_attempt,
                           "max_attempts": self.max_attempts, "dropped": self.skip_counts,
                           "failed": self.rows_failed, "cut": self.cut_counts},
        }
