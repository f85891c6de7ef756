"""The sampling error of tau: prompts are the sampled units (the verification steps of one prompt are not
independent), and tau = sum(committed) / sum(steps) over them is a ratio, whose error is taken linearised:
each prompt contributes (committed_i - tau * steps_i) / sum(steps). Pure Python: `bench/quality/compare.py` and the run
report use it without torch."""

from __future__ import annotations

from typing import Optional, Sequence


def _tau_terms(committed: Sequence[int], steps: Sequence[int]) -> Optional[list[float]]:
    """Each prompt's share of the error of tau; None under 2 prompts or with no step."""
    if len(committed) != len(steps):
        raise ValueError(f"one committed count per prompt and one step count per prompt: got {len(committed)} "
                         f"and {len(steps)}")
    total = sum(steps)
    if len(steps) < 2 or total == 0:
        return None
    tau = sum(committed) / total
    return [(c - tau * s) / total for c, s in zip(committed, steps)]


def _stderr(terms: Sequence[float]) -> float:
    n = len(terms)
    return (sum(t * t for t in terms) * n / (n - 1)) ** 0.5


def tau_stderr(committed: Sequence[int], steps: Sequence[int]) -> Optional[float]:
    """Standard error of tau from per-prompt committed tokens and verification steps."""
    terms = _tau_terms(committed, steps)
    return None if terms is None else _stderr(terms)


def tau_difference_stderr(committed_a: Sequence[int], steps_a: Sequence[int], committed_b: Sequence[int],
                          steps_b: Sequence[int]) -> Optional[float]:
    """Standard error of tau_a - tau_b when both were measured on the same prompts, in the same order: a hard
    prompt is hard for both, so the paired error is smaller than either tau's own."""
    if len(steps_a) != len(steps_b):
        raise ValueError(f"paired evaluations need the same prompts: {len(steps_a)} against {len(steps_b)}")
    a, b = _tau_terms(committed_a, steps_a), _tau_terms(committed_b, steps_b)
    return None if a is None or b is None else _stderr([x - y for x, y in zip(a, b)])


def plus_minus(stderr: Optional[float], digits: int = 3) -> str:
    """` ± 0.123` after a tau, or nothing when its error is unknown."""
    return "" if stderr is None else f" ± {stderr:.{digits}f}"
