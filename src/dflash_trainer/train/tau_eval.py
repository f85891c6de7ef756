"""Real tau during training (colocated: the live drafter against the target this rank already holds),
and checkpoint selection by tau: the best drafter so far is exported to `RUN_DIR/best/`.

Loss can keep falling while tau falls, so the drafter to ship is chosen on tau, not on loss.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from dflash_trainer.eval.drafter_eval import evaluate_drafter
from dflash_trainer.eval.evaluate import EvalReport, load_prompt_messages
from dflash_trainer.target.head import TargetHead

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class TauSummary:
    """The latest real-tau evaluation and the best so far (the run summary's `eval`; sent between ranks)."""

    step: int
    """Optimizer step of the latest evaluation."""
    tau: float
    greedy_match_rate: Optional[float]
    """Prompts whose speculative output equals plain target decoding (temperature 0), else None."""
    best_tau: float
    best_step: int
    best_dir: str
    """`RUN_DIR/best`: the best drafter by tau, in the inference format."""
    acceptance_histogram: list[int]


@dataclass
class TauRecord:
    step: int
    tau: float


class TauTracker:
    """Runs `evaluate_drafter` on the held-out prompts; remembers the best tau and exports that drafter."""

    def __init__(self, config: Any, *, target, tokenizer, head: TargetHead, prompts_path: Path, run_dir: Path) -> None:
        self.config = config
        self.target = target
        self.tokenizer = tokenizer
        self.head = head
        self.prompts = load_prompt_messages(prompts_path, config.eval.num_prompts)
        self.run_dir = Path(run_dir)
        self.history: list[TauRecord] = []
        self.best: Optional[TauRecord] = None
        self.last_report: Optional[EvalReport] = None

    def evaluate(self, model, step: int, *, export: Callable[[Path], object], sink=None) -> EvalReport:
        """Tau of `model` (a DFlashDrafter) at optimizer step `step`; `export(dir)` writes that drafter in the
        inference format (used when it is the best so far); `sink` logs the result (None: not logged here)."""
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                report = evaluate_drafter(self.config, self.target, self.tokenizer, model, self.prompts, head=self.head)
        finally:
            model.train(was_training)
        self.history.append(TauRecord(step=step, tau=report.tau))
        self.last_report = report
        if sink is not None:
            sink.log(step, {"eval_tau": report.tau, "eval_greedy_match_rate": report.greedy_match_rate})
        log.info("step %d: real tau %.3f on %d held-out prompts", step, report.tau, report.prompts)
        if self.best is None or report.tau > self.best.tau:
            self.best = TauRecord(step=step, tau=report.tau)
            self._save_best(export, step, report)
        return report

    def finish(self, model, step: int, *, export: Callable[[Path], object], sink=None) -> TauSummary:
        """Evaluate the final drafter (unless just done), write `RUN_DIR/eval.json`, return the summary entry."""
        if not self.history or self.history[-1].step != step:
            self.evaluate(model, step, export=export, sink=sink)
        return self.summary(step)

    def summary(self, step: int) -> TauSummary:
        """The latest evaluation (also written to `RUN_DIR/eval.json`) and the best so far."""
        report = self.last_report
        (self.run_dir / "eval.json").write_text(json.dumps({"step": step, **report.to_json()}, indent=2))
        return TauSummary(step=step, tau=report.tau, greedy_match_rate=report.greedy_match_rate, best_tau=self.best.tau,
                          best_step=self.best.step, best_dir=str(self.run_dir / "best"),
                          acceptance_histogram=list(report.acceptance_histogram))

    def _save_best(self, export: Callable[[Path], object], step: int, report: EvalReport) -> None:
        best = self.run_dir / "best"
        tmp = self.run_dir / ".best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        export(tmp)
        (tmp / "eval.json").write_text(json.dumps({"step": step, **report.to_json()}, indent=2))
        shutil.rmtree(best, ignore_errors=True)
        tmp.rename(best)
