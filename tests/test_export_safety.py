"""`dflash-train export` never replaces files it did not make, and a refused export leaves nothing written: `--out`
and `--save-target` into a folder holding a user's model, an unrelated file or a run are refused (exit 2, the files
byte for byte as they were); the two flags may not name the same folder or one inside the other; an earlier export of
ours is replaced; a refused drafter leaves neither folder behind."""

from __future__ import annotations

import json

import pytest

from dflash_trainer.cli import main
from dflash_trainer.commands.export_dirs import MARKER
from tests.test_export_speculators import _verifier_folder


def _checkpoint(run_dir, *overrides, damage=None):
    """A training checkpoint of the demo recipe's drafter (random weights; `damage` edits them in place) with
    `overrides`, as `train` writes it; (its path, the export command's arguments up to --out, the target's config)."""
    from dflash_trainer.config import load_config
    from dflash_trainer.data.tokenizer import load_tokenizer
    from dflash_trainer.drafter.model import DFlashDrafter
    from dflash_trainer.drafter.spec import drafter_spec, first_spare_row
    from dflash_trainer.target.load import target_model_config
    from dflash_trainer.train.checkpoint import CheckpointState, save_checkpoint

    overrides = [f"run.dir={run_dir}", *overrides]
    config = load_config("demo", overrides)
    target = target_model_config(config.target)
    mask = first_spare_row(load_tokenizer(config.target, config.data.chat_template))
    drafter = DFlashDrafter(drafter_spec(target, config.drafter, mask_token_id=mask))
    weights = drafter.state_dict()
    if damage is not None:
        damage(weights)
    state = CheckpointState(step=1, epoch=0, ledger={}, model_signature={}, data_fingerprint="", scheduler={}, extra={})
    ckpt = save_checkpoint(run_dir, state, weights, {}, keep_last=1)
    return ckpt, ["export", "--config", "demo", *overrides, "--checkpoint", str(ckpt)], target


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("demo") / "run")


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _users_model(folder, target):
    """A model folder of the user's: config.json and weights that are not ours."""
    _verifier_folder(folder, target)
    (folder / "model.safetensors").write_bytes(b"the user's weights")
    return folder


def _unrelated(folder, _target):
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("keep me")
    return folder


def _run_dir(folder, _target):
    folder.mkdir(parents=True)
    (folder / ".dflash-run").write_text("{}\n")
    (folder / "config.yaml").write_text("run: {}\n")
    (folder / "metrics.jsonl").write_text("")
    return folder


FOREIGN = {"a model folder": (_users_model, "did not write (config.json, model.safetensors)"),
           "an unrelated file": (_unrelated, "did not write (notes.txt)"),
           "a run dir": (_run_dir, "is a run directory")}


@pytest.mark.parametrize("case", list(FOREIGN))
@pytest.mark.parametrize("flag", ["--out", "--save-target"])
def test_a_folder_holding_files_we_did_not_make_is_refused(demo, tmp_path, capsys, case, flag):
    ckpt, args, target = demo
    make, message = FOREIGN[case]
    theirs = make(tmp_path / "theirs", target)
    before = _snapshot(theirs)
    out = theirs if flag == "--out" else tmp_path / "export"
    save = ["--save-target", str(theirs)] if flag == "--save-target" else []
    assert main([*args, "--out", str(out), "--format", "speculators", *save]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {theirs}" in err and message in err and "give a new" in err, err
    assert _snapshot(theirs) == before
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("layout", ["same", "inside out", "parent of out"])
def test_save_target_and_out_must_be_two_separate_folders(demo, tmp_path, capsys, layout):
    ckpt, args, _ = demo
    out, save = {"same": (tmp_path / "x", tmp_path / "x"),
                 "inside out": (tmp_path / "x", tmp_path / "x" / "target"),
                 "parent of out": (tmp_path / "x" / "drafter", tmp_path / "x")}[layout]
    assert main([*args, "--out", str(out), "--format", "speculators", "--save-target", str(save)]) == 2
    err = capsys.readouterr().err
    assert "give two separate folders" in err and f"--save-target {save}" in err, err
    assert not (tmp_path / "x").exists()


def test_an_earlier_export_of_ours_is_replaced_and_an_empty_folder_taken(demo, tmp_path, capsys):
    ckpt, args, _ = demo
    out, save = tmp_path / "export", tmp_path / "target"
    out.mkdir()  # empty: nothing to lose
    for _ in range(2):  # the second run writes over what the first made
        assert main([*args, "--out", str(out), "--format", "speculators", "--save-target", str(save)]) == 0
        assert json.loads((out / MARKER).read_text())["kind"] == "drafter"
        assert json.loads((save / MARKER).read_text())["kind"] == "target"
        assert (out / "model.safetensors").is_file() and (save / "model.safetensors").is_file()
    assert main([*args, "--out", str(out)]) == 0  # the DFlash format over our speculators export
    assert "speculators_model_type" not in json.loads((out / "config.json").read_text())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    # but a drafter export of ours is no place for a target, nor a saved target for a drafter
    assert main([*args, "--out", str(tmp_path / "other"), "--format", "speculators", "--save-target", str(out)]) == 2
    assert "holds a drafter export, which a target saved by --save-target would replace" in capsys.readouterr().err
    assert main([*args, "--out", str(save)]) == 2
    assert "holds a target saved by --save-target, which a drafter export would replace" in capsys.readouterr().err


def test_a_refused_drafter_leaves_nothing_written(tmp_path, capsys):
    """A drafter mixing full and sliding layers has no speculators description: refused before any file is written,
    the target included (it was saved first, six files, before the drafter was checked)."""
    _, args, _ = _checkpoint(tmp_path / "run", "drafter.sliding_layers=[1]", "drafter.sliding_window=4")
    out, save = tmp_path / "new" / "export", tmp_path / "new" / "target"
    assert main([*args, "--out", str(out), "--format", "speculators", "--save-target", str(save)]) == 2
    assert "mix full attention" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_an_export_that_fails_midway_keeps_the_earlier_export(demo, tmp_path, monkeypatch):
    import dflash_trainer.drafter.export as export_module

    ckpt, args, _ = demo
    out = tmp_path / "export"
    assert main([*args, "--out", str(out)]) == 0
    before = _snapshot(out)

    def fails_after_the_config(model, out_dir, **kwargs):
        (out_dir / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_module, "export_drafter", fails_after_the_config)
    with pytest.raises(OSError):
        main([*args, "--out", str(out)])
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_an_out_that_is_a_link_to_our_export_keeps_the_link(demo, tmp_path):
    ckpt, args, _ = demo
    real, link = tmp_path / "elsewhere" / "export", tmp_path / "export"
    assert main([*args, "--out", str(real)]) == 0
    link.symlink_to(real)
    assert main([*args, "--out", str(link), "--format", "speculators", "--verifier", "org/any"]) == 0
    assert link.is_symlink() and "speculators_model_type" in json.loads((real / "config.json").read_text())


def test_an_out_in_a_folder_we_cannot_write_beside_is_named(demo, tmp_path, monkeypatch, capsys):
    """A folder the user may write but whose parent is read-only (the staging folder goes beside it)."""
    from pathlib import Path

    ckpt, args, _ = demo
    (tmp_path / "export").mkdir()
    mkdir = Path.mkdir

    def read_only_parent(self, *a, **kw):
        if self.name.startswith(".export.tmp-"):
            raise PermissionError(13, "Permission denied")
        return mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", read_only_parent)
    assert main([*args, "--out", str(tmp_path / "export")]) == 2
    assert f"cannot write beside {tmp_path / 'export'} (Permission denied)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
