"""The run's token rates, each defined once here; the log, the metrics rows, the summary and the report read them.

- `step_tokens_per_s`: one step's tokens over that step's wall time (its waits for batches included).
- `tokens_per_s` (steady): the tokens trained since the end of the warm-up over the wall time since then
  (waits, checkpoints and evaluations included). The warm-up is the session's first `WARMUP_STEPS` steps,
  which compile the step and allocate its buffers: they would drag a short run's figure far down.
- `overall_tokens_per_s`: the session's tokens over its whole training wall time, warm-up included.
- `T` (`T_tokens_per_s`): drafter capacity, the tokens after the warm-up over the drafter's busy time (its steps
  minus their waits): what the drafters would train if batches were always ready.

Tokens are all drafter ranks' real (unpadded) tokens; times are the leader's. A resumed run counts this session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

WARMUP_STEPS = 3
"""Steps of a session left out of the steady figures."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputFigures:
    """The session's rates at its end (the run summary's figures); None where no step after the warm-up ran."""

    tokens_per_s: Optional[float]
    """Steady: after the warm-up, waits, checkpoints and evaluations included."""
    overall_tokens_per_s: Optional[float]
    """The whole session, warm-up included."""
    drafter_tokens_per_s: Optional[float]
    """T: after the warm-up, over the drafter's busy time (waits left out)."""
    warmup_steps: int


class ThroughputMeter:
    """Fed once per step with the step's tokens and times and the time the step ended (seconds, one clock)."""

    def __init__(self, start_s: float, warmup_steps: int = WARMUP_STEPS) -> None:
        self.start_s = start_s
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.tokens = 0
        self.last_s = start_s
        self.steady_start_s: Optional[float] = None
        self.steady_tokens = 0
        self.steady_busy_s = 0.0

    def step(self, tokens: int, step_time_s: float, wait_time_s: float, end_s: float) -> dict[str, Optional[float]]:
        """Count a step; returns its metrics-row figures (`step_tokens_per_s`, `tokens_per_s`)."""
        self.steps += 1
        self.tokens += tokens
        self.last_s = end_s
        if self.steady_start_s is not None:
            self.steady_tokens += tokens
            self.steady_busy_s += step_time_s - wait_time_s
        elif self.steps >= self.warmup_steps:
            self.steady_start_s = end_s
        return {"step_tokens_per_s": tokens / step_time_s if step_time_s > 0 else None,
                "tokens_per_s": self.steady_tokens_per_s()}

    def steady_tokens_per_s(self) -> Optional[float]:
        seconds = self.last_s - self.steady_start_s if self.steady_start_s is not None else 0.0
        return self.steady_tokens / seconds if seconds > 0 else None

    def figures(self) -> ThroughputFigures:
        overall_s = self.last_s - self.start_s
        return ThroughputFigures(
            tokens_per_s=self.steady_tokens_per_s(),
            overall_tokens_per_s=self.tokens / overall_s if overall_s > 0 else None,
            drafter_tokens_per_s=self.steady_tokens / self.steady_busy_s if self.steady_busy_s > 0 else None,
            warmup_steps=self.warmup_steps,
        )
