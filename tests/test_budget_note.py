"""What ends a run is said at its start: the data's epochs or train.max_steps (and train.max_minutes when set)."""

from __future__ import annotations

import logging

from pipeline_helpers import train_in_process

from dflash_trainer.config import load_config
from dflash_trainer.train.trainer import budget_note, planned_steps


def _config(*overrides: str):
    return load_config("demo", ["train.grad_accum=1", *overrides])


def test_the_budget_that_binds_is_named_with_what_the_other_allows():
    epochs_first = budget_note(_config("train.max_steps=30", "train.num_epochs=1"), 18, 1, 0)
    assert epochs_first.startswith("the data ends this run at step 18") and "before train.max_steps=30" in epochs_first
    assert "raise train.num_epochs" in epochs_first
    steps_first = budget_note(_config("train.max_steps=10"), 18, 1, 0)
    assert steps_first.startswith("train.max_steps=10 ends this run at step 10") and "would allow 18" in steps_first
    two_drafters = budget_note(_config("train.max_steps=null"), 18, 2, 4)  # resumed at step 4, 2 drafter ranks
    assert two_drafters.startswith("the data ends this run at step 13")
    assert planned_steps(_config("train.max_steps=null"), 18, 2, 4) == 13  # the schedule spans what the note says
    minutes = budget_note(_config("train.max_steps=null", "train.max_minutes=5"), 18, 1, 0)
    assert minutes.endswith("unless train.max_minutes=5.0 runs out first")


def test_a_run_says_it_at_the_start(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dflash_trainer.runtime.drafter_role"):
        assert train_in_process(tmp_path / "run", "train.max_steps=1000", "train.grad_accum=1") == 0
    (note,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("budget:")]
    assert "the data ends this run at step" in note and "before train.max_steps=1000" in note
