"""A resume is the same run: `train --resume run.dir=RUN` reads RUN/config.yaml; overrides may change budgets,
cadence, evaluation, logging, placement and speed settings (applied, printed, kept in config.yaml and the summary);
any other difference is refused naming the key and both values; a `--config` recipe is never applied on resume."""

from __future__ import annotations

import json

import pytest
import yaml
from pipeline_helpers import SMALL, metrics, summary

from dflash_trainer.cli import main
from dflash_trainer.config import load_config
from dflash_trainer.errors import ConfigError
from dflash_trainer.resume import differences, may_change, resumed_config
from dflash_trainer.rundir import save_config


def _saved_run(tmp_path, *extra):
    run = tmp_path / "run"
    save_config(load_config("demo", [f"run.dir={run}", *extra]), run)
    return run


def test_a_resume_applies_budget_and_cadence_changes_and_lists_them(tmp_path):
    run = _saved_run(tmp_path, "train.max_steps=10")
    resumed = resumed_config(run, ["train.max_steps=20", "eval.interval=5", "pipeline.colocated=false",
                                   "train.resume=latest"])
    assert resumed.config.train.max_steps == 20 and resumed.config.eval.interval == 5
    assert [(c.key, c.old, c.new) for c in resumed.changes] == [
        ("pipeline.colocated", True, False), ("train.max_steps", 10, 20), ("eval.interval", 0, 5)]
    assert resumed_config(run, ["train.resume=latest"]).changes == ()  # nothing given, nothing changed


def test_a_resume_refuses_what_changes_the_run_naming_each_key_and_both_values(tmp_path):
    run = _saved_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        resumed_config(run, ["train.lr=1e-3", "drafter.num_layers=3", "pipeline.token_budget=2048",
                             "train.max_steps=9"])
    message = str(e.value)
    for text in ("train.lr: 0.003 -> 0.001", "drafter.num_layers: 2 -> 3", "pipeline.token_budget: 1024 -> 2048",
                 "another run.dir, or --overwrite"):
        assert text in message, message
    assert "train.max_steps: None -> 9" not in message  # an allowed change is not among the refused


def test_paths_compare_by_the_file_they_name_and_measurement_settings_stay(tmp_path, monkeypatch):
    """`data` and `./data` (or its absolute path) are one folder; how tau is measured (which best/ is chosen by)
    may not change mid-run, its cadence may."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    run = _saved_run(tmp_path, "data.path=data")
    for same in ("./data", str(tmp_path / "data"), "data/"):
        assert resumed_config(run, [f"data.path={same}"]).changes == ()
    with pytest.raises(ConfigError, match="data.path: 'data' -> 'other'"):
        resumed_config(run, ["data.path=other"])
    with pytest.raises(ConfigError, match="eval.num_prompts: 8 -> 32"):
        resumed_config(run, ["eval.num_prompts=32"])
    assert [c.key for c in resumed_config(run, ["eval.interval=10"]).changes] == ["eval.interval"]


def test_a_recipe_that_cannot_be_read_is_only_not_compared(tmp_path):
    run = _saved_run(tmp_path)
    resumed = resumed_config(run, [], recipe=str(tmp_path / "missing.yaml"))
    assert resumed.config.run.dir == str(run) and "not found" in resumed.recipe_problem


def test_a_recipe_is_not_applied_on_resume_its_differences_are_named(tmp_path):
    run = _saved_run(tmp_path, "train.num_epochs=1", "train.lr=1e-3")
    resumed = resumed_config(run, ["train.resume=latest"], recipe="demo")
    assert resumed.config.train.num_epochs == 1 and resumed.config.train.lr == 1e-3  # the run's, not the recipe's
    assert [(c.key, c.old, c.new) for c in resumed.recipe_not_applied] == [("train.num_epochs", 1, 6),
                                                                           ("train.lr", 1e-3, 3e-3)]
    other = resumed_config(run, ["train.resume=latest"], recipe="qwen3-8b")
    assert other.config.data.max_length == 512 and ("data.max_length", 512, 3072) in [
        (c.key, c.old, c.new) for c in other.recipe_not_applied]


def test_what_may_change_on_resume():
    assert may_change("train.max_minutes") and may_change("pipeline.colocated") and may_change("eval.interval")
    assert may_change("drafter.flex_kernel_options.fwd_BLOCK_M")  # a speed knob, inside a mapping
    assert may_change("train.blocks_per_chunk")  # memory only: the loss and gradients are one pass's
    for key in ("pipeline.token_budget", "pipeline.context_parallel", "train.lr", "data.path", "run.seed", "target.dtype", "drafter.dpace",
                "eval.num_prompts", "eval.temperature"):
        assert not may_change(key), key
    a, b = load_config("demo"), load_config("demo", ["data.path=null", "data.sources=[{path: x}]", "drafter.num_blocks=7"])
    assert [c.key for c in differences(a, b)] == ["drafter.num_blocks", "data.path", "data.sources"]


QUICK = tuple(o for o in SMALL if not o.startswith("train.num_epochs"))


def test_resume_with_the_run_dir_alone_continues_the_same_run(tmp_path, capsys):
    """The issue's reproduction: a demo run of 1 epoch stopped early, resumed by the demo script's command (its
    recipe says 6 epochs): the run keeps its 1 epoch; `--resume run.dir=RUN` alone needs no recipe; an allowed
    change is printed and kept in config.yaml and summary.json; a refused one names itself."""
    run = tmp_path / "run"
    args = ["train", "--config", "demo", *QUICK, f"run.dir={run}", "train.checkpoint_interval=2"]
    assert main([*args, "train.num_epochs=1", "train.max_steps=2"]) == 0
    capsys.readouterr()
    assert main([*args, "train.max_steps=4", "--resume"]) == 0  # the demo script's command, the budget raised
    err = capsys.readouterr().err
    assert "changed on resume: train.max_steps: 2 -> 4" in err and "not applied" in err
    assert "train.num_epochs=1 (the recipe: 6)" in err
    assert summary(run)["steps"] == 4 and list(summary(run)["jobs_planned"]) == ["0"]  # one epoch, not six
    assert summary(run)["resume_changes"] == [{"key": "train.max_steps", "old": 2, "new": 4}]
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["max_steps"] == 4

    assert main(["train", "--resume", f"run.dir={run}", "train.max_steps=6"]) == 0  # no recipe at all
    assert summary(run)["steps"] == 6 and [r["step"] for r in metrics(run) if "jobs" in r] == list(range(1, 7))
    # a checkpoint path names its run: no run.dir needed; an older checkpoint than the latest trains on from there
    assert (run / "checkpoints" / "step_4").is_dir()
    assert main(["train", f"train.resume={run}/checkpoints/step_4", "train.max_steps=8"]) == 0
    assert summary(run)["steps"] == 8
    assert [r["step"] for r in metrics(run) if "jobs" in r][-4:] == [5, 6, 7, 8]  # steps 5 and 6 trained again

    capsys.readouterr()
    assert main(["train", "--resume", f"run.dir={run}", "train.max_steps=10", "data.max_length=200"]) == 2
    err = capsys.readouterr().err
    assert "data.max_length: 256 -> 200 (given)" in err, err
    assert json.loads((run / "summary.json").read_text())["steps"] == 8  # nothing ran


def test_resume_of_a_directory_without_a_run_says_so(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    for run_dir in (tmp_path / "empty", tmp_path / "afile"):
        assert main(["train", "--resume", f"run.dir={run_dir}"]) == 2
        assert f"--resume: run.dir='{run_dir}' holds no run to continue" in capsys.readouterr().err
    assert main(["train", "--resume"]) == 2
    assert "--resume (train.resume) needs the run to continue: add run.dir=RUN_DIR" in capsys.readouterr().err
