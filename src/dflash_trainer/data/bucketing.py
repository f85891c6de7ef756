"""Length buckets and packing of sequences into token-budgeted batches.

A batch is a flat buffer of `token_budget` tokens holding whole sequences back to back (at most `max_seqs`
of them); its waste is the unused tail. First-fit-decreasing puts sequences of similar length together (a
batch takes the longest left, then the longest that still fit) and fills budgets far better than packing in
arrival order.
"""

from __future__ import annotations

import bisect
import random
from typing import Sequence


def assign_buckets(lengths: Sequence[int], num_buckets: int) -> list[list[int]]:
    """Sequence ids split into up to `num_buckets` equal-count buckets by length (bucket 0: shortest).
    Ties are broken by id, so the split is deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    k = max(1, min(num_buckets, len(order)))
    cuts = [round(j * len(order) / k) for j in range(k + 1)]
    return [order[cuts[j] : cuts[j + 1]] for j in range(k) if cuts[j + 1] > cuts[j]]


def pack_first_fit_decreasing(ids: Sequence[int], lengths: Sequence[int], *, token_budget: int,
                              max_seqs: int, rng: random.Random) -> list[list[int]]:
    """Batches of `ids`: take the longest left, then repeatedly add the longest that still fits.

    `rng` breaks ties between equal lengths, so batch contents vary across epochs."""
    shuffled = list(ids)
    rng.shuffle(shuffled)
    # ascending by length; equal lengths keep the shuffled order
    remaining = sorted(shuffled, key=lambda i: lengths[i])
    keys = [lengths[i] for i in remaining]
    batches: list[list[int]] = []
    while remaining:
        first = remaining.pop()
        keys.pop()
        batch, room = [first], token_budget - lengths[first]
        while len(batch) < max_seqs and remaining:
            pos = bisect.bisect_right(keys, room) - 1  # the longest sequence that fits
            if pos < 0:
                break
            chosen = remaining.pop(pos)
            keys.pop(pos)
            batch.append(chosen)
            room -= lengths[chosen]
        batches.append(batch)
    return batches


def pack_in_order(ids: Sequence[int], lengths: Sequence[int], *, token_budget: int, max_seqs: int) -> list[list[int]]:
    """Baseline: fill each batch in the given order, starting a new one when the next sequence does not fit."""
    batches: list[list[int]] = []
    batch: list[int] = []
    used = 0
    for i in ids:
        if batch and (used + lengths[i] > token_budget or len(batch) >= max_seqs):
            batches.append(batch)
            batch, used = [], 0
        batch.append(i)
        used += lengths[i]
    if batch:
        batches.append(batch)
    return batches


def padding_waste(batches: Sequence[Sequence[int]], lengths: Sequence[int], token_budget: int) -> float:
    """1 - real tokens / (batches * token_budget): the share of computed positions that are padding."""
    if not batches:
        return 0.0
    real = sum(lengths[i] for b in batches for i in b)
    return 1.0 - real / (len(batches) * token_budget)
