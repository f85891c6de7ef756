"""The `--out DIR` of regenerate, eval, export and report: checked before the work, so minutes of decoding or
drawing are never lost to a path that cannot take the result."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional

from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import owned_folder_problem


def checked_out_dir(out: str | Path, *, flag: str = "--out", owned_ok: Optional[Path] = None) -> Path:
    """`out` as a Path, when it is a directory or can become one, this process can write there, and no run will
    rewrite or delete it (not inside a run's checkpoints, export, plan...; `owned_ok`: the one run folder this
    command writes for the run); else a ConfigError naming the path, why, and the fix. Nothing is created: a probe
    file in the nearest existing folder is removed at once."""
    path = Path(out).expanduser()
    problem = owned_folder_problem(path, allowed=owned_ok)
    if problem is not None:
        raise ConfigError(f"{flag} {out}: {problem}")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {out} is a file; give a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {out} is inside {existing}, which is a file, not a folder; give a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {out}: cannot write in {existing} ({e.strerror or e}); give a writable "
                          "directory") from None
    return path


def check_replaces_only_ours(flag: str, out: str | Path, found: list[str], command: str) -> None:
    """`found`: the files of `out` that `command` would write over and that it did not write (a user's own): refused,
    naming them, before the work."""
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise ConfigError(f"{flag} {out} already holds {shown}, which dflash-train {command} did not write; it would "
                          "replace them: give a new or empty folder, or move those files away yourself")
