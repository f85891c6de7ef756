"""A drafter checked against what it meets: an export evaluated on another target (vocabulary, depth, width) or
whose config.json was edited by hand is an error naming both values, before any decoding."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_trainer.cli import main
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.export import export_drafter, load_drafter
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.drafter_eval import check_drafter_fits
from dflash_trainer.target.presets import preset_config
from tests.drafter_helpers import tiny_drafter

TINY = ["target.random_init=tiny", "target.tokenizer=tiny", "run.device=cpu", "eval.num_prompts=1",
        "eval.max_new_tokens=4", "logging.progress=false"]


def _config(**changes) -> Qwen3Config:
    config = preset_config("tiny").to_dict() | changes
    config.pop("layer_types", None)  # derived again from num_hidden_layers
    return Qwen3Config(**config)


def _target(**changes) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(_config(**changes))


def _drafter_for(**changes) -> DFlashDrafter:
    """A drafter made for the tiny target with `changes` to that target's config."""
    spec = drafter_spec(_config(**changes), DrafterConfig(num_layers=1, block_size=4, gamma=2.0), mask_token_id=100)
    return DFlashDrafter(spec)


def test_a_drafter_of_the_same_target_fits():
    drafter, _ = tiny_drafter()
    check_drafter_fits(drafter.spec, _target(), where="d")  # no error


@pytest.mark.parametrize("change, named", [
    ({"vocab_size": 777}, "vocab_size {vocab} (the drafter's: 777)"),
    ({"num_hidden_layers": 9}, "decoder layers {layers} (the drafter's: 9)"),
    ({"hidden_size": 96}, "drafter hidden size 96 != target hidden size {hidden}"),
])
def test_a_drafter_made_for_another_target_is_named_with_both_values(change, named):
    tiny = preset_config("tiny")
    drafter = _drafter_for(**change)
    with pytest.raises(ConfigError) as raised:
        check_drafter_fits(drafter.spec, _target(), where="EXPORT")
    message = str(raised.value)
    assert "drafter EXPORT" in message
    assert named.format(vocab=tiny.vocab_size, layers=tiny.num_hidden_layers, hidden=tiny.hidden_size) in message


def test_eval_of_an_export_for_another_vocabulary_stops_before_decoding(tmp_path, capsys):
    export = tmp_path / "other-vocab"
    export_drafter(_drafter_for(vocab_size=777), export)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["eval", "--drafter", str(export), "--out", str(tmp_path / "out"), f"eval.prompts={prompts}",
                 *TINY]) == 2
    err = capsys.readouterr().err
    assert f"drafter {export} was made for another target" in err and "(the drafter's: 777)" in err
    assert not (tmp_path / "out" / "eval.json").exists()


@pytest.mark.parametrize("field, value", [("intermediate_size", 100), ("num_attention_heads", 2),
                                          ("num_key_value_heads", 1), ("hidden_size", 48)])
def test_a_hand_edited_export_config_is_named_not_a_traceback(tmp_path, field, value):
    drafter, target = tiny_drafter()
    export_drafter(drafter, tmp_path, target_config=target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config[field] != value
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as raised:
        load_drafter(tmp_path)
    message = str(raised.value)
    assert str(tmp_path / "config.json") in message and "restore it or export the drafter again" in message


@pytest.mark.parametrize("damage", [b"\xff\xfe not UTF-8", b'{"hidden_size": 64, "num_hid', b"[1, 2]"])
def test_a_damaged_export_config_is_named_not_a_traceback(tmp_path, damage):
    drafter, target = tiny_drafter()
    export_drafter(drafter, tmp_path, target_config=target)
    (tmp_path / "config.json").write_bytes(damage)
    with pytest.raises(ConfigError, match=r"config.json is not a drafter export config .*export the drafter again"):
        load_drafter(tmp_path)


def test_a_cut_export_weights_file_is_named_not_a_traceback(tmp_path):
    drafter, target = tiny_drafter()
    export_drafter(drafter, tmp_path, target_config=target)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match=r"model.safetensors is unreadable .*cut short or damaged; export the drafter"):
        load_drafter(tmp_path)
