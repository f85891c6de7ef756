"""Weights we load are checked for NaN and infinity when loaded, and the error names the file: an export read by
`eval` or `drafter.init_from`, a checkpoint's drafter read by `export`, `eval` or `drafter.init_from`."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trainer.cli import main
from dflash_trainer.config import load_config
from dflash_trainer.data.tokenizer import load_tokenizer
from dflash_trainer.drafter.export import export_drafter, init_from_export, load_drafter
from dflash_trainer.drafter.spec import drafter_spec, first_spare_row
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.load import target_model_config
from dflash_trainer.train.trainer import build_drafter
from tests.drafter_helpers import single_thread, tiny_drafter  # noqa: F401 (single_thread: autouse fixture)
from tests.test_export_safety import _checkpoint

BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _spoil(weights, value):
    weights["layers.1.mlp.up_proj.weight"].view(-1)[3] = value
    weights["fc.weight"].view(-1)[0] = value


@pytest.mark.parametrize("value", list(BAD))
def test_an_export_with_non_finite_weights_is_named_when_loaded(tmp_path, value):
    drafter, target = tiny_drafter()
    with torch.no_grad():
        _spoil(dict(drafter.named_parameters()), BAD[value])
    export_drafter(drafter, tmp_path / "export", target_config=target)
    weights = tmp_path / "export" / "model.safetensors"
    for load in (lambda: load_drafter(tmp_path / "export"), lambda: init_from_export(tiny_drafter()[0], tmp_path / "export")):
        with pytest.raises(ConfigError) as raised:
            load()
        message = str(raised.value)
        assert f"{weights} holds NaN or infinite weights (2 of its" in message
        assert "fc.weight, layers.1.mlp.up_proj.weight" in message and "export the drafter again" in message


def test_eval_of_an_export_with_nan_weights_stops_naming_the_file(tmp_path, capsys):
    drafter, target = tiny_drafter()
    with torch.no_grad():
        drafter.norm.weight[0] = float("nan")
    export_drafter(drafter, tmp_path / "export", target_config=target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["eval", "--drafter", str(tmp_path / "export"), "--out", str(tmp_path / "out"),
                 f"eval.prompts={prompts}", "target.random_init=tiny", "target.tokenizer=tiny", "run.device=cpu"]) == 2
    assert f"{tmp_path / 'export' / 'model.safetensors'} holds NaN or infinite weights" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_checkpoint_with_non_finite_weights_is_named_by_export_and_init_from(tmp_path, capsys, value):
    ckpt, args, _ = _checkpoint(tmp_path / "run", damage=lambda w: _spoil(w, BAD[value]))
    weights = ckpt / "drafter.safetensors"
    assert main([*args, "--out", str(tmp_path / "export")]) == 2
    assert f"{weights} holds NaN or infinite weights" in capsys.readouterr().err
    assert not (tmp_path / "export").exists()
    config = load_config("demo", [f"drafter.init_from={ckpt}"])
    spec = drafter_spec(target_model_config(config.target), config.drafter,
                        mask_token_id=first_spare_row(load_tokenizer(config.target, config.data.chat_template)))
    with pytest.raises(ConfigError, match=f"{weights} holds NaN or infinite weights .*start from another checkpoint"):
        build_drafter(config, spec, torch.device("cpu"))


def test_a_resume_from_a_checkpoint_with_nan_weights_names_the_file(tmp_path):
    """A checkpoint whose old-style marker is not checksummed, with damaged weights: the resume stops when it reads
    them, naming the file, instead of training steps of NaN and blaming the data or the lr."""
    from dflash_trainer.train.checkpoint import load_checkpoint

    ckpt, _, _ = _checkpoint(tmp_path / "run", damage=lambda w: _spoil(w, float("nan")))
    with pytest.raises(ConfigError, match=r"drafter\.safetensors.*(NaN|nan|not finite).*resume from an earlier checkpoint"):
        load_checkpoint(ckpt, model_signature={}, data_fingerprint="")
