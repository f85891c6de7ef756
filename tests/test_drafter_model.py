"""Drafter forwards against the slow reference, training forward == inference forward, spec checks."""

from __future__ import annotations

import pytest
import torch

from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.checks import choose_tap_layer_ids
from dflash_trainer.target.presets import preset_config
from tests.drafter_helpers import packed_batch, single_thread, tiny_drafter  # noqa: F401 (fixture)
from tests.drafter_reference import reference_train

EXPORT_NAMES = {
    "fc.weight", "hidden_norm.weight", "norm.weight",
    *(f"layers.{i}.{n}" for i in range(2) for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "input_layernorm.weight", "post_attention_layernorm.weight")),
}


def test_parameter_names_are_the_export_names():
    drafter, _ = tiny_drafter()
    assert set(drafter.state_dict()) == EXPORT_NAMES
    assert {n for n, _ in drafter.named_parameters()} == EXPORT_NAMES


@pytest.mark.parametrize(
    "seqlens,sliding",
    [((33,), False), ((15, 18), False), ((9, 12, 11), False), ((15, 18), True)],
    ids=["unpacked", "packed", "packed3", "packed-sliding"],
)
def test_forward_train_matches_reference(seqlens, sliding):
    drafter, _ = tiny_drafter(sliding_layers=[0] if sliding else [], sliding_window=4 if sliding else None)
    batch = packed_batch(drafter, seqlens=seqlens, num_blocks=14)
    out = drafter.forward_train(
        taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=batch.plan, embed_weight=batch.embed_weight
    )
    ref = reference_train(
        drafter, taps=batch.taps, cu_seqlens=batch.cu_seqlens, input_ids=batch.input_ids, plan=batch.plan,
        embed_weight=batch.embed_weight,
    )
    assert out.shape == (14, 4, drafter.spec.hidden_size)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_forward_train_grads_are_finite_with_invalid_blocks():
    drafter, _ = tiny_drafter()
    batch = packed_batch(drafter, num_blocks=30)
    assert not batch.plan.block_valid.all()
    out = drafter.forward_train(
        taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=batch.plan, embed_weight=batch.embed_weight
    )
    out[batch.plan.block_valid].sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())


@pytest.mark.parametrize("sliding", [False, True])
def test_training_forward_equals_block_forward(sliding):
    drafter, _ = tiny_drafter(sliding_layers=[1] if sliding else [], sliding_window=5 if sliding else None)
    batch = packed_batch(drafter, num_blocks=10)
    plan = batch.plan
    with torch.no_grad():
        out = drafter.forward_train(
            taps=batch.taps, cu_seqlens=batch.cu_seqlens, plan=plan, embed_weight=batch.embed_weight
        )
        for j in torch.nonzero(plan.block_valid).flatten().tolist():
            anchor, pos = int(plan.anchors[j]), int(plan.anchor_pos[j])
            start = anchor - pos
            block = drafter.forward_block(
                block_embeds=batch.embed_weight[plan.block_ids[j]],
                block_positions=plan.positions[j],
                context_taps=batch.taps[start:anchor] if pos > 0 else None,
                context_positions=torch.arange(pos),
            )
            torch.testing.assert_close(block.hidden, out[j], atol=1e-5, rtol=1e-5)
            assert block.cache.length == pos


def test_block_forward_cache_is_incremental():
    drafter, _ = tiny_drafter()
    spec = drafter.spec
    taps = torch.randn(11, spec.num_taps * spec.hidden_size)
    block = torch.randn(spec.block_size, spec.hidden_size)
    positions = torch.arange(11, 11 + spec.block_size)
    with torch.no_grad():
        whole = drafter.forward_block(block_embeds=block, block_positions=positions,
                                      context_taps=taps, context_positions=torch.arange(11))
        first = drafter.forward_block(block_embeds=block, block_positions=torch.arange(7, 7 + spec.block_size),
                                      context_taps=taps[:7], context_positions=torch.arange(7))
        second = drafter.forward_block(block_embeds=block, block_positions=positions, context_taps=taps[7:],
                                       context_positions=torch.arange(7, 11), cache=first.cache)
    torch.testing.assert_close(second.hidden, whole.hidden, atol=1e-6, rtol=1e-6)
    assert second.cache.positions.tolist() == [list(range(11))]


def test_rotary_stays_fp32_in_bf16_model():
    drafter, _ = tiny_drafter()
    drafter = drafter.to(torch.bfloat16)
    assert drafter.rotary.inv_freq.dtype == torch.float32
    assert drafter.fc.weight.dtype == torch.bfloat16


def test_mask_token_must_be_an_embedding_row():
    target = preset_config("tiny")
    with pytest.raises(ConfigError, match="not a row of the target's embedding"):
        drafter_spec(target, DrafterConfig(mask_token_id=target.vocab_size))
    with pytest.raises(ConfigError, match="mask_token_id"):
        drafter_spec(target, DrafterConfig())
    assert drafter_spec(target, DrafterConfig(mask_token_id=target.vocab_size - 1)).mask_token_id == target.vocab_size - 1


def test_tap_on_last_layer_refused_and_default_taps():
    target = preset_config("tiny")  # 6 layers: last is 5
    with pytest.raises(ConfigError, match="cannot be tapped"):
        drafter_spec(target, DrafterConfig(mask_token_id=1, tap_layer_ids=[1, 5]))
    assert choose_tap_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    # a drafter deeper than a shallow target has tappable layers taps them all (the last is never tapped)
    assert drafter_spec(target, DrafterConfig(num_layers=8), mask_token_id=0).tap_layer_ids == (0, 1, 2, 3, 4)
    assert drafter_spec(target, DrafterConfig(num_layers=2), mask_token_id=0).tap_layer_ids == (1, 3)
    taps = choose_tap_layer_ids(6, 5)
    assert len(set(taps)) == len(taps) and max(taps) <= 4


class TestFlexBackendCheck:
    """`check_flex_backend` refuses FlashAttention-4's backend where it cannot compile, naming the fix, before
    a run's first step; elsewhere (the CPU, other backends) it lets the run go on."""

    FLASH = {"BACKEND": "FLASH"}

    def test_the_cpu_and_other_backends_pass(self):
        from dflash_trainer.drafter.model import check_flex_backend

        check_flex_backend(self.FLASH, torch.device("cpu"))  # flex on the CPU ignores the backend
        check_flex_backend({"BACKEND": "TRITON"}, torch.device("cuda"))
        check_flex_backend({}, torch.device("cuda"))

    def test_a_gpu_older_than_hopper_is_refused(self, monkeypatch):
        from dflash_trainer.drafter import model

        monkeypatch.setattr(model.torch.cuda, "get_device_capability", lambda device: (8, 0))
        with pytest.raises(ConfigError, match=r"compute capability 9\.0\+\), and this one is 8\.0.*BACKEND=TRITON"):
            model.check_flex_backend(self.FLASH, torch.device("cuda"))

    @pytest.mark.parametrize("absent", ["flash_attn.cute", "cutlass"])
    def test_a_missing_package_is_named_with_its_install_command(self, monkeypatch, absent):
        from dflash_trainer.drafter import model

        monkeypatch.setattr(model.torch.cuda, "get_device_capability", lambda device: (9, 0))
        monkeypatch.setattr(model, "_importable", lambda name: name != absent)
        with pytest.raises(ConfigError, match=rf"{absent} cannot be imported: pip install --pre \"flash-attn-4"):
            model.check_flex_backend(self.FLASH, torch.device("cuda"))
        monkeypatch.setattr(model, "_importable", lambda name: True)
        model.check_flex_backend(self.FLASH, torch.device("cuda"))

    def test_a_missing_parent_package_counts_as_missing(self):
        from dflash_trainer.drafter.model import _importable

        assert not _importable("no_such_package_here.cute")
        assert _importable("torch.nn")


def test_a_run_checks_the_flex_backend_before_it_claims_its_run_dir(monkeypatch, tmp_path):
    """`setup_run` refuses an unusable BACKEND=FLASH first: no run dir is made, nothing is loaded."""
    from dflash_trainer.config import load_config
    from dflash_trainer.runtime.env import DistEnv
    from dflash_trainer.runtime.setup import setup_run

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    config = load_config("demo", [f"run.dir={tmp_path / 'run'}", "drafter.flex_kernel_options.BACKEND=FLASH"])
    with pytest.raises(ConfigError, match="BACKEND=FLASH"):
        setup_run(config, DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1), torch.device("cuda"),
                  control=None)
    assert not (tmp_path / "run").exists()
