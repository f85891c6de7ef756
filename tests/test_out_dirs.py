"""`--out` of regenerate, eval, export and report: a file, a path inside a file, a folder nobody can write, or a
folder a run owns (it would rewrite or delete the output) is a clear error (exit 2) before any work (no target
loaded, no checkpoint read, no figure drawn)."""

from __future__ import annotations

import json

import pytest

from dflash_trainer.cli import main

TINY = ["target.random_init=tiny", "target.tokenizer=tiny", "run.device=cpu"]


def _no_work(*args, **kwargs):
    raise AssertionError("the work started before --out was checked")


@pytest.fixture
def bad_outs(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return {"file": (str(blocker), "is a file"),
            "inside a file": (str(blocker / "sub"), "which is a file, not a folder"),
            "unwritable": ("/proc/version-dir/out", "cannot write in /proc")}


@pytest.mark.parametrize("case", ["file", "inside a file", "unwritable"])
@pytest.mark.parametrize("command", ["regenerate", "eval", "export", "report"])
def test_bad_out_is_refused_before_the_work(command, case, bad_outs, tmp_path, monkeypatch, capsys):
    _refused_before_the_work(command, *bad_outs[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("inside", ["checkpoints/step_2/exported", "export/mine", "best", "plan/x", "tensorboard"])
@pytest.mark.parametrize("command", ["regenerate", "eval", "export", "report"])
def test_an_out_inside_a_folder_the_run_owns_is_refused(command, inside, tmp_path, monkeypatch, capsys):
    """`export --out RUN/checkpoints/step_N/exported` would be deleted when a resume rotates step_N away."""
    from dflash_trainer.rundir import RunDir

    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    RunDir(run).marker.write_text("{}\n")
    why = "resuming keeps only the newest" if inside.startswith("checkpoints") else "which the run in"
    _refused_before_the_work(command, str(run / inside), why, tmp_path, monkeypatch, capsys)


def test_outs_beside_a_run_s_own_folders_are_taken(tmp_path):
    from dflash_trainer.commands.out_dir import checked_out_dir
    from dflash_trainer.rundir import RunDir

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    RunDir(run).marker.write_text("{}\n")
    for out in (run / "exports" / "step_2", run / "my-export", tmp_path / "elsewhere", run / "checkpoints-copy"):
        assert checked_out_dir(out) == out
    assert checked_out_dir(run / "report", owned_ok=run / "report") == run / "report"  # `report`'s own folder
    unmarked = tmp_path / "not-a-run"
    (unmarked / "checkpoints").mkdir(parents=True)  # no .dflash-run: a folder of the user's, not a run
    assert checked_out_dir(unmarked / "checkpoints" / "x") == unmarked / "checkpoints" / "x"


def _refused_before_the_work(command, out, message, tmp_path, monkeypatch, capsys):
    import dflash_trainer.commands.eval as eval_command  # imported before the patches: its names stay real
    import dflash_trainer.commands.regenerate as regenerate_command
    import dflash_trainer.report.page as page
    import dflash_trainer.target.load as target_load

    monkeypatch.setattr(target_load, "load_target", _no_work)
    monkeypatch.setattr(eval_command, "load_target", _no_work)
    monkeypatch.setattr(target_load, "target_model_config", _no_work)
    monkeypatch.setattr(regenerate_command, "build_backend", _no_work)
    monkeypatch.setattr(page, "write_report", _no_work)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    run = tmp_path / "reported"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    argv = {
        "regenerate": ["regenerate", "--out", out, f"data.path={prompts}", *TINY],
        "eval": ["eval", "--drafter", str(tmp_path), "--out", out, f"eval.prompts={prompts}", *TINY],
        "export": ["export", "--checkpoint", str(tmp_path / "no-such-checkpoint"), "--out", out, *TINY],
        "report": ["report", str(run), "--out", out],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--out {out}" in err and message in err, err


@pytest.mark.parametrize("command, theirs", [
    ("eval", {"eval.json": '{"their": "figures"}'}),
    ("report", {"index.html": "<p>their page</p>"}),
    ("report", {"plot.png": "their picture", "notes.txt": "kept"}),
])
def test_an_out_holding_files_of_the_same_names_that_we_did_not_write_is_refused(command, theirs, tmp_path,
                                                                                  monkeypatch, capsys):
    """`eval --out DIR` writes DIR/eval.json and `report --out DIR` its index.html and figures: a folder of the user's
    holding files of those names is refused before the work, and they are left as they were."""
    out = tmp_path / "theirs"
    out.mkdir()
    for name, text in theirs.items():
        (out / name).write_text(text)
    replaced = sorted(n for n in theirs if n != "notes.txt")
    _refused_before_the_work(command, str(out), f"already holds {', '.join(replaced)}, which dflash-train {command} "
                                                f"did not write", tmp_path, monkeypatch, capsys)
    assert {p.name: p.read_text() for p in out.iterdir()} == theirs


def test_our_own_eval_json_and_report_are_replaced(tmp_path):
    """What tells ours apart: an eval.json with our figures, a report page as `write_report` begins it."""
    from dflash_trainer.commands.eval import _ours
    from dflash_trainer.report.page import PAGE_START, foreign_report_files

    ours = tmp_path / "eval.json"
    ours.write_text(json.dumps({"tau": 2.0, "acceptance_histogram": {}, "per_prompt_committed": []}))
    assert _ours(ours)
    ours.write_text(json.dumps({"tau": 2.0}))
    assert not _ours(ours)
    (tmp_path / "index.html").write_text(PAGE_START + "run</title>...")
    (tmp_path / "loss.png").write_bytes(b"png")
    assert foreign_report_files(tmp_path) == []
    (tmp_path / "index.html").write_text("<html>theirs</html>")
    assert foreign_report_files(tmp_path) == ["index.html", "loss.png"]
