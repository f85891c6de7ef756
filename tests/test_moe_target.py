"""MoE targets: the presets' config classes, tap capture and early exit through sparse decoder layers, a
training run on a tiny `Qwen3MoeConfig` target, and the drafter's sizes for a MoE target."""

from __future__ import annotations

import json

import pytest
import torch
from test_target_capture import alone_hidden_states, capture, count_calls, make_sequences
from transformers import GptOssConfig, Qwen3Config, Qwen3MoeConfig

from dflash_trainer.errors import ConfigError
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import find_decoder_layers, load_target
from dflash_trainer.target.presets import preset_config

# gpt-oss has no sdpa path (attention sinks), and flex attention with sinks needs CUDA: eager on the CPU.
MOE_TARGETS = [("tiny-moe", "sdpa"), ("tiny-moe", "eager"), ("tiny-gpt-oss", "eager")]


def moe_target(preset: str, attn_implementation: str):
    return load_target(TargetConfig(random_init=preset, dtype="float32", attn_implementation=attn_implementation),
                       "cpu", seed=1234)


def test_presets_build_their_architectures_config_class():
    assert type(preset_config("tiny")) is Qwen3Config and type(preset_config("qwen3-8b")) is Qwen3Config
    qwen_moe = preset_config("qwen3-30b-a3b")
    assert type(qwen_moe) is Qwen3MoeConfig
    assert (qwen_moe.num_hidden_layers, qwen_moe.hidden_size, qwen_moe.num_experts, qwen_moe.num_experts_per_tok,
            qwen_moe.moe_intermediate_size, qwen_moe.mlp_only_layers) == (48, 2048, 128, 8, 768, [])
    oss = preset_config("gpt-oss-20b")
    assert type(oss) is GptOssConfig
    assert (oss.num_hidden_layers, oss.hidden_size, oss.num_local_experts, oss.num_experts_per_tok,
            oss.vocab_size, oss.sliding_window) == (24, 2880, 32, 4, 201088, 128)
    assert oss.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert type(preset_config("tiny-moe")) is Qwen3MoeConfig and type(preset_config("tiny-gpt-oss")) is GptOssConfig


@pytest.mark.parametrize("preset,attn_implementation", MOE_TARGETS)
def test_moe_taps_equal_hf_hidden_states_of_each_sequence_alone(preset, attn_implementation):
    model = moe_target(preset, attn_implementation)
    assert "Experts" in type(model.model.layers[0].mlp.experts).__name__  # sparse layers are what is tested
    taps = [0, 2, 4]
    sequences = make_sequences((9, 17, 4, 17))
    _, out = capture(model, sequences, taps)
    start = 0
    for seq in sequences:
        hs = alone_hidden_states(model, seq)
        n = seq.num_tokens
        for k, layer in enumerate(taps):
            got = out.taps[start : start + n, k * 64 : (k + 1) * 64]
            torch.testing.assert_close(got, hs[layer + 1][0], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(got, hs[layer][0], atol=1e-3)
        start += n


@pytest.mark.parametrize("preset,attn_implementation", MOE_TARGETS[1:])
def test_moe_early_exit_runs_only_up_to_the_last_tap(preset, attn_implementation):
    model = moe_target(preset, attn_implementation)
    counts, handles = count_calls(model)
    capture(model, make_sequences((6, 3)), [1, 2])
    assert counts == {"layers": 3, "norm": 0, "lm_head": 0}
    assert all(not layer._forward_hooks for layer in find_decoder_layers(model))
    for h in handles:
        h.remove()


def test_attention_backend_the_target_lacks_is_named():
    with pytest.raises(ConfigError, match="target.attn_implementation='sdpa'.*GptOssConfig.*eager"):
        load_target(TargetConfig(random_init="tiny-gpt-oss", dtype="float32"), "cpu")


def test_a_moe_target_trains_end_to_end(tmp_path):
    from pipeline_helpers import summary, train_in_process

    run_dir = tmp_path / "run"
    assert train_in_process(run_dir, "target.random_init=tiny-moe") == 0
    s = summary(run_dir)
    assert s["status"] == "ok" and s["jobs_planned"] == s["jobs_trained"] and s["jobs_duplicated"] == 0, s
    exported = json.loads((run_dir / "export" / "config.json").read_text())
    # a dense drafter of the target's dense MLP width (drafter/spec.py), tapping the MoE target's layers
    assert exported["num_target_layers"] == 6 and exported["intermediate_size"] == 128
    assert "num_experts" not in exported


def test_drafter_of_a_moe_target_is_dense_with_a_stated_mlp_width():
    from types import SimpleNamespace

    from dflash_trainer.drafter.config import DrafterConfig
    from dflash_trainer.drafter.spec import drafter_spec

    drafter = DrafterConfig(num_layers=2, block_size=8, tap_layer_ids=[1, 3], mask_token_id=1024)
    qwen_moe = preset_config("tiny-moe")
    assert drafter_spec(qwen_moe, drafter).intermediate_size == qwen_moe.intermediate_size  # the dense width
    assert drafter_spec(preset_config("tiny-gpt-oss"), drafter).intermediate_size == 32  # gpt-oss: the expert width
    assert drafter_spec(preset_config("qwen3-30b-a3b"), drafter).intermediate_size == 6144
    # no dense width in the config: the active experts' width, 2 x 32
    fields = {k: v for k, v in qwen_moe.to_dict().items() if k != "intermediate_size"}
    assert drafter_spec(SimpleNamespace(**fields), drafter).intermediate_size == 2 * 32
    fields.pop("moe_intermediate_size")
    with pytest.raises(ConfigError, match="set drafter.intermediate_size"):
        drafter_spec(SimpleNamespace(**fields), drafter)
    chosen = DrafterConfig(num_layers=2, block_size=8, tap_layer_ids=[1, 3], mask_token_id=1024, intermediate_size=96)
    assert drafter_spec(SimpleNamespace(**fields), chosen).intermediate_size == 96
