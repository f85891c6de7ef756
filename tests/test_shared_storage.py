"""Shared storage seen from two nodes, each node a process of its own: one writer of a run dir, checkpoints that a
reader on the other node never sees half written, and a node that does not see rank 0's run dir stops, named."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
import torch

from dflash_trainer.config import load_config
from dflash_trainer.errors import ConfigError
from dflash_trainer.rundir import RunDir, claim_run_dir
from dflash_trainer.runtime.shared_storage import check_sees_token, publish_token
from dflash_trainer.train.checkpoint import CheckpointState, checkpoint_problem, list_checkpoints, save_checkpoint

SPAWN = mp.get_context("spawn")  # a fresh interpreter, as on another machine


def _claim_and_hold(run_dir: str, claimed, release) -> None:
    claim = claim_run_dir(load_config("demo", [f"run.dir={run_dir}"]), "train")
    claimed.set()
    release.wait(60)
    claim.release()


def test_a_second_node_cannot_claim_the_run_dir_another_one_holds(tmp_path):
    """Two jobs started into one run dir by mistake (each node launched alone): the second is refused while the
    first writes it, and may claim it once the first let go."""
    run_dir = tmp_path / "run"
    claimed, release = SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(target=_claim_and_hold, args=(str(run_dir), claimed, release))
    holder.start()
    try:
        assert claimed.wait(60)
        with pytest.raises(ConfigError, match="another dflash-train command is writing run.dir"):
            claim_run_dir(load_config("demo", [f"run.dir={run_dir}"]), "train")
    finally:
        release.set()
        holder.join(60)
    assert holder.exitcode == 0
    claim_run_dir(load_config("demo", [f"run.dir={run_dir}"]), "train").release()


def test_a_filesystem_without_locks_is_named_not_trusted(tmp_path, monkeypatch):
    """flock failing for want of support (some NFS and Lustre mounts) would let two writers in: refused, named."""
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(ConfigError, match=r"does not support flock.*Lustre: -o flock"):
        claim_run_dir(load_config("demo", [f"run.dir={tmp_path / 'run'}"]), "train")
    assert not (tmp_path / "run").exists()  # the failed claim leaves no directory it made


def _write_checkpoints(run_dir: str, steps: int) -> None:
    torch.manual_seed(0)
    weights = {"w": torch.randn(256, 256)}
    optimizer = {"state": {0: {"exp_avg": torch.randn(256, 256)}}, "param_groups": []}
    for step in range(1, steps + 1):
        state = CheckpointState(step=step, epoch=0, ledger={0: list(range(step))}, model_signature={"h": 256},
                                data_fingerprint="d", scheduler={}, extra={})
        save_checkpoint(Path(run_dir), state, weights, optimizer, keep_last=steps)  # no rotation under the reader


def test_a_reader_on_another_node_never_sees_a_checkpoint_half_written(tmp_path):
    """One process writes 40 checkpoints while this one lists them as a resume would: every checkpoint it lists is
    whole (every file there, with the size and CRC-32 its COMPLETE records); the temporaries never show."""
    writer = SPAWN.Process(target=_write_checkpoints, args=(str(tmp_path), 40))
    writer.start()
    seen: set[str] = set()
    while writer.is_alive() or not seen:
        for path in list_checkpoints(tmp_path):
            if path.name not in seen:
                assert checkpoint_problem(path) is None, path
                seen.add(path.name)
        time.sleep(0.005)
    writer.join(60)
    assert writer.exitcode == 0 and len(seen) >= 2  # it read some while the writer went on
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step_{s}" for s in range(1, 41)]


def _check(run_dir: str, token: str, timeout_s: float, errors) -> None:
    try:
        check_sees_token(Path(run_dir), token, timeout_s=timeout_s, poll_s=0.05)
    except ConfigError as e:
        errors.put(str(e))
    else:
        errors.put("")


def _checked(run_dir: Path, token: str, timeout_s: float, after=None) -> str:
    """What a process standing for another node says of the run dir ('' when it sees rank 0's token); `after` runs
    here while it waits."""
    errors = SPAWN.Queue()
    node = SPAWN.Process(target=_check, args=(str(run_dir), token, timeout_s, errors))
    node.start()
    if after is not None:
        after()
    node.join(60)
    return errors.get(timeout=10)


def test_a_node_that_sees_another_directory_at_the_run_dir_path_stops_named(tmp_path):
    """Rank 0's run dir and the other node's directory of that name differ (a node-local disk, perhaps holding an
    older run at that path): the other node stops the run, naming the run dir and the fix."""
    shared, local = tmp_path / "shared", tmp_path / "node1-local"
    shared.mkdir()
    local.mkdir()
    token = publish_token(shared)
    publish_token(local)  # an older run's token at the same path on that node
    message = _checked(local, token, timeout_s=0.5)
    assert "is not the directory rank 0 claimed" in message and "another run's token" in message
    assert "shared storage" in message
    assert "no such file" in _checked(tmp_path / "empty", token, timeout_s=0.3)
    assert _checked(shared, token, timeout_s=0.5) == ""


def test_a_node_whose_view_lags_waits_for_rank_0s_token(tmp_path):
    """A shared filesystem that shows the token to the other node a second late (NFS's directory cache): the node
    waits and goes on."""
    token = "0123456789abcdef"
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def late_write():
        time.sleep(1.0)
        RunDir(run_dir).shared_check.write_text(token)

    assert _checked(run_dir, token, timeout_s=20, after=late_write) == ""


def test_rank_0_publishes_its_run_dir_as_an_absolute_path(tmp_path, monkeypatch):
    """run.dir relative (or the default runs/NAME-TIME): every rank reads rank 0's folder, not the folder of that
    name under its own working folder (nodes launched from different folders, with the storage at one path)."""
    from dflash_trainer.runtime.control import ControlPlane, make_local_store
    from dflash_trainer.runtime.env import DistEnv
    from dflash_trainer.runtime.setup import _shared_run_dir

    monkeypatch.chdir(tmp_path)
    control = ControlPlane(make_local_store(), rank=0)
    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=1)
    claims = []
    run_dir = _shared_run_dir(load_config("demo", ["run.dir=runs/x"]), env, control, on_claim=claims.append)
    claims[0].release()
    assert run_dir == Path("runs/x") and control.wait_value("run_dir") == str(tmp_path / "runs" / "x")
    elsewhere = tmp_path / "node1"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # rank 1, on another node, in another folder
    other = DistEnv(rank=1, world_size=2, local_rank=0, local_world_size=1)
    found = _shared_run_dir(load_config("demo", ["run.dir=runs/x"]), other, ControlPlane(control.store, rank=1),
                            on_claim=claims.append)
    assert found == tmp_path / "runs" / "x"
