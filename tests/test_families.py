"""The target families the engines verify DFlash drafters for, each end to end on the CPU from a tiny random config
of its own config class (`target/presets.py`): tap capture equals HF's hidden states, a training run (taps, early
exit, the target's head and final norm), the export in both formats, `eval` lossless against plain decoding, and
which engines will serve the drafter (`drafter/engines.py`, the engines' class lists). The README's family matrix
is this table. Each family runs with its own chat format (`tiny:<family>`: its special tokens and template)."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_trainer.cli import main
from dflash_trainer.drafter.engines import engines_without_support, model_classes
from dflash_trainer.drafter.export import load_drafter
from dflash_trainer.drafter.export_speculators import export_speculators
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import load_target
from dflash_trainer.target.presets import preset_config
from tests.pipeline_helpers import checkpoints, summary, train_in_process
from tests.test_target_capture import alone_hidden_states, capture, make_sequences

VLLM, SGLANG = "vLLM 0.33.0", "SGLang 0.5.23"

FAMILIES = {  # preset: (the model class it is served as, the checked engines without a verifier for it)
    "tiny-qwen3-next": ("Qwen3NextForCausalLM", []),
    "tiny-qwen3.5": ("Qwen3_5ForCausalLM", []),
    "tiny-qwen3.5-moe": ("Qwen3_5MoeForCausalLM", []),
    "tiny-deepseek-v3": ("DeepseekV3ForCausalLM", []),
    "tiny-gemma4": ("Gemma4ForCausalLM", []),
    "tiny-llama4": ("Llama4ForCausalLM", []),
    "tiny-glm4-moe": ("Glm4MoeForCausalLM", [VLLM, SGLANG]),
    "tiny-minimax-m2": ("MiniMaxM2ForCausalLM", [SGLANG]),
    "tiny-nemotron-h": ("NemotronHForCausalLM", []),
    "tiny-qwen3-vl": ("Qwen3VLForConditionalGeneration", [SGLANG]),  # image-text; with images: test_vlm_target.py
    "tiny-qwen3.5-vl": ("Qwen3_5ForConditionalGeneration", []),  # Qwen3.5 as released; with images: test_vlm_families.py
    "tiny-gemma3-vl": ("Gemma3ForConditionalGeneration", [VLLM, SGLANG]),  # image-text; with images: the same
    "tiny-gemma4-vl": ("Gemma4ForConditionalGeneration", []),  # image-text; with images: the same
    "tiny-llama4-vl": ("Llama4ForConditionalGeneration", [SGLANG]),  # image-text; with images: the same
}
TOKENIZERS = {  # preset: its family's tiny tokenizer (the family's special tokens and chat template; test_family_templates.py)
    "tiny-qwen3-next": "qwen3.5", "tiny-qwen3.5": "qwen3.5", "tiny-qwen3.5-moe": "qwen3.5",
    "tiny-deepseek-v3": "deepseek-v3", "tiny-gemma4": "gemma4", "tiny-llama4": "llama4", "tiny-glm4-moe": "glm4-moe",
    "tiny-minimax-m2": "minimax-m2", "tiny-nemotron-h": "nemotron-h", "tiny-qwen3-vl": "qwen3-vl",
    "tiny-qwen3.5-vl": "qwen3.5", "tiny-gemma3-vl": "gemma3", "tiny-gemma4-vl": "gemma4", "tiny-llama4-vl": "llama4",
}
RUNS = [*((preset, TOKENIZERS[preset]) for preset in FAMILIES), ("tiny-deepseek-v3", "kimi-k2")]
"""(preset, tokenizer) of each training run: Kimi-K2 is served as DeepseekV3ForCausalLM, with its own chat format."""
SPECULATORS_REFUSED = {preset: "scales its embeddings by 8" for preset in ("tiny-gemma4", "tiny-gemma3-vl", "tiny-gemma4-vl")}
"""Families whose drafter the speculators format cannot carry as trained (vLLM builds it without the embedding scale)."""


@pytest.mark.parametrize("preset", FAMILIES)
def test_family_taps_equal_hf_hidden_states(preset):
    target = load_target(TargetConfig(random_init=preset, dtype="float32", compile=False), torch.device("cpu"), seed=0)
    hidden = target.config.get_text_config().hidden_size
    taps, sequences = [0, 2, 4], make_sequences((9, 17, 4, 30))  # 30 tokens cross Llama 4's chunks of 8
    _, out = capture(target, sequences, taps)
    start = 0
    for seq in sequences:
        states = alone_hidden_states(target, seq)
        for k, layer in enumerate(taps):
            got = out.taps[start : start + seq.num_tokens, k * hidden : (k + 1) * hidden]
            torch.testing.assert_close(got, states[layer + 1][0], atol=1e-4, rtol=1e-4)
        start += seq.num_tokens


@pytest.mark.parametrize("preset,tokenizer", RUNS, ids=[f"{p}-{t}" for p, t in RUNS])
def test_family_trains_exports_and_evaluates(preset, tokenizer, tmp_path):
    served_as, unserved = FAMILIES[preset]
    config = preset_config(preset)
    assert model_classes(config.to_dict()) == [served_as] and engines_without_support(config) == unserved

    run = tmp_path / "run"
    assert train_in_process(run, f"target.random_init={preset}", f"target.tokenizer=tiny:{tokenizer}",
                            "train.num_epochs=100", "train.max_steps=3", "data.max_conversations=12") == 0
    result = summary(run)
    assert result["status"] == "ok" and result["steps"] == 3
    out = tmp_path / "export"
    assert main(["export", "--checkpoint", str(checkpoints(run)[-1]), "--out", str(out),
                 "--config", str(run / "config.yaml")]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert exported["num_target_layers"] == config.get_text_config().num_hidden_layers and exported["hidden_size"] == 64

    drafter = load_drafter(out)
    if preset in SPECULATORS_REFUSED:  # refused with the fix, never exported to serve wrongly
        with pytest.raises(ConfigError, match=SPECULATORS_REFUSED[preset]):
            export_speculators(drafter, tmp_path / "speculators", verifier="org/tiny-target", target_config=config)
    else:
        export_speculators(drafter, tmp_path / "speculators", verifier="org/tiny-target", target_config=config)
        assert json.loads((tmp_path / "speculators" / "config.json").read_text())["speculators_model_type"] == "dflash"

    assert main(["eval", "--drafter", str(out), "--config", str(run / "config.yaml"), "--out", str(tmp_path / "ev"),
                 "eval.num_prompts=2", "eval.max_new_tokens=12", "target.dtype=float32"]) == 0
    report = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert report["greedy_match_rate"] == 1.0 and report["tau"] >= 1.0


def test_a_target_with_several_residual_streams_is_refused_before_the_first_step(tmp_path):
    """DeepSeek-V4 (hyper-connections: 4 residual streams of hidden_size between layers) has no single hidden state
    to tap, and no engine verifies a drafter for it: refused at set-up, naming the family and why."""
    config = preset_config("tiny")
    deepseek_v4 = type("DeepseekV4Config", (), {**config.to_dict(), "hc_mult": 4})()
    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.drafter.spec import drafter_spec

    with pytest.raises(ConfigError, match="DeepseekV4Config passes 4 residual streams .*not supported as a target"):
        drafter_spec(deepseek_v4, DrafterConfig(num_layers=1, block_size=16, mask_token_id=1024))
    assert drafter_spec(config, DrafterConfig(num_layers=1, block_size=16, mask_token_id=1024)).hidden_size == 64
