"""A drafter of a Gemma-family target (its embedding module scales the table by sqrt(hidden)) is trained on scaled
block embeddings; the export records the scale (`dflash_config.input_embedding_scale`) where vLLM's DFlash2 class and
the `dflash` reference read it, warns where vLLM's DFlash class reads none, and the speculators format (vLLM's, which
drops the field) refuses it. A target without a scale exports as before."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.export import export_drafter
from dflash_trainer.drafter.export_speculators import export_speculators
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.head import head_from_model
from tests.drafter_helpers import single_thread, tiny_drafter  # noqa: F401 (single_thread: autouse fixture)

HAVE_DFLASH = importlib.util.find_spec("dflash") is not None


def _gemma(dtype=torch.float32):
    """A tiny Gemma 3 target config (hidden 48: sqrt(48) is not a round number in any dtype) and a drafter for it."""
    config = Gemma3TextConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                              sliding_window=32, dtype=dtype)
    spec = drafter_spec(config, DrafterConfig(num_layers=1, block_size=4, gamma=2.0, variant="dflash2"),
                        mask_token_id=95)
    torch.manual_seed(0)
    return config, DFlashDrafter(spec).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gemma_export_records_the_scale_its_blocks_were_embedded_with(tmp_path, dtype):
    config, drafter = _gemma(dtype)
    export_drafter(drafter, tmp_path, target_config=config)
    scale = json.loads((tmp_path / "config.json").read_text())["dflash_config"]["input_embedding_scale"]
    # what the engines reading the field compute (the raw table times it) is what training embedded the block with
    torch.manual_seed(1)
    target = AutoModelForCausalLM.from_config(config).to(dtype)
    ids = torch.arange(config.vocab_size)
    trained = torch.nn.functional.embedding(ids, head_from_model(target).embed_weight)
    raw = torch.nn.functional.embedding(ids, target.get_input_embeddings().weight)
    assert scale == pytest.approx(48 ** 0.5, rel=1e-2)
    torch.testing.assert_close(raw * scale, trained, rtol=0, atol=0)
    assert not torch.equal(raw, trained)  # unscaled, as vLLM's DFlash class serves it, the blocks differ
    if HAVE_DFLASH:  # the reference reads the scale from the export as it loads it, and embeds the block with it
        from dflash.model import DFlash2DraftModel, _draft_value, _raw_input_embeddings

        loaded = DFlash2DraftModel.from_pretrained(str(tmp_path), dtype=dtype)
        read = float(_draft_value(loaded.config, "input_embedding_scale", 1.0))
        torch.testing.assert_close(_raw_input_embeddings(target, ids[None], read)[0], trained, rtol=0, atol=0)


def test_a_target_without_a_scale_records_none(tmp_path):
    drafter, target = tiny_drafter()
    export_drafter(drafter, tmp_path, target_config=target)
    assert "input_embedding_scale" not in json.loads((tmp_path / "config.json").read_text())["dflash_config"]


@pytest.mark.parametrize("variant, warned", [("dflash", True), ("dflash2", False)])
def test_vllm_s_dflash_class_without_the_scale_is_warned_about(tmp_path, caplog, variant, warned):
    from dflash_trainer.drafter.embedding_scale import _warn_vllm_unscaled

    _warn_vllm_unscaled.cache_clear()
    config, _ = _gemma()
    spec = drafter_spec(config, DrafterConfig(num_layers=1, block_size=4, gamma=2.0, variant=variant),
                        mask_token_id=95)
    with caplog.at_level(logging.WARNING):
        export_drafter(DFlashDrafter(spec), tmp_path, target_config=config)
    said = "vLLM 0.33 serves it with the raw embedding table" in caplog.text
    assert said == warned, caplog.text
    if warned:
        assert "train drafter.variant=dflash2" in caplog.text and "SGLang and the `dflash` reference" in caplog.text
    caplog.clear()
    export_drafter(DFlashDrafter(spec), tmp_path / "again", target_config=config)  # a run's next best drafter
    assert "vLLM 0.33 serves it" not in caplog.text  # said once


def test_the_speculators_format_refuses_a_scaled_drafter(tmp_path):
    config, drafter = _gemma()
    with pytest.raises(ConfigError, match=r"cannot serve this drafter as trained: the target scales its embeddings "
                                          r"by 6\.9282.* Export a drafter.variant=dflash2 drafter with --format dflash"):
        export_speculators(drafter, tmp_path / "spec", verifier="google/gemma-3-tiny", target_config=config,
                           verifier_is_target=True)
    assert not (tmp_path / "spec").exists()
