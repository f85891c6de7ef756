"""A run repeats: the same seed and recipe with `pipeline.deterministic=true` (the bench cells' setting) train the
same drafter, bit for bit on the CPU, and a different seed does not."""

from __future__ import annotations

from pipeline_helpers import metrics, train_in_process
from safetensors.torch import load_file


def _trained(run_dir, *extra):
    assert train_in_process(run_dir, "train.max_steps=4", "train.checkpoint_interval=4",
                            "pipeline.deterministic=true", *extra) == 0
    weights = load_file(str(run_dir / "checkpoints" / "step_4" / "drafter.safetensors"))
    losses = [r["loss"] for r in metrics(run_dir) if "loss" in r]
    return weights, losses


def test_the_same_seed_trains_the_same_drafter_and_another_seed_does_not(tmp_path):
    first, first_losses = _trained(tmp_path / "a", "run.seed=3")
    again, again_losses = _trained(tmp_path / "b", "run.seed=3")
    other, _ = _trained(tmp_path / "c", "run.seed=4")
    assert first_losses == again_losses and len(first_losses) >= 1
    assert first.keys() == again.keys()
    assert all((first[k] == again[k]).all() for k in first)
    assert any(not (first[k] == other[k]).all() for k in first)
