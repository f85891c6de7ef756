"""Export/import: exact round trip, key validation, init_from, and parity with the reference `dflash` package."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trainer.drafter.export import export_drafter, init_from_export, load_drafter
from dflash_trainer.errors import ConfigError
from tests.drafter_helpers import packed_batch, single_thread, tiny_drafter  # noqa: F401 (fixture)

HAVE_DFLASH = importlib.util.find_spec("dflash") is not None


def test_round_trip_exact(tmp_path):
    drafter, target = tiny_drafter(sliding_layers=[1], sliding_window=6)
    export_drafter(drafter, tmp_path, target_config=target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == target.num_hidden_layers
    assert config["block_size"] == 4 and config["tie_word_embeddings"] is False
    assert config["dflash_config"] == {"mask_token_id": target.vocab_size - 1, "target_layer_ids": [1, 3]}
    assert config["layer_types"] == ["full_attention", "sliding_attention"]
    assert config["sliding_window"] == 6 and config["use_sliding_window"] is True
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["vocab_size"] == target.vocab_size
    loaded = load_drafter(tmp_path)
    assert loaded.spec == drafter.spec
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    modes = [(tmp_path / name).stat().st_mode & 0o777 for name in ("model.safetensors", "config.json")]
    assert modes[0] == modes[1] and modes[0] & 0o044, [oct(m) for m in modes]  # readable by a server's user too


def test_bf16_round_trip(tmp_path):
    drafter, _ = tiny_drafter()
    drafter = drafter.to(torch.bfloat16)
    export_drafter(drafter, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_drafter(tmp_path)
    assert loaded.fc.weight.dtype == torch.bfloat16 and torch.equal(loaded.fc.weight, drafter.fc.weight)


def test_export_key_validation(tmp_path):
    drafter, _ = tiny_drafter()
    drafter.extra = torch.nn.Linear(2, 2, bias=False)  # an unexpected key
    with pytest.raises(ConfigError, match=r"unexpected \['extra.weight'\]"):
        export_drafter(drafter, tmp_path / "a")
    del drafter.extra
    export_drafter(drafter, tmp_path / "b")
    state = load_file(str(tmp_path / "b" / "model.safetensors"))
    del state["hidden_norm.weight"]
    save_file(state, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \['hidden_norm.weight'\]"):
        load_drafter(tmp_path / "b")


def test_init_from_copies_weights_and_checks_shapes(tmp_path):
    source, _ = tiny_drafter(seed=1)
    export_drafter(source, tmp_path / "src")
    fresh, _ = tiny_drafter(seed=2)
    assert not torch.equal(fresh.fc.weight, source.fc.weight)
    init_from_export(fresh, tmp_path / "src")
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), source.state_dict().values()))
    deeper, _ = tiny_drafter(num_layers=3)
    with pytest.raises(ConfigError, match="missing"):  # 2-layer weights for a 3-layer drafter
        init_from_export(deeper, tmp_path / "src")
    other_taps, _ = tiny_drafter(tap_layer_ids=[2, 4])
    with pytest.raises(ConfigError, match="tap_layer_ids"):
        init_from_export(other_taps, tmp_path / "src")
    with pytest.raises(ConfigError, match="not a drafter export"):
        init_from_export(fresh, tmp_path / "nothing")


@pytest.mark.skipif(not HAVE_DFLASH, reason="the reference `dflash` package is not installed")
@pytest.mark.parametrize("sliding", [False, True])
def test_reference_package_parity(tmp_path, sliding):
    from dflash.model import DFlashDraftModel

    drafter, target = tiny_drafter(sliding_layers=[0] if sliding else [], sliding_window=5 if sliding else None)
    export_drafter(drafter, tmp_path, target_config=target)
    ref, info = DFlashDraftModel.from_pretrained(str(tmp_path), output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert ref.target_layer_ids == list(drafter.spec.tap_layer_ids) and ref.mask_token_id == drafter.spec.mask_token_id
    ref.eval()
    batch = packed_batch(drafter, num_blocks=10)
    plan = batch.plan
    with torch.no_grad():
        train_out = drafter.forward_train(taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan,
                                          embed_weight=batch.embed_weight)
        checked = 0
        for j in torch.nonzero(plan.block_valid).flatten().tolist():
            anchor, pos = int(plan.anchors[j]), int(plan.anchor_pos[j])
            if pos == 0:
                continue  # the reference needs at least one context token
            embeds = batch.embed_weight[plan.block_ids[j]]
            expected = ref(
                position_ids=torch.arange(pos + 4)[None],
                noise_embedding=embeds[None],
                target_hidden=batch.taps[anchor - pos:anchor][None],
            )[0]
            block = drafter.forward_block(block_embeds=embeds, block_positions=plan.positions[j],
                                          context_taps=batch.taps[anchor - pos:anchor],
                                          context_positions=torch.arange(pos))
            torch.testing.assert_close(block.hidden, expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(train_out[j], expected, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked >= 5


def test_an_export_written_by_modelopt_loads_and_a_causal_one_is_refused(tmp_path):
    """ModelOpt 0.47's DFlash exporter writes the same weight names with its own config.json: the top-level
    rope_theta only, `torch_dtype`, and `dflash_config.causal`. Evaluating a peer's drafter reads it as is."""
    drafter, target = tiny_drafter()
    export_drafter(drafter, tmp_path / "ours", target_config=target)
    spec = drafter.spec
    peer = {  # the keys ModelOpt's DFlashExporter writes (bench/RESULTS.md, peer bake-off)
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": spec.block_size,
        "dflash_config": {"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.tap_layer_ids),
                          "causal": False},
        "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim, "intermediate_size": spec.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps, "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings, "rope_theta": spec.rope_parameters["rope_theta"],
        "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float32",
        "num_target_layers": spec.num_target_layers, "layer_types": ["full_attention"] * spec.num_layers,
    }
    folder = tmp_path / "modelopt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(peer))
    (folder / "model.safetensors").write_bytes((tmp_path / "ours" / "model.safetensors").read_bytes())
    loaded = load_drafter(folder)
    assert loaded.spec == drafter.spec
    peer["dflash_config"]["causal"] = True
    (folder / "config.json").write_text(json.dumps(peer))
    with pytest.raises(ConfigError, match="causal is true"):
        load_drafter(folder)
