"""The target's head as the drafter uses it: block embeddings equal to what the target's own input-embedding module
returns (Gemma scales its table by sqrt(H) there), the final norm of the target's own class (Gemma's scales by
1 + weight), and the LM head unscaled; read tensor by tensor from a checkpoint or taken from the loaded model alike."""

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3TextConfig, Qwen3Config

from dflash_trainer.data.types import TokenizedSequence
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.drafter.spec import drafter_spec
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.capture import TapCapture, prepare_inputs
from dflash_trainer.target.checks import check_target
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target import head as head_module
from dflash_trainer.target.head import (decoder_layout, embedding_scale, head_from_model, load_target_head,
                                        read_target_tensors)
from dflash_trainer.target.load import find_decoder, load_target
from dflash_trainer.transport.wire import WireSpec, allocate

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def image_text_config() -> Gemma3Config:
    return Gemma3Config(text_config=dict(**SHAPE, sliding_window=32),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14))


def saved_target(tmp_path, config) -> tuple[nn.Module, TargetConfig]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        find_decoder(model).norm.weight.normal_()  # Gemma's norm starts at 0 (1 + w = 1): give it weights that tell
    model.save_pretrained(tmp_path)
    return model, TargetConfig(path=str(tmp_path), dtype="float32")


@pytest.mark.parametrize("config", [Gemma3TextConfig(**SHAPE, sliding_window=32, tie_word_embeddings=True),
                                    Qwen3Config(**SHAPE, tie_word_embeddings=False)], ids=["gemma3", "qwen3"])
def test_block_embeddings_and_final_norm_are_the_targets_own(tmp_path, config):
    model, cfg = saved_target(tmp_path, config)
    ids = torch.arange(config.vocab_size)
    x = torch.randn(5, config.hidden_size)
    with torch.no_grad():
        want_embeds, want_norm = model.get_input_embeddings()(ids), find_decoder(model).norm(x)
    for head in (head_from_model(model), load_target_head(cfg, torch.device("cpu"))):  # loaded, then read
        torch.testing.assert_close(nn.functional.embedding(ids, head.embed_weight), want_embeds, rtol=0, atol=0)
        torch.testing.assert_close(head.lm_head_weight, model.lm_head.weight, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(head.final_norm(x), want_norm)
    gemma = config.model_type == "gemma3_text"
    assert embedding_scale(model.get_input_embeddings()) == pytest.approx(64 ** 0.5 if gemma else 1.0)
    # the scale is the target's, not a property of the file: Gemma's embeddings differ from its table
    assert gemma == (not torch.equal(want_embeds, model.get_input_embeddings().weight))


class _Shifted(nn.Embedding):
    """An embedding whose output is not its table times a scalar."""

    def forward(self, ids):
        return super().forward(ids) + 1.0


class _Doubled(nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


def test_an_unknown_embedding_class_is_measured_or_refused():
    model = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE))
    table = model.model.embed_tokens.weight.detach().clone()
    model.model.embed_tokens = _Doubled(SHAPE["vocab_size"], SHAPE["hidden_size"])
    model.model.embed_tokens.weight.data.copy_(table)
    assert embedding_scale(model.model.embed_tokens) is None  # not a known class: measured on its weights
    torch.testing.assert_close(head_from_model(model).embed_weight, table * 2.0)
    model.model.embed_tokens = _Shifted(SHAPE["vocab_size"], SHAPE["hidden_size"])
    with pytest.raises(ConfigError, match="not its table times a scalar"):
        head_from_model(model)


def test_a_drafter_of_a_target_with_rope_per_layer_type_takes_the_full_attention_set():
    """Gemma 3 keeps one RoPE set per layer type (sliding 10K, full 1M): the drafter, whose layers attend to the
    whole context, takes the full-attention one, and a nested set without it is refused."""
    config = Gemma3TextConfig(**SHAPE, sliding_window=32)
    assert config.rope_parameters["sliding_attention"]["rope_theta"] != config.rope_parameters["full_attention"]["rope_theta"]
    spec = drafter_spec(config, DrafterConfig(num_layers=1, mask_token_id=5))
    assert spec.rope_parameters == dict(config.rope_parameters["full_attention"])
    flat = drafter_spec(Qwen3Config(**SHAPE, rope_theta=5e5), DrafterConfig(num_layers=1, mask_token_id=5))
    assert flat.rope_parameters["rope_theta"] == 5e5
    config.rope_parameters = {"sliding_attention": config.rope_parameters["sliding_attention"]}
    with pytest.raises(ConfigError, match="full_attention"):
        drafter_spec(config, DrafterConfig(num_layers=1, mask_token_id=5))


def test_an_image_text_to_text_target_trains_on_its_language_model(tmp_path):
    """Gemma 3 4B+ ships as Gemma3ForConditionalGeneration, its language model in `model.model.language_model`: the
    taps are that model's hidden states on text, the drafter takes its text config, and the head is the language
    model's (block embeddings scaled as its module scales them)."""
    config = image_text_config()
    model, cfg = saved_target(tmp_path, config)
    assert find_decoder(model) is model.model.language_model
    assert decoder_layout(cfg).prefix == "model.language_model"
    spec = drafter_spec(config, DrafterConfig(num_layers=1, mask_token_id=5))
    assert (spec.hidden_size, spec.vocab_size, spec.num_target_layers) == (64, 96, 2)

    target = load_target(cfg, "cpu")
    ids = torch.randint(0, 90, (11,), generator=torch.Generator().manual_seed(0))
    out = allocate(WireSpec(token_budget=16, max_seqs=2, num_taps=1, hidden=64, dtype=torch.float32,
                            has_last_hidden=False), "cpu")
    inputs = prepare_inputs([TokenizedSequence(input_ids=ids, loss_mask=torch.ones(11, dtype=torch.bool))], out)
    TapCapture(target, [0]).run(inputs, out)
    with torch.no_grad():
        want = target(ids[None], output_hidden_states=True).hidden_states[1][0]  # (11, H): layer 0's output
    torch.testing.assert_close(out.taps[:11], want, atol=1e-5, rtol=1e-5)
    # the start checks read the language model's config too: its hidden size, and its positions (256)
    assert check_target(target, tap_layer_ids=[0], drafter_hidden_size=64, max_length=256).hidden_size == 64
    with pytest.raises(ConfigError, match="max_position_embeddings 256"):
        check_target(target, tap_layer_ids=[0], max_length=257)

    for head in (head_from_model(target), load_target_head(cfg, torch.device("cpu"))):
        with torch.no_grad():
            torch.testing.assert_close(nn.functional.embedding(ids, head.embed_weight),
                                       target.get_input_embeddings()(ids), rtol=0, atol=0)
        torch.testing.assert_close(head.lm_head_weight, target.lm_head.weight, rtol=0, atol=0)


def test_an_image_text_to_text_checkpoint_is_read_tensor_by_tensor(tmp_path, monkeypatch):
    """Such a checkpoint names its language model `language_model.model.*` on disk (the layout transformers renames
    to `model.language_model.*` when it loads): a drafter rank still reads the head and the init's layer tensors one
    by one, without loading the whole target."""
    model, cfg = saved_target(tmp_path, image_text_config())
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "language_model.model.norm.weight" in set(f.keys())  # the older layout, not the modules' names
    monkeypatch.setattr(head_module, "load_target", lambda *a, **k: pytest.fail("the whole target was loaded"))

    head = load_target_head(cfg, torch.device("cpu"))
    ids, x = torch.arange(SHAPE["vocab_size"]), torch.randn(5, SHAPE["hidden_size"])
    with torch.no_grad():
        torch.testing.assert_close(nn.functional.embedding(ids, head.embed_weight), model.get_input_embeddings()(ids),
                                   rtol=0, atol=0)
        torch.testing.assert_close(head.final_norm(x), find_decoder(model).norm(x))
    torch.testing.assert_close(head.lm_head_weight, model.lm_head.weight, rtol=0, atol=0)
    name = "model.language_model.layers.1.mlp.up_proj.weight"
    torch.testing.assert_close(read_target_tensors(cfg, [name])[name], model.state_dict()[name], rtol=0, atol=0)
