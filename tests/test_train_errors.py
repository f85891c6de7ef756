"""Bad inputs to `dflash-train train` (one process, in-process CLI): each ends with a clear error naming the
input and the fix (exit code 2 for config and data errors), and NaN batches are skipped, counted, warned
about, and stop the run after `train.max_nonfinite_steps`."""

from __future__ import annotations

import json
import logging

import pytest
from pipeline_helpers import committed_jobs, metrics, planned_jobs, summary, train_in_process


@pytest.fixture(autouse=True)
def _no_fault(monkeypatch):
    monkeypatch.delenv("DFLASH_TEST_FAULT", raising=False)


def test_missing_checkpoint(tmp_path, capsys):
    assert train_in_process(tmp_path / "run", "train.resume=/nope") == 2
    assert "train.resume='/nope' is not a complete checkpoint directory" in capsys.readouterr().err


def test_resume_latest_without_checkpoint(tmp_path, capsys):
    assert train_in_process(tmp_path / "run", resume=True) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def test_unwritable_run_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert train_in_process(blocker / "run") == 2
    err = capsys.readouterr().err
    assert "cannot create or write the run directory" in err and "set run.dir to a writable directory" in err


def test_dataset_without_trainable_sequence(tmp_path, capsys):
    data = tmp_path / "short.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "ok"}]}
            for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert train_in_process(tmp_path / "run", f"data.path={data}", "data.num_eval_conversations=0") == 2
    err = capsys.readouterr().err
    assert "no trainable sequence" in err and "supervised tokens" in err
    assert "held out" not in err  # none was (data.num_eval_conversations=0)


def test_a_held_out_set_that_leaves_nothing_to_train_on_is_named(tmp_path, capsys):
    """8 rows, each long enough to train on: holding out 8 (the demo's data.num_eval_conversations) leaves none.
    The error names the held-out setting and a value that leaves data to train on (which then trains)."""
    long_reply = " ".join(f"word{i}" for i in range(80))
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": long_reply}]}
            for i in range(8)]
    data = tmp_path / "small.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert train_in_process(tmp_path / "run", f"data.path={data}", "data.num_eval_conversations=8") == 2
    err = capsys.readouterr().err
    assert "no conversation left to train on" in err and "data.num_eval_conversations=8 held out all 8" in err
    assert "data.num_eval_conversations=1 keeps most" in err
    assert train_in_process(tmp_path / "run2", f"data.path={data}", "data.num_eval_conversations=1",
                            "train.max_steps=1") == 0


def test_nan_batch_is_skipped_counted_and_warned_then_other_shape_cannot_resume(tmp_path, monkeypatch, caplog, capsys):
    """NaN taps in job 0: that step is skipped on all ranks (no update), counted in the summary, warned about,
    and the job is still committed (it was consumed). Then a resume with another drafter shape is refused."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("DFLASH_TEST_FAULT", "nan_batch:0")
    with caplog.at_level(logging.WARNING):
        assert train_in_process(run_dir, "train.checkpoint_interval=2") == 0
    assert "non-finite loss or gradient: step skipped" in caplog.text
    s = summary(run_dir)
    rows = metrics(run_dir)
    assert s["status"] == "ok" and s["skipped_steps"] == 1, s
    (bad,) = [r for r in rows if r["skipped"]]
    assert bad["jobs"] == [0] and bad["loss"] is None  # NaN is logged as null
    assert all(r["loss"] is not None for r in rows if not r["skipped"])
    assert sorted(committed_jobs(rows)) == sorted(planned_jobs(run_dir))
    assert s["steps"] == len(rows) - 1  # the skipped step did not count as an optimizer step

    monkeypatch.delenv("DFLASH_TEST_FAULT")
    capsys.readouterr()
    assert train_in_process(run_dir, "train.checkpoint_interval=2", "drafter.num_layers=2", resume=True) == 2
    assert "drafter.num_layers: 1 -> 2" in capsys.readouterr().err  # refused from the run's config, before any work
    # the checkpoint's own guard, for a config.yaml edited by hand
    config_file = run_dir / "config.yaml"
    config_file.write_text(config_file.read_text().replace("num_layers: 1", "num_layers: 2"))
    assert train_in_process(run_dir, "train.checkpoint_interval=2", "drafter.num_layers=2", resume=True) == 2
    err = capsys.readouterr().err
    assert "is of another model shape" in err and "num_layers" in err, err


def test_nan_everywhere_stops_after_max_nonfinite_steps(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("DFLASH_TEST_FAULT", "nan_batch:all")
    assert train_in_process(run_dir, "train.max_nonfinite_steps=2") == 1
    assert "stopped:" in capsys.readouterr().err
    rows = metrics(run_dir)
    assert len(rows) == 2 and all(r["skipped"] for r in rows)  # the third skipped step raised
    s = summary(run_dir)
    assert s["status"] == "failed" and "FloatingPointError" in s["cause"] and "max_nonfinite_steps=2" in s["cause"], s


def test_missing_or_relative_target_path_and_folders_without_a_model(tmp_path, capsys):
    """A path that does not exist is named (it is not sent to the Hub as a repo id); a folder without a model
    config or a tokenizer says which file is missing."""
    tiny = ["target.random_init=null", "target.tokenizer=null"]
    assert train_in_process(tmp_path / "r1", *tiny, "target.path=../no/such/model") == 2
    err = capsys.readouterr().err
    assert "target.path='../no/such/model' does not exist" in err and "relative paths start from" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert train_in_process(tmp_path / "r2", *tiny, f"target.path={empty}") == 2
    assert "is a folder without tokenizer_config.json" in capsys.readouterr().err
    assert train_in_process(tmp_path / "r3", "target.random_init=null", f"target.path={empty}") == 2  # tiny tokenizer
    assert "is a folder without config.json" in capsys.readouterr().err


def test_mask_token_on_an_ordinary_token_is_warned_about(tmp_path, caplog):
    """The demo's tiny tokenizer: id 100 is an ordinary token, id 5 a special one, the default a spare row."""
    with caplog.at_level(logging.WARNING):
        assert train_in_process(tmp_path / "r1", "drafter.mask_token_id=100", "train.max_steps=1",
                                "eval.at_end=false") == 0
    assert any("drafter.mask_token_id=100 is" in r.getMessage() and "ordinary token" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert train_in_process(tmp_path / "r2", "drafter.mask_token_id=5", "train.max_steps=1",
                                "eval.at_end=false") == 0
    assert not any("ordinary token" in r.getMessage() for r in caplog.records)


def test_a_second_run_into_a_run_dir_is_refused_unless_resumed_or_overwritten(tmp_path, capsys, caplog):
    run = tmp_path / "run"
    quick = ("train.max_steps=2", "eval.at_end=false")
    assert train_in_process(run, *quick) == 0
    first = (run / "metrics.jsonl").read_text()
    assert train_in_process(run, *quick, "train.lr=1e-3") == 2
    err = capsys.readouterr().err
    assert "holds a training run" in err and "--resume" in err and "--overwrite" in err and "new directory" in err
    assert (run / "metrics.jsonl").read_text() == first  # nothing touched
    assert train_in_process(run, "train.max_steps=3", "eval.at_end=false", resume=True) == 0  # continues it
    from pipeline_helpers import overrides

    from dflash_trainer.cli import main

    (run / "report").mkdir(exist_ok=True)
    (run / "report" / "stale.png").write_bytes(b"")  # the old run's report goes with it
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--config", "demo", *overrides(run, *quick, "train.lr=1e-3"), "--overwrite"]) == 0
    assert f"--overwrite: deleting the run in {run} (" in caplog.text and "metrics.jsonl" in caplog.text
    assert not (run / "report" / "stale.png").exists()
    steps = [r["step"] for r in metrics(run) if "loss" in r]
    assert steps == [1, 2] and summary(run)["steps"] == 2  # a fresh run: no rows of the first one
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]


def test_damaged_checkpoint_export_refused_and_resume_falls_back(tmp_path, capsys, caplog):
    from pipeline_helpers import overrides

    from dflash_trainer.cli import main

    run = tmp_path / "run"
    assert train_in_process(run, "train.max_steps=2", "train.checkpoint_interval=1", "eval.at_end=false") == 0
    weights = run / "checkpoints" / "step_2" / "drafter.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4:] = b"\xff\xff\xff\xff"  # a NaN where the last weight was
    weights.write_bytes(bytes(data))
    assert main(["export", "--config", "demo", *overrides(run), "--checkpoint", str(weights.parent),
                 "--out", str(tmp_path / "export")]) == 2
    assert "is damaged: drafter.safetensors does not match its checksum" in capsys.readouterr().err
    with caplog.at_level(logging.WARNING):
        assert train_in_process(run, "train.max_steps=3", "eval.at_end=false", resume=True) == 0
    assert any("resuming from step_1" in r.getMessage() and "step_2 (drafter.safetensors" in r.getMessage()
               for r in caplog.records)
    assert summary(run)["status"] == "ok" and summary(run)["steps"] == 3
    # a checkpoint under the legacy marker (no checksums to check) whose weights file is cut short: named, with
    # the intact checkpoints to export instead, not a SafetensorError traceback
    legacy = run / "checkpoints" / "step_3"
    (legacy / "COMPLETE").write_text("ok\n")
    (legacy / "drafter.safetensors").write_bytes((legacy / "drafter.safetensors").read_bytes()[:300])
    capsys.readouterr()
    assert main(["export", "--config", "demo", *overrides(run), "--checkpoint", str(legacy),
                 "--out", str(tmp_path / "export")]) == 2
    err = capsys.readouterr().err
    assert f"its weights file {legacy / 'drafter.safetensors'} cannot be read" in err, err
    others = f"{run / 'checkpoints' / 'step_1'}, {run / 'checkpoints' / 'step_2'}"  # finished ones, by step
    assert f"use another checkpoint instead ({others})" in err, err


def test_unwritable_checkpoints_folder_fails_at_start_not_at_the_first_save(tmp_path, capsys):
    """checkpoints/ points where nobody can write (a link under /proc: refused even to root)."""
    import os

    run = tmp_path / "run"
    run.mkdir()
    os.symlink("/proc/version/checkpoints", run / "checkpoints")
    assert train_in_process(run, "train.max_steps=2") == 2
    err = capsys.readouterr().err
    assert "cannot write checkpoints to" in err and "make it writable" in err
    assert not (run / "metrics.jsonl").exists()  # refused before training


def test_a_cpu_step_that_cannot_fit_in_memory_is_refused_before_training(tmp_path, capsys, monkeypatch):
    """The CPU's dense attention masks grow with the square of the token budget: a budget whose step needs more
    than the host has is named with the fix, not killed by the kernel mid-step."""
    from pipeline_helpers import SMALL

    from dflash_trainer.config import load_config
    from dflash_trainer.drafter.attention_mask import dense_step_bytes
    from dflash_trainer.runtime import setup

    config = load_config("demo", list(SMALL))
    step = dense_step_bytes(num_blocks=config.batch.num_blocks, block_size=config.drafter.block_size,
                            token_budget=config.batch.token_budget, num_layers=config.drafter.num_layers)
    assert 1 * 2**20 < step < 100 * 2**20  # a few MiB: the tests' shape
    monkeypatch.setattr(setup, "available_host_bytes", lambda: step // 2)
    run = tmp_path / "run"
    assert train_in_process(run, "train.max_steps=2") == 2
    err = capsys.readouterr().err
    budget = config.batch.token_budget
    assert f"pipeline.token_budget={budget} is too large for training on the CPU" in err
    assert "Lower pipeline.token_budget" in err
    assert not (run / "metrics.jsonl").exists()
    monkeypatch.setattr(setup, "available_host_bytes", lambda: step * 2)
    assert train_in_process(tmp_path / "run2", "train.max_steps=1") == 0


def test_overwrite_of_a_directory_that_was_never_a_run_keeps_its_files(tmp_path, capsys):
    mine = tmp_path / "mine"
    for name in ("export", "best"):
        (mine / name).mkdir(parents=True)
        (mine / name / "model.safetensors").write_text("the user's own drafter")
    from pipeline_helpers import overrides

    from dflash_trainer.cli import main

    assert main(["train", "--config", "demo", *overrides(mine, "train.max_steps=1"), "--overwrite"]) == 2
    assert "not a run dflash-train made" in capsys.readouterr().err
    assert (mine / "export" / "model.safetensors").read_text() == "the user's own drafter"
    assert (mine / "best" / "model.safetensors").is_file()


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize("held", [("config.yaml",), ("plan/epoch_0.json",), ("config.yaml", "notes.txt")])
def test_a_folder_holding_a_config_or_plan_we_did_not_write_is_refused(tmp_path, capsys, command, held):
    """run.dir names a folder of the user's whose config.yaml (or plan/) no dflash-train command wrote (no marker):
    `train` and `plan` would write theirs over it. Refused, naming the files, and the folder is left as it was."""
    from pipeline_helpers import overrides

    from dflash_trainer.cli import main

    mine = tmp_path / "mine"
    for name in held:
        (mine / name).parent.mkdir(parents=True, exist_ok=True)
        (mine / name).write_text(f"the user's {name}\n")
    assert main([command, "--config", "demo", *overrides(mine, "train.max_steps=1")]) == 2
    err = capsys.readouterr().err
    assert f"run.dir={str(mine)!r} holds {held[0].split('/')[0]}, which dflash-train did not write" in err, err
    assert "set run.dir to a new or empty directory" in err
    for name in held:
        assert (mine / name).read_text() == f"the user's {name}\n"
    assert sorted(p.name for p in mine.iterdir()) == sorted({n.split("/")[0] for n in held} | {".lock"})


def test_a_random_init_that_is_neither_preset_nor_folder_names_both_kinds():
    from dflash_trainer.errors import ConfigError
    from dflash_trainer.target.config import TargetConfig
    from dflash_trainer.target.load import target_model_config

    with pytest.raises(ConfigError) as error:
        target_model_config(TargetConfig(random_init="tiny-mo"))
    assert "did you mean tiny-moe? Or give a preset (" in str(error.value) and "config.json" in str(error.value)
    with pytest.raises(ConfigError, match=r"is neither a preset nor a path: give a preset \(.*tiny.*\) or a folder"):
        target_model_config(TargetConfig(random_init="/nowhere/model"))


def test_a_run_dir_being_written_is_refused_to_a_second_train(tmp_path, capsys):
    """Another command holds the run dir's lock (as a `train` started a moment earlier does): refused at once."""
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert train_in_process(run, "train.max_steps=1") == 2
    assert "another dflash-train command is writing run.dir" in capsys.readouterr().err
    assert not (run / "metrics.jsonl").exists()


def test_failed_commands_and_plan_without_run_dir_leave_no_run_folder(tmp_path, monkeypatch, capsys):
    from pipeline_helpers import SMALL

    from dflash_trainer.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "demo", *SMALL, f"data.path={tmp_path / 'missing.jsonl'}"]) == 2
    assert main(["train", "--config", "demo", *SMALL, "target.random_init=null", "target.tokenizer=null",
                 f"target.path={tmp_path}"]) == 2
    assert main(["plan", "--config", "demo", *SMALL]) == 0
    assert "run dir: none" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_plan_into_a_training_run_is_refused(tmp_path, capsys):
    from pipeline_helpers import overrides

    from dflash_trainer.cli import main

    run = tmp_path / "run"
    assert train_in_process(run, "train.max_steps=1") == 0
    plan = (run / "plan" / "epoch_0.json").read_text()
    assert main(["plan", "--config", "demo", *overrides(run, "pipeline.token_budget=1024")]) == 2
    assert "holds a training run" in capsys.readouterr().err
    assert (run / "plan" / "epoch_0.json").read_text() == plan


def test_train_after_plan_with_other_settings_plans_again(tmp_path):
    """`plan` with a larger batch and longer sequences, then `train` with the small ones into the same run dir: the
    training run plans from its own settings (the old plan's batches do not fit its budget)."""
    from pipeline_helpers import overrides

    from dflash_trainer.cli import main

    run = tmp_path / "run"
    assert main(["plan", "--config", "demo", *overrides(run, "pipeline.token_budget=2048",
                                                         "data.max_length=2048")]) == 0
    assert train_in_process(run, "train.max_steps=2") == 0
    plan = json.loads((run / "plan" / "epoch_0.json").read_text())
    assert plan["token_budget"] == 512 and max(j["num_tokens"] for j in plan["jobs"]) <= 512
    assert summary(run)["status"] == "ok"


def test_resume_of_a_finished_run_leaves_it_as_it_is(tmp_path, capsys):
    run = tmp_path / "run"
    assert train_in_process(run, "train.max_steps=2") == 0
    before = (run / "summary.json").read_text()
    config_before = (run / "config.yaml").read_bytes()
    assert json.loads(before)["tokens_trained"] > 0
    capsys.readouterr()
    assert train_in_process(run, "train.max_steps=2", "train.log_interval=5", resume=True) == 0
    out = capsys.readouterr().out
    assert "is finished" in out and "train.max_steps=2 reached" in out and "max_minutes=None" not in out  # unset
    assert (run / "summary.json").read_text() == before
    assert (run / "config.yaml").read_bytes() == config_before  # the override it did not act on is not recorded


def test_a_resumed_run_counts_the_tokens_of_every_session(tmp_path):
    run = tmp_path / "run"
    assert train_in_process(run, "train.max_steps=2") == 0
    assert train_in_process(run, "train.max_steps=4", resume=True) == 0
    rows = [r for r in metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert summary(run)["tokens_trained"] == sum(r["tokens"] for r in rows)


def reseal_state(checkpoint, **extra):
    """Change `extra` in a checkpoint's state.json and record its new size and checksum, as a save would."""
    from dflash_trainer.train.checkpoint import COMPLETE, _crc32

    state_file = checkpoint / "state.json"
    state = json.loads(state_file.read_text())
    state["extra"].update(extra)
    state_file.write_text(json.dumps(state))
    marker = json.loads((checkpoint / COMPLETE).read_text())
    marker["files"]["state.json"] = {"bytes": state_file.stat().st_size, "crc32": _crc32(state_file)}
    (checkpoint / COMPLETE).write_text(json.dumps(marker))


def test_a_resumed_run_counts_the_training_time_of_every_session(tmp_path, capsys):
    """`train.max_minutes` covers every session: a budget the first session already spent leaves nothing to do,
    a larger one continues and the checkpoint's training time keeps counting from the first session."""
    run = tmp_path / "run"

    def time_spent(step):
        return json.loads((run / "checkpoints" / f"step_{step}" / "state.json").read_text())["extra"]["time_spent_s"]

    assert train_in_process(run, "train.max_steps=2") == 0
    assert time_spent(2) > 0
    reseal_state(run / "checkpoints" / "step_2", time_spent_s=1000.0)  # as if the first session trained 1000 s
    capsys.readouterr()
    before = (run / "summary.json").read_text()
    assert train_in_process(run, "train.max_steps=4", "train.max_minutes=16", resume=True) == 0
    assert "is finished" in capsys.readouterr().out
    assert (run / "summary.json").read_text() == before and (run / "checkpoints" / "step_2").is_dir()  # left as is
    assert train_in_process(run, "train.max_steps=4", "train.max_minutes=100", resume=True) == 0
    assert summary(run)["steps"] == 4 and 1000.0 < time_spent(4) < 1100.0
    assert summary(run)["training_minutes"] == pytest.approx(time_spent(4) / 60, abs=1e-3)


def test_export_and_eval_find_the_runs_config_without_config(tmp_path, capsys):
    """`export --checkpoint RUN/checkpoints/step_N` and `eval --drafter RUN/export` read RUN/config.yaml (and
    say so); eval writes RUN/eval-export.json on the run's held-out prompts, beside the training's eval.json."""
    from dflash_trainer.cli import main

    run = tmp_path / "run"
    assert train_in_process(run, "train.max_steps=2", "eval.at_end=true", "eval.num_prompts=2",
                            "eval.max_new_tokens=4") == 0
    capsys.readouterr()
    training_eval = (run / "eval.json").read_text()
    assert json.loads(training_eval)["step"] == 2
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "step_2"), "--out", str(tmp_path / "e")]) == 0
    assert f"using the run's config {run / 'config.yaml'}" in capsys.readouterr().err
    assert (tmp_path / "e" / "model.safetensors").is_file()
    assert main(["eval", "--drafter", str(run / "export"), "eval.num_prompts=2", "eval.max_new_tokens=4"]) == 0
    assert f"using the run's config {run / 'config.yaml'}" in capsys.readouterr().err
    result = json.loads((run / "eval-export.json").read_text())
    assert result["prompts"] == 2 and result["prompts_path"] == str(run / "plan" / "eval.jsonl")
    assert (run / "eval.json").read_text() == training_eval  # the training's evaluation is kept as it was
    assert main(["eval", "--drafter", str(run / "export"), "--out", str(run), "eval.num_prompts=1"]) == 0
    assert (run / "eval.json").read_text() == training_eval  # --out the run dir: beside it too
    assert json.loads((run / "eval-export.json").read_text())["prompts"] == 1
    # a directory that is not one of a run's drafters does not borrow a config from above it
    (tmp_path / "config.yaml").write_text((run / "config.yaml").read_text())
    assert main(["eval", "--drafter", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "set target.path" in err and "or pass --config RUN_DIR/config.yaml" in err
    # a path that does not exist is named as missing, with what the run holds, with or without --config
    assert main(["eval", "--drafter", str(run / "exportt")]) == 2
    assert f"--drafter {run / 'exportt'}: no such directory; did you mean {run / 'export'}?" in capsys.readouterr().err
    assert main(["eval", "--drafter", str(run / "step_2")]) == 2
    assert f"--drafter {run / 'step_2'}: no such directory ({run} holds: best, checkpoints, export, plan" in \
        capsys.readouterr().err
    assert main(["export", "--config", "demo", "--checkpoint", str(run / "checkpoints" / "step_9"), "--out",
                 str(tmp_path / "e9")]) == 2
    assert f"no such directory ({run / 'checkpoints'} holds: step_2)" in capsys.readouterr().err
    assert main(["eval", "--drafter", str(tmp_path / "elsewhere" / "nope")]) == 2
    err = capsys.readouterr().err  # the missing folder is the mistake: no clause about the config
    assert f"--drafter {tmp_path / 'elsewhere' / 'nope'}: no such directory\n" in err and "target.path" not in err
    (tmp_path / "runs" / "export").mkdir(parents=True)
    assert main(["eval", "--drafter", str(tmp_path / "runs" / "expot")]) == 2
    assert f"no such directory; did you mean {tmp_path / 'runs' / 'export'}?" in capsys.readouterr().err
    assert main(["eval", "--drafter", str(run / "config.yaml"), "--config", "demo", "--out", str(tmp_path / "o")]) == 2
    assert f"--drafter {run / 'config.yaml'} is a file; pass the directory" in capsys.readouterr().err


def test_a_target_that_needs_remote_code_names_trust_remote_code_and_the_risk(tmp_path):
    from dflash_trainer.data.tokenizer import load_tokenizer
    from dflash_trainer.errors import ConfigError
    from dflash_trainer.target.config import TargetConfig
    from dflash_trainer.target.load import target_model_config

    model = tmp_path / "custom-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "mything", "architectures": ["MyThingForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_mything.MyThingConfig",
                     "AutoModelForCausalLM": "modeling_mything.MyThingForCausalLM",
                     "AutoTokenizer": [None, "tokenization_mything.MyThingTokenizerFast"]}}))
    (model / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MyThingTokenizerFast",
        "auto_map": {"AutoTokenizer": [None, "tokenization_mything.MyThingTokenizerFast"]}}))
    ran = tmp_path / "code-ran"
    for name in ("configuration_mything.py", "modeling_mything.py", "tokenization_mything.py"):
        (model / name).write_text(f"open({str(ran)!r}, 'w').close()\n")
    risk = "Set target.trust_remote_code=true only if you trust its source: that code runs on this machine"
    for key, config in (("target.path", TargetConfig(path=str(model))),
                        ("target.random_init", TargetConfig(random_init=str(model)))):
        with pytest.raises(ConfigError, match=f"{key}='{model}': its model config needs Python code shipped with "
                                              f"the model .*{risk}"):
            target_model_config(config)
    with pytest.raises(ConfigError, match=f"target.path='{model}': its tokenizer needs Python code .*{risk}"):
        load_tokenizer(TargetConfig(path=str(model)))
    assert not ran.exists()


def test_a_max_length_past_the_targets_positions_is_named_before_memory(tmp_path, capsys):
    """data.max_length far past the target's max_position_embeddings (4096 for the tiny target): the error names
    both numbers, not the CPU memory the matching token budget would need."""
    assert train_in_process(tmp_path / "run", "data.max_length=200000", "pipeline.token_budget=200000") == 2
    err = capsys.readouterr().err
    assert "data.max_length 200000 exceeds the target's max_position_embeddings 4096" in err, err
    assert "too large for training on the CPU" not in err
