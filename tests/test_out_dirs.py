"""`--out` of regenerate, eval, export and report: a file, a path inside a file, or a folder nobody can write
is a clear error (exit 2) before any work (no target loaded, no checkpoint read, no figure drawn)."""

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
    import dflash_trainer.commands.eval as eval_command  # imported before the patches: its names stay real
    import dflash_trainer.commands.regenerate as regenerate_command
    import dflash_trainer.report.page as page
    import dflash_trainer.target.load as target_load

    monkeypatch.setattr(target_load, "load_target", _no_work)
    monkeypatch.setattr(eval_command, "load_target", _no_work)
    monkeypatch.setattr(target_load, "target_model_config", _no_work)
    monkeypatch.setattr(regenerate_command, "build_backend", _no_work)
    monkeypatch.setattr(page, "write_report", _no_work)
    out, message = bad_outs[case]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    run = tmp_path / "run"
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
