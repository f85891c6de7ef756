"""A LiLiCorr run through the real trainer (`dflash-train train`, one process, the tiny demo): it trains with its
lattice terms (the distractor penalty from the target's captured last hidden state included), checkpoints, resumes
on the uninterrupted loss curve, and exports a drafter the engines' format names."""

from __future__ import annotations

import json

import pytest
import torch
from pipeline_helpers import assert_ok, checkpoints, metrics, torchrun, train_in_process

from dflash_trainer.drafter.export import load_drafter
from dflash_trainer.faults import InjectedFault

LATTICE = ("drafter.variant=lilicorr", "drafter.lilicorr_candidate_topk=4", "drafter.lilicorr_hidden_size=32",
           "drafter.lilicorr_num_heads=2", "drafter.lilicorr_factor_dim=16", "drafter.lilicorr_w_margin=0.1")
DETERMINISTIC = ("pipeline.deterministic=true", "train.grad_accum=1", "train.checkpoint_interval=2")


@pytest.mark.parametrize("conv", [False, True])
def test_lilicorr_trains_checkpoints_and_resumes_on_the_uninterrupted_curve(conv, tmp_path, monkeypatch, capsys):
    """Run 2 fails before optimizer step 3 (checkpoint at 2) and resumes: its losses are the uninterrupted run's."""
    extra = LATTICE + DETERMINISTIC + ("train.max_steps=4",) + (("drafter.lilicorr_conv=true",) if conv else ())
    whole, split = tmp_path / "whole", tmp_path / "split"
    monkeypatch.delenv("DFLASH_TEST_FAULT", raising=False)
    assert train_in_process(whole, *extra) == 0
    monkeypatch.setenv("DFLASH_TEST_FAULT", "drafter_step:3")
    with pytest.raises(InjectedFault):
        train_in_process(split, *extra)
    monkeypatch.delenv("DFLASH_TEST_FAULT")
    assert [c.name for c in checkpoints(split)][-1] == "step_2"
    assert train_in_process(split, *extra, resume=True) == 0
    want = [r["loss"] for r in metrics(whole) if "jobs" in r]
    got = [r["loss"] for r in metrics(split) if "jobs" in r]
    assert len(want) == 4 and torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6), (got, want)
    export = next(p.parent for p in whole.rglob("config.json") if "LiLiCorrDraftModel" in p.read_text())
    config = json.loads((export / "config.json").read_text())
    assert (config["dflash_config"]["conv_kernel_size"] > 0) == conv
    drafter = load_drafter(export)
    assert drafter.spec.variant == "lilicorr" and drafter.lilicorr.top_k == 4
    # a changed lattice head is another drafter: the checkpoint refuses to resume into it
    capsys.readouterr()
    rc = train_in_process(split, *extra, "drafter.lilicorr_factor_dim=8", resume=True)
    assert rc == 2 and "drafter.lilicorr_factor_dim: 16 -> 8" in capsys.readouterr().err
    # the checkpoint's own guard, for a config.yaml edited by hand
    config_file = split / "config.yaml"
    config_file.write_text(config_file.read_text().replace("lilicorr_factor_dim: 16", "lilicorr_factor_dim: 8"))
    rc = train_in_process(split, *extra, "drafter.lilicorr_factor_dim=8", resume=True)
    err = capsys.readouterr().err
    assert rc == 2 and "of another model shape" in err and "'factor_dim': 16" in err, err


def test_lilicorr_trains_sharded(tmp_path, monkeypatch):
    """FSDP2 (gloo on CPU), two sharded drafters: the lattice head (a unit of its own, used in the loss) and the
    anchor contexts (fc and hidden_norm gathered outside the forwards) train; the full drafter is exported and
    evaluated."""
    monkeypatch.delenv("DFLASH_TEST_FAULT", raising=False)
    run_dir = tmp_path / "run"
    s = assert_ok(torchrun(run_dir, 3, "pipeline.colocated=false", "pipeline.num_targets=1", "train.fsdp=true",
                           "eval.at_end=true", "eval.num_prompts=2", "eval.max_new_tokens=8", *LATTICE,
                           "drafter.lilicorr_conv=true", "train.max_steps=4"))
    assert s["roles"] == ["target", "drafter", "drafter"] and s["steps"] == 4 and s["eval"]["tau"] >= 1.0
    drafter = load_drafter(run_dir / "export")
    assert drafter.spec.variant == "lilicorr" and drafter.spec.block_conv
