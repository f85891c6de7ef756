"""`RunDir`: every path of a run directory's layout, and the one atomic writer its files are written with.

    RUN_DIR/
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
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` so that a reader (or a crash) never sees a half-written file: a temporary file
    beside it, then one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


@dataclass(frozen=True, slots=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

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
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    def training_outputs(self) -> list[Path]:
        """What a training run leaves besides `config.yaml` and `plan/` (a new run may not mix with them)."""
        return [self.checkpoints, self.metrics, self.summary, self.export, self.best, self.eval_json,
                self.tensorboard, self.eval_exports, self.best_tmp, self.report]
