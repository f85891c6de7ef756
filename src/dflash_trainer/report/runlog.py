"""What a run directory says about its run, read for the report: config, summary, metrics, last evaluation.

Every file may be missing or partial (a killed run has no summary, a cut last metrics line); the metrics are
read as resume reads them (`train/metrics.py: read_metrics`), so a resumed run's repeated steps appear once.
A damaged file (not UTF-8, cut short, not what we write) is left out with a warning naming it: the report shows
what the other files hold, rather than nothing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from dflash_trainer.rundir import RunDir
from dflash_trainer.train.metrics import RESUMED, read_metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunLog:
    run_dir: Path
    config: dict[str, Any]
    """The resolved `config.yaml` ({} when missing)."""
    summary: dict[str, Any]
    """`summary.json` ({} for a run that was killed before writing it)."""
    steps: list[dict[str, Any]]
    """One metrics row per optimizer step, in step order."""
    evals: list[dict[str, Any]]
    """The evaluation rows (`eval_tau`, `val_*`), in step order."""
    last_eval: Optional[dict[str, Any]]
    """`eval.json`: the last real-tau evaluation, with its acceptance histograms."""
    resumes: tuple[int, ...] = ()
    """The steps a resumed session of the run started from (its checkpoint's), in order."""

    def series(self, key: str, rows: Optional[list[dict[str, Any]]] = None) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows that hold `key` with a number."""
        xs, ys = [], []
        for row in self.steps if rows is None else rows:
            value = row.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                xs.append(row["step"])
                ys.append(float(value))
        return xs, ys


def _json(path: Path) -> Optional[dict[str, Any]]:
    """The JSON object in `path`: None when missing, or damaged (with a warning naming it)."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        log.warning("left %s out of the report: unreadable or damaged (%s: %s)", path, type(e).__name__, e)
        return None
    if not isinstance(value, dict):
        log.warning("left %s out of the report: a JSON %s, not the object we write", path, type(value).__name__)
        return None
    return value


def _config(path: Path) -> dict[str, Any]:
    """The run's resolved config: {} when missing, or damaged (with a warning naming it)."""
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:  # UnicodeDecodeError is a ValueError
        log.warning("left %s out of the report: unreadable or damaged (%s)", path, str(e).splitlines()[0])
        return {}
    if not isinstance(config, dict):
        log.warning("left %s out of the report: not the mapping we write", path)
        return {}
    return config


MARKERS = ("loss", "eval_tau", "val_walk_tau")
"""Keys whose presence makes a row a training step or an evaluation: kept (as None) when their value is bad."""


def _figure_value(value: Any) -> bool:
    """A value the figures can use: a number (a flag: a bool), or a list of numbers."""
    if isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def _typed(row: dict[str, Any]) -> dict[str, Any]:
    """The row without the values of a wrong type (a hand edit, another tool), which no figure can draw."""
    kept = {k: v for k, v in row.items() if _figure_value(v)}
    return kept | {k: None for k in MARKERS if k in row and k not in kept}


def read_run(run_dir: str | Path) -> RunLog:
    run_dir = Path(run_dir)
    layout = RunDir(run_dir)
    rows = [_typed(r) for r in read_metrics(layout.metrics)]
    return RunLog(
        run_dir=run_dir,
        config=_config(layout.config),
        summary=_json(layout.summary) or {},
        steps=[r for r in rows if "loss" in r],
        evals=[r for r in rows if "eval_tau" in r or "val_walk_tau" in r],
        last_eval=_json(layout.eval_json),
        resumes=tuple(r["step"] for r in rows if r.get(RESUMED) == 1),
    )
