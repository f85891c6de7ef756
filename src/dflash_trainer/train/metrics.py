"""Metrics sinks: JSONL always, TensorBoard when asked; disabled sinks are null objects. And the reader of
`metrics.jsonl` that resume and the run report share."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Mapping

from dflash_trainer.rundir import RunDir

log = logging.getLogger(__name__)


RESUMED = "resumed_from_checkpoint"
"""The key of the row a resumed run writes at its checkpoint's step (value 1): where a session started."""


class NullSink:
    def log(self, step: int, values: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink(NullSink):
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        for k, v in values.items():
            row[k] = None if isinstance(v, float) and not math.isfinite(v) else v
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink(NullSink):
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self._writer = SummaryWriter(str(log_dir))

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        for k, v in values.items():
            if isinstance(v, (int, float)):
                self._writer.add_scalar(k, v, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink(NullSink):
    """Weights & Biases (needs the `wandb` package and a login or WANDB_MODE=offline)."""

    def __init__(self, run_dir: Path, *, project: str, config: Mapping[str, Any]) -> None:
        import wandb

        self._run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=dict(config))

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        self._run.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step)

    def close(self) -> None:
        self._run.finish()


class MultiSink(NullSink):
    def __init__(self, sinks: list[NullSink]) -> None:
        self.sinks = sinks

    def log(self, step: int, values: Mapping[str, Any]) -> None:
        for s in self.sinks:
            s.log(step, values)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


def build_sinks(run_dir: Path, *, tensorboard: bool, wandb: bool, enabled: bool, wandb_project: str = "dflash-trainer",
                config: Mapping[str, Any] | None = None) -> NullSink:
    """Sinks for rank 0 (`enabled`); other ranks get a null sink."""
    if not enabled:
        return NullSink()
    sinks: list[NullSink] = [JsonlSink(RunDir(run_dir).metrics)]
    if tensorboard:
        try:
            sinks.append(TensorBoardSink(RunDir(run_dir).tensorboard))
        except ImportError:
            log.warning("logging.tensorboard=true but the tensorboard package is missing: pip install tensorboard")
    if wandb:
        try:
            sinks.append(WandbSink(run_dir, project=wandb_project, config=config or {}))
        except ImportError:
            log.warning("logging.wandb=true but the wandb package is missing: pip install wandb")
    return MultiSink(sinks)


def read_metrics(path: Path, *, upto: int | None = None) -> list[dict[str, Any]]:
    """The rows of a `metrics.jsonl` as a run's history: a cut last line (a killed run) is left out, and where a
    resumed run wrote a step again, the later row replaces the earlier one and the rows after it (the steps
    that resume trained again). `upto`: only rows of steps <= upto.

    Damaged lines (not UTF-8, not JSON) are left out and counted in one warning naming the file: the rest of
    the history is still good, and resume rewrites the file without them. Only the last line, cut by a kill
    mid-write, is left out without a warning."""
    if not path.is_file():
        return []
    rows: list[dict[str, Any]] = []
    last_step = 0  # of the training rows so far
    foreign = damaged = 0
    first_damaged = None
    lines = path.read_bytes().split(b"\n")
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            if lineno == len(lines):  # no newline after it: the line a killed run was writing
                log.info("left out the cut last line of %s (a run stopped while writing it)", path)
            else:
                damaged += 1
                first_damaged = first_damaged or lineno
            continue
        step = row.get("step", 0) if isinstance(row, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            foreign += 1  # not an object with an integer step: not a row we wrote
            continue
        if upto is not None and step > upto:
            continue
        if "loss" in row:  # a training step: a resume restarts the history at its step
            if step <= last_step:
                rows = [r for r in rows if r.get("step", 0) < step]
            last_step = step
        rows.append(row)
    if damaged:
        log.warning("left out %d damaged line%s of %s (not UTF-8 or not JSON; the first is line %d): their steps "
                    "are missing from the history", damaged, "s" if damaged > 1 else "", path, first_damaged)
    if foreign:
        log.warning("left out %d rows of %s that are not objects with an integer step (not rows we wrote)",
                    foreign, path)
    return rows
