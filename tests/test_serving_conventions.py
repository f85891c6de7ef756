"""What the serving engines hold an export to, checked without the engines: taps in layer order, and a warning for
a target that neither vLLM nor SGLang can verify with (scripts/serving-check.sh runs the engines' own classes)."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import Gemma3TextConfig

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.engines import engines_without_support
from dflash_trainer.drafter.export import export_drafter, read_export
from dflash_trainer.errors import ConfigError
from tests.drafter_helpers import single_thread, tiny_drafter  # noqa: F401 (single_thread: autouse fixture)


def test_taps_listed_out_of_layer_order_are_refused(tmp_path):
    """vLLM and SGLang concatenate the target's taps in layer order (vLLM's aux hidden states, SGLang's
    `set_dflash_layers_to_capture`): a drafter whose fc learned another order would be served wrong."""
    with pytest.raises(ConfigError, match=r"increasing order, got \[3, 1\].* list them as \[1, 3\]"):
        DrafterConfig(tap_layer_ids=[3, 1])
    with pytest.raises(ConfigError, match="increasing order"):
        tiny_drafter(tap_layer_ids=[4, 2])
    drafter, target = tiny_drafter(tap_layer_ids=[2, 4])
    export_drafter(drafter, tmp_path / "e", target_config=target)
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [2, 4]
    config["dflash_config"]["target_layer_ids"] = [4, 2]  # an export from elsewhere, in another order
    (tmp_path / "e" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="increasing order"):
        read_export(tmp_path / "e")


def test_export_warns_when_no_engine_can_verify_with_the_target(tmp_path, caplog):
    drafter, target = tiny_drafter()
    with caplog.at_level(logging.WARNING):
        export_drafter(drafter, tmp_path / "qwen3", target_config=target)
    assert "no DFlash verifier" not in caplog.text
    gemma3 = Gemma3TextConfig(hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                              num_hidden_layers=target.num_hidden_layers, architectures=["Gemma3ForCausalLM"])
    with caplog.at_level(logging.WARNING):
        export_drafter(drafter, tmp_path / "gemma3", target_config=gemma3)
    assert "Gemma3ForCausalLM has no DFlash verifier in vLLM 0.33.0 or SGLang 0.5.23" in caplog.text
    assert (tmp_path / "gemma3" / "model.safetensors").is_file()  # a warning: the export is still written
    # one engine only: SGLang has no Qwen2 hook, vLLM does; a class named by model type alone is looked up too
    assert engines_without_support({"model_type": "qwen2"}) == ["SGLang 0.5.23"]
    assert engines_without_support({"model_type": "qwen3"}) == []
    assert engines_without_support({"model_type": "no-such-type"}) == []  # unknown class: nothing to say
