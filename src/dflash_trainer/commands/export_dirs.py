"""The folders `dflash-train export` writes (`--out`, `--save-target`): never one holding files we did not make, and
nothing left behind by an export that fails.

Each folder an export writes is marked (`.dflash-export`, naming what it holds: a drafter or a saved target), so a
later export may replace it; any other non-empty folder (a model of the user's, a run dir, an unrelated file) is
refused before the work, naming it and the fix. The files are written into a staging folder beside the destination
and moved into place only when every one of them was written: a refused or failed export leaves the destination as
it was.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal, Optional

from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import RunDir

MARKER = ".dflash-export"
MARKER_FORMAT = "dflash-train-export/1"
Kind = Literal["drafter", "target"]
_WHAT = {"drafter": "a drafter export", "target": "a target saved by --save-target"}


def marked_kind(folder: Path) -> Optional[str]:
    """What an export of ours wrote in `folder` (its marker's kind), None when it is not marked as ours."""
    try:
        marker = json.loads((Path(folder) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        return None
    return marker.get("kind")


def foreign_folder_problem(folder: Path, flag: str, kind: Kind) -> Optional[str]:
    """Why the export may not write `kind` into `folder`: it holds files that an export of the same kind did not
    write there (a model of the user's, a run dir, anything else); None when it is missing, empty, or ours."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        return None
    found = marked_kind(folder)
    if found == kind:
        return None
    if found in _WHAT:
        return (f"{flag} {folder} holds {_WHAT[found]}, which {_WHAT[kind]} would replace: give another folder "
                "(or delete that one yourself)")
    if RunDir(folder).is_marked() or RunDir(folder).config.is_file():
        return (f"{flag} {folder} is a run directory, and the export would write over its files: give a new folder "
                f"(for example {folder / 'exports' / 'NAME'})")
    names = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"{flag} {folder} already holds files that dflash-train did not write ({shown}); the export would "
            "replace them: give a new or empty folder, or move those files away yourself")


def check_export_dirs(out: Path, save_target: Optional[Path]) -> None:
    """`--out` and `--save-target` may take the export: neither holds files we did not make, and they are two
    separate folders (the same one, or one inside the other, would write the target over the drafter or beside it
    in a folder a loader reads as one model)."""
    if problem := foreign_folder_problem(out, "--out", "drafter"):
        raise ConfigError(problem)
    if save_target is None:
        return
    a, b = Path(out).expanduser().resolve(), Path(save_target).expanduser().resolve()
    if a == b or a in b.parents or b in a.parents:
        how = (f"--save-target {save_target} and --out {out} are the same folder" if a == b else
               f"--save-target {save_target} is inside --out {out}" if a in b.parents else
               f"--save-target {save_target} contains --out {out}")
        raise ConfigError(f"{how}: the target saved there would be written over (or beside) the drafter; give two "
                          "separate folders, e.g. --out runs/demo-export --save-target runs/demo-target")
    if problem := foreign_folder_problem(save_target, "--save-target", "target"):
        raise ConfigError(problem)


@contextmanager
def staged(final: Path, kind: Kind) -> Iterator[Path]:
    """A staging folder beside `final` to write into; when the block ends without an error it is marked as `kind`
    and moved to `final` (replacing the earlier export of ours there), else it is deleted with any folder above it
    that this call created. Call `check_export_dirs` first: `final` is replaced without another look."""
    final = Path(final).expanduser()
    if final.is_symlink():  # a link to a folder elsewhere: replace the folder it names, keep the link
        final = final.resolve()
    created = _missing_parents(final)
    stage = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir()
    except OSError as e:
        raise ConfigError(f"cannot write beside {final} ({e.strerror or e}), where the export is staged before it "
                          f"replaces the folder: make {final.parent} writable, or give a folder in a writable place") \
            from None
    try:
        yield stage
        (stage / MARKER).write_text(json.dumps({"format": MARKER_FORMAT, "kind": kind}) + "\n")
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for folder in created:  # deepest first: only folders this call made, and only while empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    _move_into_place(stage, final)


def _missing_parents(path: Path) -> list[Path]:
    """The folders above `path` that do not exist yet, deepest first."""
    missing = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    return missing


def _move_into_place(stage: Path, final: Path) -> None:
    """`stage` renamed to `final`; an existing `final` (empty, or an export of ours) is moved aside first and
    deleted once the new one is in place."""
    if not final.exists():
        os.replace(stage, final)
        return
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(stage, final)
    shutil.rmtree(old, ignore_errors=True)
