"""The output directory of `dflash-train regenerate`: JSONL shards, a failure log and a manifest.

Layout of DIR:
- `shard_00000.jsonl`, ...: one row per line, `{"messages": [{"role", "content"}, ...], "id": "<source>:<index>"}`,
  plus `"cut": LIMIT` when a limit ended the conversation before its last user turn (the answered turns are kept).
  Only the last shard is ever appended to; each row is one write of one line, flushed.
- `failed.jsonl`: `{"id", "reason", "kind"}` per failed row (latest attempt; `kind`: why, short, counted in the
  manifest's `failures`); a row left out by a limit (a prompt over `regenerate.max_prompt_tokens`) is skipped, not
  failed: its entry has `"skipped": LIMIT` instead of a kind.
- `manifest.json`: settings, source info and counts, written atomically (tmp + os.replace). `complete` is true
  once every row is written, skipped, or failed for a reason a rerun would meet again (`failures.PERMANENT`): a
  row that failed on a server fault leaves it false until a rerun writes it.

The shards are the truth: on resume their ids are skipped, a partially written last line (a crash or
Ctrl-C mid-write) is truncated, and the manifest's counts are recomputed. Rows that failed or were skipped
before are tried again. A lock file keeps two runs from writing one directory.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_trainer.data.shard_files import complete_lines, parse_row, shard_name, shard_paths
from dflash_trainer.data.types import Message
from dflash_trainer.errors import DataError
from dflash_trainer.regen.failures import OTHER, PERMANENT, kind_of_reason
from dflash_trainer.regen.settings import FAILED_LOG, MANIFEST, RegenSettings, read_manifest, settings_differences
from dflash_trainer.regen.turns import as_dicts
from dflash_trainer.rundir import lock_exclusive

log = logging.getLogger(__name__)

FORMAT = "dflash-regenerate/1"
FAILED = FAILED_LOG
LOCK = ".lock"
MANIFEST_EVERY_S = 10.0
"""Rewrite the manifest at least this often while rows arrive (and at every shard boundary)."""


def _atomic_write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RegenStore:
    """Appends rows and failures to DIR; `open` resumes, `close` writes the final manifest."""

    COMMAND = "regenerate"
    """The command that writes such a directory (named when a second writer is refused)."""

    def __init__(
        self,
        out_dir: Path,
        *,
        settings: RegenSettings,
        shard_rows: int,
        source: dict[str, Any],
        expected_ids: set[str],
    ) -> None:
        self.out_dir = out_dir
        self.settings = settings
        self.shard_rows = shard_rows
        self.source = source
        self.expected_ids = expected_ids
        """Ids of this run's input conversations: `complete` when each is written or failed."""
        self.done_ids: set[str] = set()
        self.failed: dict[str, str] = {}
        self.skipped: dict[str, str] = {}
        """Rows left out by a limit: id -> the limit (their reasons are in `failed`)."""
        self.kinds: dict[str, str] = {}
        """Failed rows (not skipped): id -> the kind of the failure (`regen/failures.py`)."""
        self.cut: dict[str, str] = {}
        """Rows written short, ended by a limit before their last user turn: id -> the limit."""
        self._shard_counts: list[int] = []
        self._file = None
        self._failed_file = None
        self._lock_file = None
        self._last_manifest = 0.0

    @classmethod
    def open(
        cls,
        out_dir: str | Path,
        *,
        settings: RegenSettings,
        shard_rows: int,
        source: dict[str, Any],
        expected_ids: set[str],
        **extra: Any,
    ) -> "RegenStore":
        """The store of `out_dir`, locked and scanned; `extra`: a subclass's own constructor arguments."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        store = cls(out, settings=settings, shard_rows=shard_rows, source=source, expected_ids=expected_ids, **extra)
        store._lock()
        try:
            store._check_dir()
            store._scan()
            store.write_manifest()
        except BaseException:
            store._unlock()
            raise
        return store

    def _lock(self) -> None:
        self._lock_file = lock_exclusive(self.out_dir / LOCK)
        if self._lock_file is None:
            raise DataError(f"another `dflash-train {self.COMMAND}` is writing {self.out_dir}; wait for it or use a "
                            "new --out")

    def _unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing releases the flock
            self._lock_file = None

    def _check_dir(self) -> None:
        try:
            manifest = read_manifest(self.out_dir)
        except DataError as e:  # the rows are intact: resume from them, the manifest is written anew
            log.warning("%s/%s is damaged (%s): resuming from the rows written; the manifest is written anew with "
                        "this run's settings (the earlier run's could not be compared)", self.out_dir, MANIFEST,
                        getattr(e, "damage", e))
            return
        if manifest is None:
            others = [p.name for p in self.out_dir.iterdir() if p.name not in (LOCK, MANIFEST + ".tmp")]
            if others:
                raise DataError(
                    f"--out {self.out_dir} is not empty ({', '.join(sorted(others)[:3])}, ...) and has no {MANIFEST}; "
                    "give a new or empty directory"
                )
            return
        if manifest.get("format") != FORMAT:
            raise DataError(f"{self.out_dir}/{MANIFEST} has format {manifest.get('format')!r}, expected {FORMAT!r}")
        written_for, asked_for = manifest.get("source", {}).get("data"), self.source.get("data")
        if written_for is not None and asked_for is not None and written_for != asked_for:
            raise DataError(
                f"cannot resume into {self.out_dir}: it holds the answers to {written_for}, not to {asked_for} (rows "
                "are keyed by their source, so another source is another output). Give a new --out directory"
            )
        diffs = settings_differences(manifest.get("settings", {}), self.settings)
        if diffs:
            raise DataError(
                f"cannot resume into {self.out_dir}: it was regenerated with other settings ("
                + "; ".join(diffs)
                + "). Give a new --out directory for these settings, or rerun with the directory's settings to resume."
            )

    def _scan(self) -> None:
        paths = shard_paths(self.out_dir)
        for path in paths:
            count = 0
            for lineno, line in enumerate(complete_lines(path, repair=True), 1):
                row = parse_row(path, lineno, line)
                rid = row["id"]
                if row.get("cut"):
                    self.cut[rid] = row["cut"]
                if rid in self.done_ids:
                    raise DataError(f"{path}:{lineno}: row {rid!r} appears twice; the directory was edited by hand")
                self.done_ids.add(rid)
                count += 1
            self._shard_counts.append(count)
        failed_path = self.out_dir / FAILED
        if failed_path.is_file():
            for lineno, line in enumerate(complete_lines(failed_path, repair=True), 1):
                entry = parse_row(failed_path, lineno, line)
                self._note_failed(entry["id"], entry.get("reason", ""), entry.get("skipped"),
                                  entry.get("kind") or kind_of_reason(entry.get("reason", "")))
        for rid in self.done_ids:
            self._forget_failed(rid)
        if self.done_ids:
            log.info("%s: resuming with %d rows already written", self.out_dir, len(self.done_ids))

    @property
    def rows_done(self) -> int:
        return len(self.done_ids)

    @property
    def rows_failed(self) -> int:
        """Rows that failed (a skipped row is not counted here)."""
        return len(self.failed) - len(self.skipped)

    @property
    def skip_counts(self) -> dict[str, int]:
        """Skipped rows per limit."""
        return dict(Counter(self.skipped.values()))

    @property
    def cut_counts(self) -> dict[str, int]:
        """Rows written short, per limit."""
        return dict(Counter(self.cut.values()))

    @property
    def failure_counts(self) -> dict[str, int]:
        """Failed rows per kind."""
        return dict(Counter(self.kinds.values()))

    def settled(self, rid: str) -> bool:
        """Written, skipped, or failed for a reason a rerun would meet again: nothing left to do for it."""
        return rid in self.done_ids or rid in self.skipped or self.kinds.get(rid) in PERMANENT

    @property
    def complete(self) -> bool:
        """Every row is settled: a row failed on a server fault is missing until a rerun writes it."""
        return all(self.settled(i) for i in self.expected_ids)

    @property
    def rows_missing(self) -> int:
        """Rows not settled yet: a rerun asks for them."""
        return sum(not self.settled(i) for i in self.expected_ids)

    def add_row(self, rid: str, messages: tuple[Message, ...], cut: str | None = None) -> None:
        """A regenerated row; `cut`: the limit that ended it before its last user turn, if one did."""
        if rid in self.done_ids:
            raise RuntimeError(f"row {rid!r} is already written; the runner must skip it")
        if self._file is None:
            if not self._shard_counts or self._shard_counts[-1] >= self.shard_rows:
                self._shard_counts.append(0)
            self._file = open(self.out_dir / shard_name(len(self._shard_counts) - 1), "a", encoding="utf-8")
        row = {"messages": as_dicts(messages), "id": rid} | ({"cut": cut} if cut else {})
        line = json.dumps(row, ensure_ascii=False) + "\n"
        self._file.write(line)  # one write of one whole line: a crash leaves at most this line partial
        self._file.flush()
        self.done_ids.add(rid)
        self._forget_failed(rid)
        if cut:
            self.cut[rid] = cut
        self._shard_counts[-1] += 1
        if self._shard_counts[-1] >= self.shard_rows:
            self._close_shard()
            self.write_manifest()
        self._maybe_write_manifest()

    def add_failed(self, rid: str, reason: str, skipped: str | None = None, kind: str | None = None) -> None:
        """A row that failed (`kind`: why, short), or was `skipped` by that limit."""
        kind = None if skipped else kind or OTHER
        if self._failed_file is None:
            self._failed_file = open(self.out_dir / FAILED, "a", encoding="utf-8")
        self._failed_file.write(json.dumps(self._failed_entry(rid, reason, skipped, kind), ensure_ascii=False) + "\n")
        self._failed_file.flush()
        self._note_failed(rid, reason, skipped, kind)
        log.debug("row %s %s: %s", rid, "skipped" if skipped else "failed", reason)
        self._maybe_write_manifest()

    def _note_failed(self, rid: str, reason: str, skipped: str | None, kind: str | None) -> None:
        self._forget_failed(rid)
        self.failed[rid] = reason
        if skipped:
            self.skipped[rid] = skipped
        else:
            self.kinds[rid] = kind or OTHER

    def _forget_failed(self, rid: str) -> None:
        self.failed.pop(rid, None)
        self.skipped.pop(rid, None)
        self.kinds.pop(rid, None)

    @staticmethod
    def _failed_entry(rid: str, reason: str, skipped: str | None, kind: str | None) -> dict[str, str]:
        return {"id": rid, "reason": reason} | ({"skipped": skipped} if skipped else {"kind": kind or OTHER})

    def _close_shard(self) -> None:
        if self._file is not None:
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def _maybe_write_manifest(self) -> None:
        if time.monotonic() - self._last_manifest >= MANIFEST_EVERY_S:
            if self._file is not None:
                os.fsync(self._file.fileno())
            self.write_manifest()

    def manifest(self) -> dict[str, Any]:
        """What `manifest.json` holds now."""
        return {
            "format": FORMAT,
            "settings": self.settings.to_dict(),
            "source": self.source,
            "rows_total": len(self.expected_ids),
            "rows_done": self.rows_done,
            "rows_failed": self.rows_failed,
            "failures": self.failure_counts,
            "rows_missing": self.rows_missing,
            "rows_skipped": self.skip_counts,
            "rows_cut": self.cut_counts,
            "complete": self.complete,
            "shards": [{"file": shard_name(i), "rows": n} for i, n in enumerate(self._shard_counts) if n],
            "failed_log": FAILED,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }

    def write_manifest(self) -> None:
        _atomic_write_json(self.out_dir / MANIFEST, self.manifest())
        self._last_manifest = time.monotonic()

    def close(self) -> None:
        """Flush everything, rewrite `failed.jsonl` with one line per still-failed row, write the manifest."""
        try:
            self._close_shard()
            if self._failed_file is not None:
                self._failed_file.close()
                self._failed_file = None
            failed_path = self.out_dir / FAILED
            if self.failed or failed_path.exists():
                tmp = failed_path.with_name(FAILED + ".tmp")
                with open(tmp, "w", encoding="utf-8") as f:
                    for rid, reason in self.failed.items():
                        entry = self._failed_entry(rid, reason, self.skipped.get(rid), self.kinds.get(rid))
                        f.write(json.dumps(entry, ensure_ascii=False) + "\n")
                os.replace(tmp, failed_path)
            self.write_manifest()
        finally:
            self._unlock()
