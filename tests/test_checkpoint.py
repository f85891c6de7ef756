import logging
import os

import pytest
import torch

from dflash_trainer.errors import ConfigError
from dflash_trainer.train.checkpoint import (
    CheckpointState,
    checkpoint_problem,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from dflash_trainer.train.schedule import lr_factor


def _state(step, sig=None, fp="data-a"):
    return CheckpointState(
        step=step,
        epoch=0,
        ledger={0: [3, 1, 2]},
        model_signature=sig or {"hidden": 8, "layers": 1},
        data_fingerprint=fp,
        scheduler={"last_epoch": step},
        extra={"tokens": 10},
    )


def _save(run, step, **kw):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return save_checkpoint(run, _state(step, **kw), dict(model.state_dict()), opt.state_dict(), keep_last=2), model


def test_round_trip_and_rotation(tmp_path):
    for step in (10, 20, 30):
        path, model = _save(tmp_path, step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_20", "step_30"]
    assert resolve_resume(tmp_path, "latest") == path
    loaded = load_checkpoint(path, model_signature={"hidden": 8, "layers": 1}, data_fingerprint="data-a")
    assert loaded.state.ledger == {0: [1, 2, 3]} and loaded.state.step == 30
    torch.testing.assert_close(loaded.weights["weight"], model.weight.detach())
    opt = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters())
    opt.load_state_dict(loaded.optimizer_state)


def test_incomplete_checkpoint_is_ignored(tmp_path):
    path, _ = _save(tmp_path, 5)
    os.remove(path / "COMPLETE")
    (tmp_path / "checkpoints" / ".tmp-step_9-1").mkdir()
    assert list_checkpoints(tmp_path) == []
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        resolve_resume(tmp_path, "latest")
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        resolve_resume(tmp_path, str(path))


@pytest.mark.parametrize("damage", ["bytes", "truncated", "missing"])
def test_damaged_latest_checkpoint_is_named_and_resume_falls_back(tmp_path, caplog, damage):
    """Bytes overwritten in the weights (same size: NaN weights before this check), a cut file, a missing file:
    `latest` skips the damaged newest checkpoint with a warning naming it, an explicit path is refused."""
    older, _ = _save(tmp_path, 20)
    newest, _ = _save(tmp_path, 30)
    weights = newest / "drafter.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "bytes":
        data[-8:] = b"\xff" * 8  # the last bytes of the last tensor
        weights.write_bytes(bytes(data))
    elif damage == "truncated":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    else:
        os.remove(newest / "optimizer.pt")
    assert checkpoint_problem(older) is None and checkpoint_problem(newest) is not None
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(tmp_path, "latest") == older
    assert any("step_20" in r.getMessage() and "step_30" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="is damaged"):
        resolve_resume(tmp_path, str(newest))
    os.remove(older / "rng.pt")
    with pytest.raises(ConfigError, match="every checkpoint .* is damaged: step_30 .*; step_20 \\(rng.pt is missing\\)"):
        resolve_resume(tmp_path, "latest")


def test_resume_refuses_other_shape_or_data(tmp_path):
    path, _ = _save(tmp_path, 1)
    with pytest.raises(ConfigError, match="another model shape.*hidden"):
        load_checkpoint(path, model_signature={"hidden": 16, "layers": 1}, data_fingerprint="data-a")
    with pytest.raises(ConfigError, match="other data"):
        load_checkpoint(path, model_signature={"hidden": 8, "layers": 1}, data_fingerprint="data-b")


def test_warmup_then_cosine():
    f = [lr_factor(s, total_steps=100, warmup_ratio=0.1, min_lr_ratio=0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[-1] == pytest.approx(0.1, abs=0.01)


def test_entries_that_are_not_checkpoints_are_skipped_by_resume_and_rotation(tmp_path):
    """A user's `step_20.bak` copy (complete, even) and a stray `step_x` file beside the checkpoints: resume and
    rotation list only `step_N` folders, and leave the others alone."""
    import shutil

    first, _ = _save(tmp_path, 20)
    shutil.copytree(first, first.with_name("step_20.bak"))
    (first.parent / "step_x").write_text("notes")
    for step in (30, 40):
        path, _ = _save(tmp_path, step)  # rotation (keep_last=2) removes step_20 only
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_30", "step_40"]
    assert resolve_resume(tmp_path, "latest") == path
    assert (first.parent / "step_20.bak" / "COMPLETE").is_file() and (first.parent / "step_x").is_file()


def test_a_full_disk_during_a_checkpoint_is_named_and_the_last_good_one_kept(tmp_path, monkeypatch):
    """torch's writer fails as it does on a full disk; the error names the disk, the space needed and the fix, the
    temporary is gone and the earlier checkpoint still resumes."""
    from dflash_trainer.errors import StorageError
    from dflash_trainer.train import checkpoint as checkpoint_module

    good, _ = _save(tmp_path, 10)

    def full_disk(obj, f, *a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 470")

    monkeypatch.setattr(checkpoint_module.torch, "save", full_disk)
    with pytest.raises(StorageError) as caught:
        _save(tmp_path, 20)
    message = str(caught.value)
    assert "cannot write checkpoint step_20" in message and "GiB free" in message and "needs about" in message
    assert "disk mounted at" in message and "--resume continues from the last complete checkpoint, step_10" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_10"]  # no .tmp-step_20 left
    assert resolve_resume(tmp_path, "latest") == good


def test_a_file_size_limit_during_a_checkpoint_is_named(tmp_path):
    """A real file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored as `train` does) in a child process: torch's own
    failure becomes the StorageError, and no temporary stays."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from pathlib import Path
        from dflash_trainer.errors import StorageError
        from dflash_trainer.train.checkpoint import CheckpointState, save_checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, resource.RLIM_INFINITY))
        state = CheckpointState(step=1, epoch=0, ledger={{}}, model_signature={{}}, data_fingerprint="d",
                                scheduler={{}}, extra={{}})
        try:
            save_checkpoint(Path({str(tmp_path)!r}), state, {{"w": torch.zeros(10)}},
                            {{"state": {{0: {{"exp_avg": torch.zeros(300_000)}}}}}}, keep_last=1)
        except StorageError as e:
            print("STORAGE:", e)
            sys.exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot write checkpoint step_1" in proc.stdout and "ulimit -f" in proc.stdout, proc.stdout
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_legacy_ok_marker_is_used_with_a_loud_warning(tmp_path, caplog):
    path, _ = _save(tmp_path, 10)
    (path / "COMPLETE").write_text("ok\n")
    with caplog.at_level(logging.WARNING):
        assert checkpoint_problem(path) is None
    (record,) = [r for r in caplog.records if "legacy COMPLETE marker" in r.getMessage()]
    assert record.levelno == logging.WARNING and "cannot be detected" in record.getMessage()


def _touch(path):
    open(path, "w").close()


class _RunsCode:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return _touch, (self.path,)


def test_a_pickle_in_optimizer_pt_is_refused_and_never_run(tmp_path):
    path, _ = _save(tmp_path, 10)
    ran = tmp_path / "code-ran"
    torch.save({"state": {}, "param_groups": [], "x": _RunsCode(str(ran))}, path / "optimizer.pt")
    with pytest.raises(ConfigError, match=r"optimizer\.pt is not a checkpoint we wrote: it holds objects other"):
        load_checkpoint(path, model_signature={"hidden": 8, "layers": 1}, data_fingerprint="data-a")
    assert not ran.exists()


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fraction():
    f = [lr_factor(s, total_steps=100, warmup_ratio=0.1, min_lr_ratio=0.0, schedule="wsd", decay_ratio=0.2)
         for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(v == 1.0 for v in f[10:80])  # stable
    assert f[80] == pytest.approx(19 / 20) and f[99] == 0.0  # decay: 20 steps to zero
    assert all(a > b for a, b in zip(f[80:], f[81:]))
    from dflash_trainer.config import load_config
    from dflash_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match="train.schedule must be one of cosine, wsd"):
        load_config(None, ["train.schedule=step"])
    with pytest.raises(ConfigError, match="train.decay_ratio"):
        load_config(None, ["train.schedule=wsd", "train.decay_ratio=0.99"])
