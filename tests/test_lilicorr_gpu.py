"""LiLiCorr on CUDA (skipped on CPU; run on the device machine): a colocated bf16 run with compiled flex attention
trains the lattice terms (the penalty from the captured last hidden state included) to finite losses, and its
evaluation walks the lattice losslessly."""

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("conv", ["false", "true"])
def test_lilicorr_colocated_training_and_eval_run_on_cuda(conv, tmp_path):
    from dflash_trainer.cli import main

    run = tmp_path / "run"
    rc = main(["train", "--config", "demo", f"run.dir={run}", "run.device=cuda", "target.dtype=bfloat16",
               "train.dtype=bfloat16", "drafter.attention=flex", "train.max_steps=6", "train.num_epochs=1",
               "data.max_conversations=120", "logging.progress=false", f"data.cache_dir={tmp_path / 'cache'}",
               "drafter.variant=lilicorr", f"drafter.lilicorr_conv={conv}", "drafter.lilicorr_w_margin=0.1"])
    assert rc == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 6
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 6 and all(isinstance(x, float) and x > 0 for x in losses)  # finite (NaN is logged null)
    ev = summary["eval"]
    assert ev["greedy_match_rate"] is not None and sum(ev["acceptance_histogram"]) > 0  # bf16: not always 1
    assert ev["val"]["walk_steps"] > 0 and 1.0 <= ev["val"]["walk_tau"] <= 8.0
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["architectures"] == ["LiLiCorrDraftModel"]
