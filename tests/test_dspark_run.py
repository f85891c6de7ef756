"""A DSpark drafter through the whole tool: `dflash-train train` (the demo recipe shrunk, in this process), a
checkpoint, `--resume` from it, `export`, and `eval` of our own export, which drafts every slot of the block."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_trainer.cli import main
from dflash_trainer.drafter.export import load_drafter
from dflash_trainer.drafter.export_speculators import export_speculators
from dflash_trainer.errors import ConfigError
from tests.pipeline_helpers import checkpoints, metrics, summary, train_in_process

DSPARK = ("drafter.variant=dspark", "drafter.markov_rank=16", "drafter.block_size=4", "drafter.gamma=2",
          "train.checkpoint_interval=2", "pipeline.colocated=true", "eval.num_prompts=2", "eval.max_new_tokens=8")


def test_dspark_trains_resumes_exports_and_evaluates(tmp_path):
    run = tmp_path / "run"
    assert train_in_process(run, *DSPARK, "train.max_steps=4") == 0
    first = metrics(run)
    assert [r["step"] for r in first if "loss" in r][-1] == 4
    assert len(first[-1]["slot_acc"]) == 4  # one accuracy per drafting slot, the anchor's too
    ckpt = checkpoints(run)[-1]
    state = load_file(str(ckpt / "drafter.safetensors"))
    assert state["markov_head.markov_w1.weight"].shape[1] == 16

    # a new session resumes from step 4 and ends with the tau evaluation and held-out validation of the variant
    assert train_in_process(run, *DSPARK, "train.max_steps=6", "eval.at_end=true", resume=True) == 0
    resumed = [r for r in metrics(run) if "loss" in r and r["step"] > 4]
    assert [r["step"] for r in resumed] == [5, 6]
    result = summary(run)
    assert result["status"] == "ok" and result["eval"]["tau"] >= 1.0
    assert result["eval"]["val"]["anchors"] > 0

    out = tmp_path / "export"
    last = checkpoints(run)[-1]
    assert main(["export", "--checkpoint", str(last), "--out", str(out), "--config", str(run / "config.yaml")]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 16
    assert config["dflash_config"]["projector_type"] == "dspark" and config["block_size"] == 4
    drafter = load_drafter(out)
    weights = load_file(str(last / "drafter.safetensors"))
    assert drafter.spec.variant == "dspark" and drafter.spec.draft_length == 4
    assert torch.equal(drafter.markov_w2.weight.float(), weights["markov_head.markov_w2.weight"].float())

    assert main(["eval", "--drafter", str(out), "--config", str(run / "config.yaml"), "--out", str(tmp_path / "ev"),
                 "eval.num_prompts=2", "eval.max_new_tokens=8"]) == 0
    report = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert report["block_size"] == 5 and len(report["acceptance_histogram"]) == 5  # 4 drafts, verified with 1 more
    assert report["greedy_match_rate"] == 1.0

    with pytest.raises(ConfigError, match="a DSpark drafter exports in the dflash format only"):
        export_speculators(drafter, tmp_path / "spec", verifier=str(tmp_path))


def test_dspark_trains_sharded(tmp_path, monkeypatch):
    """FSDP2 (`train.fsdp=true`, gloo on CPU), three colocated ranks whose drafters are sharded: the Markov head, in
    the root unit, is used by the loss after the forward; the run trains, gathers the full head for its checkpoint
    and export, and evaluates."""
    from tests.pipeline_helpers import assert_ok, torchrun

    monkeypatch.delenv("DFLASH_TEST_FAULT", raising=False)
    run = tmp_path / "run"
    s = assert_ok(torchrun(run, 3, "train.fsdp=true", "eval.at_end=true", *DSPARK))
    assert s["roles"] == ["colocated"] * 3 and s["eval"]["tau"] >= 1.0
    saved = load_file(str(checkpoints(run)[-1] / "drafter.safetensors"))
    exported = load_file(str(run / "export" / "model.safetensors"))
    assert saved["markov_head.markov_w2.weight"].shape == (exported["markov_head.markov_w2.weight"].shape[0], 16)
    for name, tensor in saved.items():
        torch.testing.assert_close(exported[name].float(), tensor)
    rows = [r for r in metrics(run) if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"]
