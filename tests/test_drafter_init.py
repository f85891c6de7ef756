"""`drafter.init_from: target`: drafter layers start as copies of the target's, the context path as the
last tap's pass-through."""

import pytest
import torch

from dflash_trainer.drafter.init import init_from_target, source_layers, target_tensor_names
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.head import read_target_tensors
from dflash_trainer.target.load import load_target
from tests.drafter_helpers import single_thread, tiny_drafter  # noqa: F401 (single_thread: autouse fixture)


def test_source_layers_spread_from_first_to_last():
    assert source_layers(5, 6) == [0, 1, 3, 4, 5]
    assert source_layers(3, 36) == [0, 18, 35]
    assert source_layers(1, 6) == [5]
    assert source_layers(6, 6) == list(range(6))


@pytest.mark.parametrize("num_layers", [1, 2, 3])
def test_init_from_target_copies_layers_norms_and_passes_the_last_tap(num_layers):
    cfg = TargetConfig(random_init="tiny", tokenizer="tiny", dtype="float32")
    target = load_target(cfg, "cpu", seed=3)
    drafter, _ = tiny_drafter(num_layers=num_layers, tap_layer_ids=[0, 2])  # the tiny target has 6 layers
    names = target_tensor_names(drafter)
    init_from_target(drafter, read_target_tensors(cfg, sorted(set(names.values())), seed=3))
    state = target.state_dict()
    for j, t in enumerate(source_layers(num_layers, 6)):
        for name, p in drafter.layers[j].named_parameters():
            torch.testing.assert_close(p, state[f"model.layers.{t}.{name}"], rtol=0, atol=0)
    torch.testing.assert_close(drafter.norm.weight, state["model.norm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(drafter.hidden_norm.weight, state["model.layers.3.input_layernorm.weight"], rtol=0, atol=0)
    h = drafter.spec.hidden_size
    taps = torch.randn(5, 2 * h)
    torch.testing.assert_close(drafter.fc(taps), taps[:, h:])  # the last tap (layer 2), unchanged


def test_a_target_whose_layers_are_not_qwen3_style_is_refused(tmp_path):
    """Gemma 3's layers have two more norms (and scale by 1 + weight): copying the Qwen3-style part would start the
    drafter from something the target never computes, so the initialisation is refused with the fix."""
    from transformers import Gemma3TextConfig

    from dflash_trainer.drafter.init import check_target_layers
    from dflash_trainer.errors import ConfigError
    from dflash_trainer.target.head import decoder_layout

    drafter, _ = tiny_drafter(num_layers=2, tap_layer_ids=[0, 2])  # the tiny target's shape: 6 layers
    layout = decoder_layout(TargetConfig(random_init="tiny", dtype="float32"))
    assert layout.prefix == "model"
    check_target_layers(drafter, layout.layer_parameter_names)
    Gemma3TextConfig(vocab_size=drafter.spec.vocab_size, hidden_size=drafter.spec.hidden_size, num_hidden_layers=6,
                     intermediate_size=drafter.spec.intermediate_size, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, sliding_window=32).save_pretrained(tmp_path)
    gemma = decoder_layout(TargetConfig(random_init=str(tmp_path), dtype="float32"))
    with pytest.raises(ConfigError, match="pre_feedforward_layernorm.*init_from=null"):
        check_target_layers(drafter, gemma.layer_parameter_names)


def test_the_log_says_where_the_drafter_weights_start(tmp_path, caplog):
    """`drafter.init_from` is named in the log, random weights too: a warm start is never silent."""
    import logging

    from dflash_trainer.config import load_config
    from dflash_trainer.train.checkpoint import CheckpointState, save_checkpoint
    from dflash_trainer.train.trainer import build_drafter, model_signature

    base, _ = tiny_drafter(seed=4)
    caplog.set_level(logging.INFO, logger="dflash_trainer.train.trainer")
    build_drafter(load_config("demo", ["run.seed=7"]), base.spec, torch.device("cpu"))
    assert "drafter weights start from random weights (run.seed=7) (drafter.init_from=None" in caplog.text
    state = CheckpointState(step=3, epoch=0, ledger={}, model_signature=model_signature(base.spec),
                            data_fingerprint="", scheduler={}, extra={})
    ckpt = save_checkpoint(tmp_path / "run", state, base.state_dict(), {}, keep_last=1)
    caplog.clear()
    build_drafter(load_config("demo", [f"drafter.init_from={ckpt}"]), base.spec, torch.device("cpu"))
    assert f"drafter weights start from the training checkpoint {ckpt} (drafter.init_from={ckpt};" in caplog.text


@pytest.mark.parametrize("given", ["missing", "typo", "file"])
def test_an_init_from_that_is_no_folder_is_named_with_what_to_give(tmp_path, given):
    """A missing folder, a typo of one next to it, a file: named as drafter.init_from, with the kinds it takes (not
    'not a drafter export', which blames a folder that is not there)."""
    from dflash_trainer.config import load_config
    from dflash_trainer.errors import ConfigError
    from dflash_trainer.train.trainer import build_drafter

    base, _ = tiny_drafter(seed=4)
    (tmp_path / "export").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    source = {"missing": tmp_path / "nowhere" / "export", "typo": tmp_path / "exprot",
              "file": tmp_path / "weights.bin"}[given]
    with pytest.raises(ConfigError) as error:
        build_drafter(load_config("demo", [f"drafter.init_from={source}"]), base.spec, torch.device("cpu"))
    message = str(error.value)
    assert message.startswith(f"drafter.init_from {source}") and "give a drafter export (RUN/export" in message
    if given == "typo":
        assert f"did you mean {tmp_path / 'export'}" in message
