"""Drive a backend over the conversations not yet in the output directory, with a progress bar."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

from tqdm.auto import tqdm

from dflash_trainer.data.types import Conversation
from dflash_trainer.regen.failures import Failures, failures
from dflash_trainer.regen.settings import RegenSettings
from dflash_trainer.regen.shards import FAILED, RegenStore
from dflash_trainer.regen.turns import RegenOutcome, row_id

log = logging.getLogger(__name__)


class Backend(Protocol):
    """Answers conversations with the target; outcomes may come back in any order."""

    def run(self, conversations: Iterable[Conversation]) -> Iterator[RegenOutcome]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RegenSummary:
    """What one `regenerate` call left in the output directory."""

    out_dir: str
    rows_total: int
    """Rows this run asks for: distinct input conversations x regenerate.num_samples."""
    rows_done: int
    """Rows in the shards (earlier runs included)."""
    rows_failed: int
    """Rows whose latest attempt failed (reasons in `failed.jsonl`)."""
    failures: dict[str, int]
    """`rows_failed` per kind (`regen/failures.py`: `HTTP 500`, `timeout`, `empty reply`, ...)."""
    rows_skipped: dict[str, int]
    """Rows left out by a limit (a prompt over `regenerate.max_prompt_tokens`), per limit; not failures."""
    rows_cut: dict[str, int]
    """Rows written short: a limit ended the conversation before its last user turn (per limit)."""
    rows_new: int
    """Rows written by this run."""
    rows_missing: int
    """Rows not settled: not written, not skipped, and not failed for a reason a rerun would meet again (0 when
    `complete`); a rerun asks for them."""
    complete: bool
    """Every input conversation is written, skipped, or failed for a reason a rerun would meet again (a refusal,
    an unusable conversation): False while a server fault left rows a rerun can write."""

    @property
    def failed_log(self) -> str:
        return str(Path(self.out_dir) / FAILED)

    def failed_requests(self) -> Failures:
        """The failures, per kind, with what fixes them."""
        return failures(self.failures, self.failed_log)


def _distinct(conversations: Iterable[Conversation]) -> list[Conversation]:
    """The conversations with repeated ids dropped (a weighted mix may repeat rows; each is answered once)."""
    seen: set[str] = set()
    kept = []
    for conv in conversations:
        rid = row_id(conv)
        if rid not in seen:
            seen.add(rid)
            kept.append(conv)
    return kept


def regenerate(
    conversations: Iterable[Conversation],
    *,
    backend: Backend,
    out_dir: str | Path,
    settings: RegenSettings,
    shard_rows: int = 256,
    source: dict[str, Any] | None = None,
    progress: bool = True,
) -> RegenSummary:
    """Answer every conversation not yet in `out_dir` with `backend`, appending rows as they finish;
    `settings.num_samples` times each (row ids `<id>`, `<id>#1`, ...).

    Resumable: rerunning with the same settings skips the rows already written. An exception or
    Ctrl-C still flushes the written rows and the manifest before propagating.
    """
    convs = list(conversations)
    distinct = _distinct(convs)
    if len(distinct) < len(convs):
        log.info("regenerate: %d repeated conversation ids answered once", len(convs) - len(distinct))
    todo_all = [dataclasses.replace(c, sample=k) for c in distinct for k in range(settings.num_samples)]
    store = RegenStore.open(
        out_dir,
        settings=settings,
        shard_rows=shard_rows,
        source=source or {},
        expected_ids={row_id(c) for c in todo_all},
    )
    new = 0
    try:
        todo = [c for c in todo_all if row_id(c) not in store.done_ids]
        bar = tqdm(
            total=len(todo_all),
            initial=len(todo_all) - len(todo),
            unit="row",
            desc="regenerate",
            dynamic_ncols=True,
            disable=not progress,
        )
        with bar:
            for outcome in backend.run(todo):
                if outcome.messages is not None:
                    store.add_row(outcome.row_id, outcome.messages, cut=outcome.cut)
                    new += 1
                else:
                    store.add_failed(outcome.row_id, outcome.error or "unknown error", skipped=outcome.skipped,
                                     kind=outcome.kind)
                bar.update(1)
                bar.set_postfix(failed=store.rows_failed, skipped=len(store.skipped), cut=len(store.cut),
                                refresh=False)
    finally:
        store.close()
    return RegenSummary(
        out_dir=str(out_dir),
        rows_total=len(store.expected_ids),
        rows_done=store.rows_done,
        rows_failed=store.rows_failed,
        failures=store.failure_counts,
        rows_skipped=store.skip_counts,
        rows_cut=store.cut_counts,
        rows_new=new,
        rows_missing=store.rows_missing,
        complete=store.complete,
    )
