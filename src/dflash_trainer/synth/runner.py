"""Synthesize conversations chunk by chunk until enough are kept, resumably.

A chunk of attempts goes turn by turn: the target writes every conversation's next user turn from the
user-turn prefix, the filters judge it, and the target answers the turns kept (not after the last one when
`synthesize.answer` is false). A dropped opening drops the attempt (counted by reason); a later turn dropped,
or not answered, ends its conversation before it (counted as cut). The chunk's outcomes are recorded in attempt
order when it ends, up to the last conversation wanted: the attempts after it are not recorded, so a later run
that wants more makes them again. A chunk whose every attempt failed (the server is down or answers nothing
usable) ends the run: the summary says so, and the command names the failures per kind.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from tqdm.auto import tqdm

from dflash_trainer.data.shard_files import read_rows
from dflash_trainer.data.types import Message
from dflash_trainer.regen.failures import Failures, failures
from dflash_trainer.regen.shards import FAILED
from dflash_trainer.regen.turns import RegenOutcome, skipped
from dflash_trainer.synth.config import SynthesizeConfig
from dflash_trainer.synth.filters import Deduplicator, Drop, TurnFilter
from dflash_trainer.synth.store import SynthSettings, SynthStore, row_id
from dflash_trainer.synth.template import UserTurns
from dflash_trainer.synth.writers import Writer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class SynthSummary:
    """What one `synthesize` call left in the output directory."""

    out_dir: str
    wanted: int
    """Conversations asked for (`synthesize.num_prompts`)."""
    kept: int
    """Conversations in the shards (earlier runs included)."""
    new: int
    """Conversations written by this run."""
    attempts: int
    """Openings sampled so far (earlier runs included)."""
    max_attempts: int
    dropped: dict[str, int]
    """Openings dropped, by reason (`filters.REASONS`, or a length limit)."""
    failed: int
    """Attempts whose requests failed (reasons in failed.jsonl)."""
    failures: dict[str, int]
    """`failed` per kind (`regen/failures.py`: `HTTP 500`, `timeout`, `empty reply`, ...)."""
    complete: bool
    """`wanted` conversations are kept, or the filters used up `max_attempts`; False when failed requests
    stopped the run (a rerun continues)."""
    cut: dict[str, int]
    """Conversations ended before `num_turns` user turns, by reason."""
    seconds: float
    """Wall time of this run's writing (the target loaded before it): `new / seconds` is its throughput."""

    def failed_requests(self) -> Failures:
        """The failures, per kind, with what fixes them."""
        return failures(self.failures, str(Path(self.out_dir) / FAILED))


class _Chunk:
    """The conversations of one chunk of attempts while they are written."""

    def __init__(self, attempts: range, system: tuple[Message, ...]) -> None:
        self.messages = {k: list(system) for k in attempts}
        self.ended: dict[int, RegenOutcome] = {}
        """Attempts that keep no row: the opening dropped, or its first answer missing."""
        self.cut: dict[int, str] = {}
        self.active = list(attempts)

    def stop(self, k: int, turn: int, outcome: RegenOutcome) -> None:
        """Attempt k has no user turn `turn` or no answer to it: the attempt ends (turn 0) or its conversation
        is cut there."""
        if turn == 0:
            self.ended[k] = dataclasses.replace(outcome, row_id=row_id(k))  # a writer names the request
        else:
            self.cut[k] = outcome.skipped or "a request failed at a later turn"

    def outcomes(self) -> list[RegenOutcome]:
        return [self.ended.get(k) or RegenOutcome(row_id=row_id(k), messages=tuple(m), error=None,
                                                  cut=self.cut.get(k)) for k, m in self.messages.items()]


def _drop(k: int, drop: Drop) -> RegenOutcome:
    return skipped(row_id(k), drop.reason, drop.detail or drop.reason)


def write_chunk(attempts: range, *, writer: Writer, turns: UserTurns, turn_filter: TurnFilter,
                dedup: Deduplicator, config: SynthesizeConfig) -> list[RegenOutcome]:
    """The outcome of every attempt of the chunk, in order."""
    chunk = _Chunk(attempts, turns.system)
    for turn in range(config.num_turns):
        keys = [f"{row_id(k)}/user{turn}" for k in chunk.active]
        written = writer.write_turns([turns.prefix(chunk.messages[k]) for k in chunk.active], keys)
        still = []
        for k, text in zip(chunk.active, written):
            if isinstance(text, RegenOutcome):
                chunk.stop(k, turn, text)
                continue
            problem = turn_filter.problem(text) or (dedup.problem(text.text.strip()) if turn == 0 else None)
            if problem is not None:
                chunk.stop(k, turn, _drop(k, problem))
                continue
            chunk.messages[k].append(Message(role="user", content=text.text.strip()))
            still.append(k)
        chunk.active = still
        if turn == config.num_turns - 1 and not config.answer:
            break
        keys = [f"{row_id(k)}/reply{turn}" for k in chunk.active]
        replies = writer.answer([tuple(chunk.messages[k]) for k in chunk.active], keys)
        still = []
        for k, reply in zip(chunk.active, replies):
            if isinstance(reply, RegenOutcome):
                chunk.stop(k, turn, reply)
            else:
                chunk.messages[k].append(Message(role="assistant", content=reply))
                still.append(k)
        chunk.active = still
    return chunk.outcomes()


def synthesize(
    *,
    writer: Writer,
    turns: UserTurns,
    config: SynthesizeConfig,
    settings: SynthSettings,
    out_dir: str | Path,
    source: Optional[dict[str, Any]] = None,
    count_tokens: Optional[Callable[[str], int]] = None,
    progress: bool = True,
) -> SynthSummary:
    """Write conversations into `out_dir` until `config.num_prompts` are kept or `config.attempts_cap`
    openings were sampled. Resumable: a rerun with the same settings continues after the attempts made. An
    exception or Ctrl-C still flushes the written rows and the manifest before propagating."""
    store = SynthStore.open(out_dir, settings=settings, shard_rows=config.shard_rows, source=source or {},
                            expected_ids=set(), wanted=config.num_prompts, max_attempts=config.attempts_cap)
    new, start = 0, time.perf_counter()
    try:
        dedup = Deduplicator(config.near_dup_threshold)
        for row in read_rows(out_dir):  # the openings kept by earlier runs
            opening = next((m["content"] for m in row["messages"] if m["role"] == "user"), None)
            if opening is not None:
                dedup.add(opening)
        turn_filter = TurnFilter(config, markers=turns.markers, system_prompt=config.system_prompt,
                                 count_tokens=count_tokens)
        bar = tqdm(total=config.num_prompts, initial=min(store.rows_done, config.num_prompts), unit="conv",
                   desc="synthesize", dynamic_ncols=True, disable=not progress)
        with bar:
            while not store.complete:
                first = store.next_attempt
                size = min(config.batch_size, store.attempts_left)
                outcomes = write_chunk(range(first, first + size), writer=writer, turns=turns,
                                       turn_filter=turn_filter, dedup=dedup, config=config)
                for outcome in outcomes:
                    if store.rows_done >= config.num_prompts:
                        break
                    if outcome.messages is not None:
                        store.add_row(outcome.row_id, outcome.messages, cut=outcome.cut)
                        new += 1
                        bar.update(1)
                    else:
                        store.add_failed(outcome.row_id, outcome.error or "unknown error", skipped=outcome.skipped,
                                         kind=outcome.kind)
                bar.set_postfix(attempts=store.next_attempt, dropped=len(store.skipped), refresh=False)
                if all(o.messages is None and o.skipped is None for o in outcomes):
                    log.warning("synthesize: every request of the last %d attempts failed; stopping", len(outcomes))
                    break
    finally:
        store.close()
    summary = SynthSummary(out_dir=str(out_dir), wanted=config.num_prompts, kept=store.rows_done, new=new,
                           attempts=store.next_attempt, max_attempts=config.attempts_cap, dropped=store.skip_counts,
                           failed=store.rows_failed, failures=store.failure_counts, complete=store.complete,
                           cut=store.cut_counts, seconds=time.perf_counter() - start)
    log.info("synthesize: %d kept of %d attempts; dropped %s; failed %d; cut %s; %d new in %.1f s (%.1f/s)",
             summary.kept, summary.attempts, summary.dropped or "none", summary.failed, summary.cut or "none",
             summary.new, summary.seconds, summary.new / max(summary.seconds, 1e-9))
    return summary

