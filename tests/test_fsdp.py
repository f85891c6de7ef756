"""FSDP2 drafters (`train.fsdp=true`, gloo on CPU): a split run with two sharded drafters trains every job once,
gathers full weights for checkpoints, the export and tau; its checkpoint resumes in an unsharded process. The
drafter is a DFlash2 one: its layers' convolutions and its selector (a unit of its own, used in the loss) shard
too."""

from __future__ import annotations

import json
from collections import Counter

import torch
from pipeline_helpers import (
    assert_ok,
    checkpoints,
    committed_jobs,
    metrics,
    planned_jobs,
    summary,
    torchrun,
    train_in_process,
)
from safetensors.torch import load_file


def test_fsdp_split_run_then_unsharded_resume(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_TEST_FAULT", raising=False)
    run_dir = tmp_path / "run"
    s = assert_ok(torchrun(run_dir, 3, "pipeline.colocated=false", "pipeline.num_targets=1", "train.fsdp=true",
                           "train.checkpoint_interval=3", "eval.at_end=true", "eval.num_prompts=2",
                           "eval.max_new_tokens=8", "drafter.variant=dflash2"))
    assert s["roles"] == ["target", "drafter", "drafter"]
    committed = committed_jobs(metrics(run_dir))
    assert not [j for j, n in Counter(committed).items() if n > 1]
    assert sorted(committed) == sorted(planned_jobs(run_dir))
    assert s["eval"]["tau"] >= 1.0  # the leader gathered the full drafter, the target rank evaluated it

    last = checkpoints(run_dir)[-1]
    assert last.name == f"step_{s['steps']}"
    saved = load_file(str(last / "drafter.safetensors"))
    exported = load_file(str(run_dir / "export" / "model.safetensors"))
    assert set(saved) == set(exported) and "candidate_selector.successor_codebook" in saved
    for name, tensor in saved.items():  # full (unsharded) shapes, the same weights
        torch.testing.assert_close(exported[name].float(), tensor)

    # The sharded run's checkpoint (weights and optimizer state by parameter name) resumes unsharded.
    assert train_in_process(run_dir, "train.num_epochs=2", "train.checkpoint_interval=3", resume=True) == 0
    s2 = summary(run_dir)
    assert s2["status"] == "ok" and s2["steps"] > s["steps"]
    assert s2["jobs_trained"]["1"] == s2["jobs_planned"]["1"]
    state = json.loads((checkpoints(run_dir)[-1] / "state.json").read_text())
    assert sorted(state["ledger"]["0"]) == sorted(planned_jobs(run_dir))


def test_sharding_choice():
    from dflash_trainer.train.parallel import want_sharding

    model = torch.nn.Linear(4, 4)
    cpu = torch.device("cpu")
    assert want_sharding(True, model, cpu, world=2) is True
    assert want_sharding(True, model, cpu, world=1) is False  # nothing to shard over
    assert want_sharding(False, model, cpu, world=4) is False
    assert want_sharding(None, model, cpu, world=4) is False  # auto: GPUs only


def test_fsdp_muon_run_then_unsharded_resume(tmp_path, monkeypatch):
    """`train.optimizer=muon` with sharded drafters: Muon orthogonalises each gathered matrix, the codebooks (AdamW)
    shard as before; the checkpoint holds every matrix's whole momentum and resumes unsharded."""
    monkeypatch.delenv("DFLASH_TEST_FAULT", raising=False)
    run_dir = tmp_path / "run"
    s = assert_ok(torchrun(run_dir, 3, "pipeline.colocated=false", "pipeline.num_targets=1", "train.fsdp=true",
                           "train.checkpoint_interval=3", "drafter.variant=dflash2", "train.optimizer=muon"))
    assert s["roles"] == ["target", "drafter", "drafter"]
    assert sorted(committed_jobs(metrics(run_dir))) == sorted(planned_jobs(run_dir))
    state = torch.load(checkpoints(run_dir)[-1] / "optimizer.pt", weights_only=True)
    saved = load_file(str(checkpoints(run_dir)[-1] / "drafter.safetensors"))
    momentum = state["state"]["fc.weight"]["momentum_buffer"]
    assert momentum.shape == saved["fc.weight"].shape and momentum.abs().sum() > 0  # whole, and trained
    assert "exp_avg" in state["state"]["candidate_selector.predecessor_codebook"]

    assert train_in_process(run_dir, "train.num_epochs=2", "train.checkpoint_interval=3", resume=True) == 0
    s2 = summary(run_dir)
    assert s2["status"] == "ok" and s2["jobs_trained"]["1"] == s2["jobs_planned"]["1"]
