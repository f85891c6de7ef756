"""The run directory's life on disk (`rundir.py`): claiming it (one command at a time), the marker that makes
`--overwrite` delete only a run's own outputs, what `plan` and `train` may do with what a directory holds, and
a failed start that leaves nothing behind."""

from __future__ import annotations

import json

import pytest
import yaml

from dflash_trainer.config import load_config
from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import RunDir, claim_run_dir


def _config(run_dir=None, *extra):
    return load_config("demo", ([f"run.dir={run_dir}"] if run_dir else []) + list(extra))


def test_an_automatic_name_is_a_new_directory_each_time_and_the_config_resumes_there(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with claim_run_dir(_config(), "train") as first, claim_run_dir(_config(), "train") as second:
        assert first.path.parent.name == "runs" and first.path.name.startswith("demo-")
        assert second.path != first.path  # the same second: a fresh dir, never a shared one
        assert yaml.safe_load(RunDir(first.path).config.read_text())["run"]["dir"] == str(first.path)
        assert json.loads(RunDir(first.path).marker.read_text())["format"].startswith("dflash-train-run/")
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(ConfigError, match="cannot create or write the run directory"):
        claim_run_dir(_config(tmp_path / "blocker" / "x"), "train")
    for purpose in ("train", "plan"):  # a file as the run dir itself: named, not a FileExistsError traceback
        with pytest.raises(ConfigError, match=f"run.dir='{tmp_path / 'blocker'}' is a file, not a run directory"):
            claim_run_dir(_config(tmp_path / "blocker"), purpose)
    assert (tmp_path / "blocker").read_text() == "a file"
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(ConfigError, match="is a link to .*gone', which does not exist"):
        claim_run_dir(_config(tmp_path / "dangling"), "train")


def test_a_second_command_into_a_claimed_run_dir_is_refused(tmp_path):
    """The claim is a lock, taken before the directory's contents are looked at: two `train` started at once into
    one new directory cannot both pass the check."""
    run = tmp_path / "run"
    with claim_run_dir(_config(run), "train"):
        for purpose in ("train", "plan"):
            with pytest.raises(ConfigError, match="another dflash-train command is writing run.dir"):
                claim_run_dir(_config(run), purpose)
    claim_run_dir(_config(run), "train").release()  # free again once the first one let go


def test_overwrite_deletes_only_what_a_run_wrote(tmp_path):
    """A directory that was never a run (no marker) keeps its `export/` and `best/`; a marked run is replaced."""
    mine = tmp_path / "mine"
    for name in ("export", "best"):
        (mine / name).mkdir(parents=True)
        (mine / name / "model.safetensors").write_text("not ours")
    with pytest.raises(ConfigError, match="not a run dflash-train made.*--overwrite deletes only"):
        claim_run_dir(_config(mine, "train.overwrite=true"), "train")
    assert (mine / "export" / "model.safetensors").read_text() == "not ours"
    assert (mine / "best" / "model.safetensors").is_file() and not RunDir(mine).marker.exists()

    run = tmp_path / "run"
    claim_run_dir(_config(run), "train").release()
    (run / "export").mkdir()
    (run / "export" / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    claim_run_dir(_config(run, "train.overwrite=true"), "train").release()
    assert not (run / "export").exists() and not (run / "metrics.jsonl").exists()


def test_plan_refuses_a_directory_that_holds_a_training_run(tmp_path):
    run = tmp_path / "run"
    claim_run_dir(_config(run), "train").release()
    (run / "plan").mkdir()
    (run / "plan" / "epoch_0.json").write_text("the plan the run resumes from")
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds a training run \\(checkpoints\\).*dflash-train plan"):
        claim_run_dir(_config(run), "plan")
    assert (run / "plan" / "epoch_0.json").read_text() == "the plan the run resumes from"


def test_a_new_training_run_plans_again_over_a_plan(tmp_path):
    """A directory that holds only a plan: `train` drops its epoch plans (they may come from other settings)."""
    run = tmp_path / "run"
    claim_run_dir(_config(run), "plan").release()
    (run / "plan").mkdir()
    (run / "plan" / "epoch_0.json").write_text("{}")
    claim_run_dir(_config(run), "train").release()
    assert not (run / "plan" / "epoch_0.json").exists()


def test_a_failed_start_leaves_no_directory_it_created(tmp_path):
    """Released after a failure: a directory this claim created, where no step was trained, is removed; one that
    was there before, or that holds a trained step, stays."""
    new = tmp_path / "new"
    claim_run_dir(_config(new), "train").release(failed=True)
    assert not new.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    claim_run_dir(_config(existing), "train").release(failed=True)
    assert existing.is_dir()
    trained = tmp_path / "trained"
    claim = claim_run_dir(_config(trained), "train")
    (trained / "metrics.jsonl").write_text('{"step": 1}\n')
    claim.release(failed=True)
    assert (trained / "metrics.jsonl").is_file()
