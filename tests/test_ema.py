"""`train.ema_decay`: the weight average's arithmetic, and a run that evaluates, exports, checkpoints and resumes it."""

from __future__ import annotations

import pytest
import torch
from pipeline_helpers import train_in_process
from safetensors.torch import load_file

from dflash_trainer.train.ema import WeightAverage, split_averaged


def test_the_average_moves_towards_the_weights_by_one_minus_decay():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)  # frozen: not averaged
    start = model.weight.detach().clone()
    average = WeightAverage(model, decay=0.75)
    assert average.names == ["weight"]
    with torch.no_grad():
        model.weight.add_(4.0)
    average.update()
    assert torch.allclose(average.average[0], start + 1.0)  # 0.75 * w + 0.25 * (w + 4)
    state = average.averaged_state(model)
    assert torch.equal(state["weight"], start + 1.0) and torch.equal(state["bias"], model.bias)
    saved = average.state_dict()
    assert list(saved) == ["ema.weight"]
    other = WeightAverage(model, decay=0.75)
    assert other.load_state_dict(saved) and torch.equal(other.average[0], saved["ema.weight"])
    assert not other.load_state_dict({"weight": start})  # a checkpoint without an average


def test_a_run_exports_and_checkpoints_its_average_and_resume_keeps_it(tmp_path, caplog):
    run = tmp_path / "run"
    quick = ("train.ema_decay=0.5", "train.max_steps=4", "train.checkpoint_interval=2", "eval.at_end=false",
             "logging.report=false")
    assert train_in_process(run, *quick) == 0
    ckpt = load_file(str(run / "checkpoints" / "step_4" / "drafter.safetensors"))
    raw, averaged = split_averaged(ckpt)
    assert set(averaged) == {"ema." + k for k in raw}
    exported = load_file(str(run / "export" / "model.safetensors"))
    for name, tensor in exported.items():  # the export is the average, not the last weights
        assert torch.allclose(tensor.float(), averaged["ema." + name].to(tensor.dtype).float()), name
    assert any(not torch.allclose(raw[k], averaged["ema." + k]) for k in raw)

    from dflash_trainer.cli import main

    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(run / "checkpoints" / "step_4"), "--out", str(out)]) == 0
    again = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(again[k], exported[k]) for k in exported)

    with caplog.at_level("INFO"):
        assert train_in_process(run, *quick[:1], "train.max_steps=6", *quick[2:], resume=True) == 0
    assert "weight average (train.ema_decay): resumed" in caplog.text
    _, resumed = split_averaged(load_file(str(run / "checkpoints" / "step_6" / "drafter.safetensors")))
    assert set(resumed) == set(averaged)


def test_ema_decay_is_validated():
    from dflash_trainer.config import load_config
    from dflash_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.ema_decay must be in \(0, 1\)"):
        load_config(None, ["train.ema_decay=1.0"])
