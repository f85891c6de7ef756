"""The run directory: every path of its layout, and its life on disk (create, claim, mark, overwrite, resume).

    RUN_DIR/
      .dflash-run              the marker: this directory is a run dflash-train made (only such a run is replaced)
      .lock                    held (flock) by the one command writing the directory
      config.yaml              the resolved config (resume reads it)
      plan/epoch_N.json        each epoch's jobs; plan/summary.json the data counts; plan/eval.jsonl held out
      metrics.jsonl            one row per optimizer step, one per evaluation
      summary.json             how the run ended, what it trained, how fast
      checkpoints/step_N/      training checkpoints (train/checkpoint.py)
      export/  best/           the final drafter and the best one by tau, in the inference format
      eval.json                the last real-tau evaluation
      report/                  figures and index.html
      tensorboard/             when asked
      .eval/ .best.tmp/        work folders of split evaluation and of the best drafter's export
      .shared-check            a token rank 0 writes and every node must see (the run dir is on shared storage)
      .elastic.json            the incarnations of a job that torchrun may restart

A command that writes a run dir (`train`, `plan`) claims it first (`claim_run_dir`): it takes the lock, so a
second command into the same directory is refused however close in time they start, checks what the
directory holds against what the command may do with it, marks it as a run, and writes `config.yaml`.
"""

from __future__ import annotations

import dataclasses
import difflib
import fcntl
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal, Optional

from dflash_trainer.config import Config, run_config_text
from dflash_trainer.errors import ConfigError

log = logging.getLogger(__name__)

MARKER_FORMAT = "dflash-train-run/1"
_CHECKPOINT_NAME = re.compile(r"step_(\d+)")


def write_atomic(path: Path, text: str | bytes) -> Path:
    """Write `text` (UTF-8, or bytes as they are) to `path` so that a reader (or a crash) never sees a
    half-written file: a temporary file beside it, then one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    os.replace(tmp, path)
    return path


def lock_exclusive(path: Path) -> Optional[IO]:
    """An exclusive lock on the file `path` (created when missing), held until the returned file is closed or the
    process ends (even killed: the kernel drops it); None when another process holds it. One open file per
    holder: a second open in the same process is refused too."""
    handle = open(path, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    except OSError as e:  # a filesystem without locks: two writers could not be told apart
        handle.close()
        raise ConfigError(
            f"cannot lock {path} ({e.strerror or e}): its filesystem does not support flock, which keeps two commands "
            "(or two nodes) from writing the same directory. Mount it with locking (NFS: lockd; Lustre: -o flock) "
            "or use a directory on storage that has it"
        ) from e
    return handle


def input_dir_problem(flag: str, path: str | os.PathLike) -> Optional[str]:
    """What is wrong with an input directory (`--drafter`, `--checkpoint`) that is not there, else None; a missing
    one is named with what its folder holds when that is a run or its checkpoints/ (a typo, a step not kept)."""
    path = Path(path)
    if path.is_dir():
        return None
    if path.exists():
        return f"{flag} {path} is a file; pass the directory"
    folder = path.resolve().parent
    hint = ""
    if folder.is_dir():
        held = sorted(p.name for p in folder.iterdir() if p.is_dir())
        close = difflib.get_close_matches(path.name, held, n=1, cutoff=0.6)
        if folder.name == "checkpoints" or (RunDir(folder).config.is_file() and not close):  # a step not kept
            hint = f" ({folder} holds: {', '.join(held) or 'nothing'})"
        elif close:  # a typo
            hint = f"; did you mean {path.parent / close[0]}?"
    return f"{flag} {path}: no such directory{hint}"


def run_dir_given(flag: str, path: str | os.PathLike, *, checkpoints_only: bool = False) -> Optional[str]:
    """When `path` is a run dir itself, where a folder inside it is expected: what to pass instead, naming the ones
    it holds (`RUN/export`, `RUN/best`, `RUN/checkpoints/step_N`; only checkpoints when `checkpoints_only`)."""
    layout = RunDir(Path(path))
    if not layout.config.is_file():
        return None
    inside = [] if checkpoints_only else [p for p in (layout.export, layout.best) if (p / "config.json").is_file()]
    inside += [p for _, p in layout.checkpoint_dirs() if (p / "COMPLETE").is_file()]
    kinds = "a checkpoint in it (RUN/checkpoints/step_N)" if checkpoints_only else \
        "a drafter in it: RUN/export, RUN/best or a checkpoint, RUN/checkpoints/step_N"
    held = ", ".join(str(p) for p in inside) or "none yet"
    return f"{flag} {path} is a run directory; pass {kinds} (it holds: {held})"


def owned_folder_problem(path: str | os.PathLike, *, allowed: Optional[Path] = None) -> Optional[str]:
    """Why `path` may not take a command's output: it lies inside a folder a run (a marked run dir above it) owns
    and will rewrite or delete (`RunDir.owned_folders`); None where it may. `allowed`: the one owned folder the
    command writes on the run's behalf (`report`'s RUN/report)."""
    path = Path(path).expanduser().resolve()
    for run in path.parents:
        layout = RunDir(run)
        if not layout.is_marked():
            continue
        for folder, fate in layout.owned_folders().items():
            inside = path == folder or folder in path.parents
            if inside and not (allowed is not None and folder == Path(allowed).expanduser().resolve()):
                return (f"it is inside {folder}, which the run in {run} owns: {fate}; give a folder outside it "
                        f"(for example {run / 'exports' / path.name})")
    return None


def check_input_dir(flag: str, path: str | os.PathLike) -> None:
    """`input_dir_problem`, raised."""
    if problem := input_dir_problem(flag, path):
        raise ConfigError(problem)


def save_config(config: Config, run_dir: str | os.PathLike) -> Path:
    """`RUN_DIR/config.yaml`: the resolved config, which resume and the other commands read back."""
    path = RunDir(run_dir).config
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, run_config_text(config))  # a kill mid-write leaves the old config, never half of one

@dataclass(frozen=True, slots=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def marker(self) -> Path:
        return self.root / ".dflash-run"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan"

    def epoch_plan(self, epoch: int) -> Path:
        return self.plan / f"epoch_{epoch}.json"

    @property
    def plan_summary(self) -> Path:
        return self.plan / "summary.json"

    @property
    def eval_conversations(self) -> Path:
        return self.plan / "eval.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step}"

    def checkpoint_dirs(self) -> list[tuple[int, Path]]:
        """(step, folder) of every `checkpoints/step_N` folder, by step; other entries (a `step_3.bak` copy, the
        temporaries of a checkpoint being written) are not checkpoints and are left out."""
        if not self.checkpoints.is_dir():
            return []
        found = []
        for path in self.checkpoints.iterdir():
            match = _CHECKPOINT_NAME.fullmatch(path.name)
            if match and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def best(self) -> Path:
        return self.root / "best"

    @property
    def best_tmp(self) -> Path:
        return self.root / ".best.tmp"

    @property
    def eval_json(self) -> Path:
        return self.root / "eval.json"

    @property
    def eval_exports(self) -> Path:
        """Drafters the leader exports for the target rank to evaluate (split runs)."""
        return self.root / ".eval"

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def shared_check(self) -> Path:
        """Rank 0's token, which every node must see (`runtime/shared_storage.py`)."""
        return self.root / ".shared-check"

    @property
    def restarts(self) -> Path:
        """The incarnations of a job under `torchrun --max-restarts` (`runtime/elastic.py`)."""
        return self.root / ".elastic.json"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    def training_outputs(self) -> list[Path]:
        """What a training run leaves besides `config.yaml` and `plan/` (a new run may not mix with them)."""
        return [self.checkpoints, self.metrics, self.summary, self.export, self.best, self.eval_json,
                self.tensorboard, self.eval_exports, self.best_tmp, self.report]

    def outputs_present(self) -> list[Path]:
        """The training outputs this directory holds (an empty folder, such as the `checkpoints/` a failed start
        made, holds nothing)."""
        return [p for p in self.training_outputs()
                if p.exists() and not (p.is_dir() and not p.is_symlink() and not any(p.iterdir()))]

    def owned_folders(self) -> dict[Path, str]:
        """The folders the run rewrites or deletes by itself, each with what happens to it: a user's output placed
        inside one would be lost without a word."""
        overwrite = "--overwrite deletes it"
        return {
            self.checkpoints: "resuming keeps only the newest train.keep_last checkpoints and deletes the rest "
                              "with what they hold",
            self.export: "the run writes its final drafter there",
            self.best: "the run writes its best drafter there",
            self.best_tmp: "the run writes its best drafter there",
            self.eval_exports: "the run writes drafters to evaluate there",
            self.plan: "plan and train rewrite it",
            self.tensorboard: overwrite,
            self.report: overwrite,
        }

    def is_marked(self) -> bool:
        return self.marker.is_file()

    def trained(self) -> bool:
        """Whether a training step was ever logged or saved here (what a failed start does not leave)."""
        return self.metrics.exists() or bool(self.checkpoint_dirs())


class RunClaim:
    """One command's hold on its run dir, from `claim_run_dir` to `release`: the lock, and whether this command
    created the directory (then a command that fails before training leaves nothing behind)."""

    def __init__(self, path: Path, lock: IO, *, created: bool) -> None:
        self.path = path
        self.layout = RunDir(path)
        self.created = created
        self._lock: Optional[IO] = lock
        self.previous_config: Optional[bytes] = None
        """`config.yaml` as it was before this claim wrote its own (a resume), for `restore_config`: bytes, as they
        were (a damaged file is put back as it was, not decoded)."""

    def restore_config(self) -> None:
        """Put back the `config.yaml` the run had before this claim (a resume that found nothing to do leaves the
        run byte for byte as it was)."""
        if self.previous_config is not None:
            write_atomic(self.layout.config, self.previous_config)

    def release(self, *, failed: bool = False) -> None:
        """Drop the lock; `failed`: the command ended in an error, and a directory it created in which no training
        step was logged or saved is removed (it holds nothing worth keeping)."""
        if failed and self.created and not self.layout.trained():
            shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self) -> "RunClaim":
        return self

    def __exit__(self, kind, error, tb) -> None:
        self.release(failed=kind is not None)


def claim_run_dir(config: Config, purpose: Literal["train", "plan"]) -> RunClaim:
    """Claim the run dir for `dflash-train train` or `plan`: `run.dir`, or a new `runs/<run.name>-<YYYYmmdd-HHMMSS>`.

    Takes the directory's lock (another command writing it is refused), then checks its contents:
    - `train` into a fresh directory, or one that holds only a plan (`dflash-train plan`): it re-plans from its
      own config (the plan's settings may differ); into a training run only with `train.resume` (continue it) or
      `train.overwrite` (its outputs and epoch plans are deleted first; only in a directory marked as a run, so
      files that are not ours are never deleted);
    - `plan`: never into a training run (it would replace the epoch plans that run resumes from).
    Then marks the directory and writes `config.yaml` with `run.dir` filled in, so the saved config resumes in
    the same place."""
    path, created = _choose_path(config)
    layout = RunDir(path)
    try:
        lock = lock_exclusive(layout.lock)
    except ConfigError:  # no locks on that filesystem: leave no directory this call created
        if created:
            shutil.rmtree(path, ignore_errors=True)
        raise
    if lock is None:
        raise ConfigError(f"another dflash-train command is writing run.dir={str(path)!r} (it holds {layout.lock}); "
                          "wait for it to end, or set run.dir to another directory")
    claim = RunClaim(path, lock, created=created)
    try:
        if purpose == "plan":
            _refuse_training_run(layout, "`dflash-train plan` would replace the epoch plans it resumes from: plan "
                                         "into a new run.dir (or train with --resume or --overwrite)")
            _refuse_foreign_files(layout, purpose)
        elif not config.train.resume:
            if not config.train.overwrite:
                _refuse_training_run(layout, "add --resume to continue it, set run.dir to a new directory, or pass "
                                             "--overwrite to replace it")
            _refuse_foreign_files(layout, purpose)
            _clear_for_new_run(layout)
        if not config.train.resume or layout.trained():  # a resume marks only what holds a run to resume
            _writing(path, lambda: _mark(layout))
        resolved = dataclasses.replace(config, run=dataclasses.replace(config.run, dir=str(path)))
        if config.train.resume and layout.config.is_file():
            claim.previous_config = layout.config.read_bytes()
        _writing(path, lambda: save_config(resolved, path))
        if purpose == "train":
            _check_writable(layout.checkpoints)  # now, not at the first checkpoint after hours of training
    except BaseException:
        claim.release(failed=True)
        raise
    return claim


def _choose_path(config: Config) -> tuple[Path, bool]:
    """(the run dir, whether this call created it). An automatic name is created with an exclusive `mkdir`, so
    two commands started in the same second get two directories."""
    if config.run.dir:
        path = Path(config.run.dir).expanduser()
        if path.is_symlink() and not path.exists():
            raise ConfigError(f"run.dir={config.run.dir!r} is a link to {os.readlink(path)!r}, which does not exist: "
                              "create that directory, or set run.dir to another one")
        if path.exists() and not path.is_dir():
            raise ConfigError(f"run.dir={config.run.dir!r} is a file, not a run directory: set run.dir to a new or "
                              "existing directory")
        created = not path.exists()
        _writing(path, lambda: path.mkdir(parents=True, exist_ok=True))
        return path, created
    base = Path("runs") / f"{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    _writing(base.parent, lambda: base.parent.mkdir(parents=True, exist_ok=True))
    path, n = base, 1
    while True:
        try:
            _writing(path, path.mkdir)
            return path, True
        except FileExistsError:
            path, n = base.with_name(f"{base.name}-{n}"), n + 1


def _writing(path: Path, action) -> None:
    """Run `action`, which creates or writes the run dir `path`: an OSError but FileExistsError is a ConfigError."""
    try:
        action()
    except FileExistsError:
        raise
    except OSError as e:
        raise ConfigError(f"cannot create or write the run directory {str(path)!r} ({e.strerror or e}); "
                          "set run.dir to a writable directory") from None


def _refuse_training_run(layout: RunDir, fix: str) -> None:
    found = [p.name for p in layout.outputs_present()]
    if found:
        raise ConfigError(f"run.dir={str(layout.root)!r} holds a training run ({', '.join(found)}): {fix}")


def _refuse_foreign_files(layout: RunDir, purpose: str) -> None:
    """A directory no dflash-train command marked that holds a file a new run writes (`config.yaml`, `plan/`): the
    user's own, which the run would replace."""
    found = [p.name for p in (layout.config, layout.plan) if p.exists()]
    if found and not layout.is_marked():
        raise ConfigError(
            f"run.dir={str(layout.root)!r} holds {', '.join(found)}, which dflash-train did not write (no "
            f"{layout.marker.name} file), and `dflash-train {purpose}` would replace {'it' if len(found) == 1 else 'them'}: "
            "set run.dir to a new or empty directory, or move those files away yourself"
        )


def _clear_for_new_run(layout: RunDir) -> None:
    """Delete a training run's outputs (train.overwrite; checked by the caller) and the epoch plans: a new run plans
    again from its own config."""
    found = layout.outputs_present()
    if found and not layout.is_marked():
        raise ConfigError(
            f"run.dir={str(layout.root)!r} holds {', '.join(p.name for p in found)} but is not a run dflash-train made "
            f"(no {layout.marker.name} file): --overwrite deletes only a run's own outputs; set run.dir to a new "
            "directory, or move those files away yourself"
        )
    if found:
        log.warning("--overwrite: deleting the run in %s (%s) to train a new one there", layout.root,
                    ", ".join(p.name for p in found))
    for path in found:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    stale = sorted(layout.plan.glob("epoch_*.json"))
    if stale and not found:
        log.info("run.dir %s holds a plan: training plans again from its own config", layout.root)
    for plan in stale:
        plan.unlink()


def _mark(layout: RunDir) -> None:
    if not layout.is_marked():
        write_atomic(layout.marker, json.dumps({"format": MARKER_FORMAT}) + "\n")


def _check_writable(folder: Path) -> None:
    probe = folder / f".write-test-{time.time_ns()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"cannot write checkpoints to {str(folder)!r} ({e.strerror or e}); make it writable or set "
                          "run.dir to a writable directory") from None
