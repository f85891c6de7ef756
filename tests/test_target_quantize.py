"""FP8 targets: `target.quantize` validation, the `from_pretrained` arguments chosen for plain and
FP8 checkpoints, an FP8 checkpoint loaded dequantized, and random targets built one layer at a time.
The FP8 matmuls themselves need a GPU with FP8 tensor cores (bench/target/target_forward.py --quantize fp8)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from dflash_trainer.config import load_config
from dflash_trainer.errors import ConfigError
from dflash_trainer.target import quantize
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.target.load import find_decoder_layers, load_target, target_model_config
from dflash_trainer.target.quantize import materialize_layerwise, pretrained_quantization
from tests.test_target_capture import LENGTHS, capture, make_sequences

BLOCK = 16  # FP8 weight block: divides the tiny preset's 64 / 128 dims
CUDA = torch.device("cuda")  # only named: nothing here runs on it


def save_fp8_checkpoint(model, folder, keep=("lm_head",)) -> None:
    """`model` saved as FP8 checkpoints ship (e4m3 weights of the decoder layers' linear layers, one
    `weight_scale_inv` per BLOCK x BLOCK block, quantization_config quant_method fp8)."""
    model.save_pretrained(folder)
    tensors = {}
    for name, w in model.state_dict().items():
        if ".layers." in name and name.endswith("_proj.weight"):
            n, k = w.shape
            blocks = w.float().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
            scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
            fp8 = (blocks / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = fp8, scale
        else:
            tensors[name] = w.contiguous()
    (folder / "model.safetensors").unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = dict(quant_method="fp8", activation_scheme="dynamic",
                                         weight_block_size=[BLOCK, BLOCK], modules_to_not_convert=list(keep))
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture()
def checkpoints(tmp_path, tiny_target):
    plain, fp8 = tmp_path / "plain", tmp_path / "fp8"
    tiny_target.save_pretrained(plain)
    save_fp8_checkpoint(tiny_target, fp8)
    return plain, fp8


def fake_packages(monkeypatch, **available: bool) -> None:
    from transformers.utils import import_utils

    for name, ok in available.items():
        monkeypatch.setattr(import_utils, f"is_{name}_available", lambda ok=ok: ok)


# ------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("fields, message", [
    (dict(quantize="int8"), "target.quantize must be null or 'fp8'"),
    (dict(quantize="FP8"), "target.quantize must be null or 'fp8'"),
    (dict(quantize="fp8", dtype="float32"), "set target.dtype=bfloat16"),
    (dict(quantize="fp8", dtype="float16"), "set target.dtype=bfloat16"),
])
def test_bad_quantize_values_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        TargetConfig(random_init="tiny", **fields)


def test_fp8_with_run_device_cpu_is_refused_at_config_time():
    with pytest.raises(ConfigError, match=r"target\.quantize=fp8 needs a CUDA GPU .* set target\.quantize=null"):
        load_config("demo", ["run.device=cpu", "target.dtype=bfloat16", "target.quantize=fp8"])
    assert load_config("demo", ["run.device=auto", "target.dtype=bfloat16", "target.quantize=fp8"]).target.quantize == "fp8"


@pytest.mark.parametrize("source", ["random", "path"])
def test_fp8_on_the_cpu_is_refused_at_load(source, checkpoints):
    where = dict(random_init="tiny") if source == "random" else dict(path=str(checkpoints[0]))
    with pytest.raises(ConfigError, match=r"target\.quantize=fp8 needs a CUDA GPU .* the target is on cpu"):
        load_target(TargetConfig(quantize="fp8", **where), "cpu")


# ---------------------------------------------------------------------------- from_pretrained arguments


def plan(path, device, quantize_=None):
    cfg = TargetConfig(path=str(path), quantize=quantize_)
    return pretrained_quantization(cfg, target_model_config(cfg), device)


def test_plain_checkpoint_without_quantize_gets_no_extra_arguments(checkpoints):
    got = plan(checkpoints[0], torch.device("cpu"))
    assert got.kwargs == {} and not got.requantize


def test_plain_checkpoint_with_fp8_quantizes_the_decoder_layers_with_torchao_while_loading(checkpoints, monkeypatch):
    pytest.importorskip("torchao")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow
    from transformers import TorchAoConfig

    monkeypatch.setattr(quantize, "require_fp8_device", lambda device: None)
    got = plan(checkpoints[0], CUDA, "fp8")
    config = got.kwargs["quantization_config"]
    assert isinstance(config, TorchAoConfig) and not got.requantize
    assert isinstance(config.quant_type, Float8DynamicActivationFloat8WeightConfig)
    assert all(isinstance(g, PerRow) for g in config.quant_type.granularity)
    assert config.quant_type.set_inductor_config is False  # no process-wide autotuning and TF32 (quantize.py)
    assert config.modules_to_not_convert == ["lm_head"]  # the drafter reads the LM head's weight
    assert got.kwargs["device_map"] == {"": CUDA}  # quantized on the GPU as each weight is read


def test_fp8_without_torchao_names_the_package(checkpoints, monkeypatch):
    monkeypatch.setattr(quantize, "require_fp8_device", lambda device: None)
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao...` raise ImportError
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(ConfigError, match=r"target\.quantize=fp8 needs the torchao package"):
        plan(checkpoints[0], CUDA, "fp8")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp8_checkpoint_with_fp8_is_loaded_dequantized_then_quantized_again(checkpoints, monkeypatch, device):
    fake_packages(monkeypatch, accelerate=True)
    monkeypatch.setattr(quantize, "require_fp8_device", lambda device: None)
    got = plan(checkpoints[1], torch.device(device), "fp8")
    config = got.kwargs["quantization_config"]
    assert isinstance(config, FineGrainedFP8Config) and config.dequantize and got.requantize
    assert config.modules_to_not_convert == ["lm_head"]  # the checkpoint's own list goes along


def test_fp8_checkpoint_on_the_cpu_is_loaded_dequantized(checkpoints, monkeypatch):
    fake_packages(monkeypatch, accelerate=True)
    got = plan(checkpoints[1], torch.device("cpu"))
    assert got.kwargs["quantization_config"].dequantize and not got.requantize
    assert got.kwargs["device_map"] == {"": torch.device("cpu")}


def test_fp8_checkpoint_on_a_gpu_runs_as_it_ships_when_transformers_has_its_kernels(checkpoints, monkeypatch):
    fake_packages(monkeypatch, accelerate=True, kernels=True)
    got = plan(checkpoints[1], CUDA)
    assert got.kwargs == {"device_map": {"": CUDA}} and not got.requantize  # the config.json's quantization


def test_fp8_checkpoint_on_a_gpu_without_kernels_names_the_package_and_the_way_out(checkpoints, monkeypatch):
    fake_packages(monkeypatch, accelerate=True, kernels=False)
    with pytest.raises(ConfigError, match=r"ships FP8 weights .* needs the kernels package .* target\.quantize=fp8"):
        plan(checkpoints[1], CUDA)


def test_fp8_checkpoint_without_accelerate_names_the_package(checkpoints, monkeypatch):
    fake_packages(monkeypatch, accelerate=False)
    with pytest.raises(ConfigError, match=r"ships FP8 weights .* needs the accelerate package"):
        load_target(TargetConfig(path=str(checkpoints[1]), dtype="float32"), "cpu")


def test_other_quantized_checkpoints_are_not_requantized(checkpoints, monkeypatch):
    monkeypatch.setattr(quantize, "require_fp8_device", lambda device: None)
    config = json.loads((checkpoints[0] / "config.json").read_text())
    config["quantization_config"] = dict(quant_method="gptq", bits=4)
    (checkpoints[0] / "config.json").write_text(json.dumps(config))
    assert plan(checkpoints[0], torch.device("cpu")).kwargs == {}  # as it ships, transformers' business
    with pytest.raises(ConfigError, match=r"ships weights quantized by 'gptq', .* set target\.quantize=null"):
        plan(checkpoints[0], CUDA, "fp8")


# --------------------------------------------------------------------------------------- real loading


def test_fp8_checkpoint_loads_dequantized_on_the_cpu_and_its_taps_are_those_of_its_weights(checkpoints, tiny_target):
    pytest.importorskip("accelerate")  # transformers loads FP8 checkpoints only with it
    model = load_target(TargetConfig(path=str(checkpoints[1]), dtype="float32"), "cpu")
    weight = find_decoder_layers(model)[0].mlp.up_proj.weight
    assert weight.dtype == torch.float32 and type(weight) is torch.nn.Parameter
    shipped = load_file(str(checkpoints[1] / "model.safetensors"))
    with torch.no_grad():  # the reference: each FP8 weight times the scale of its block, by hand
        for name, w in tiny_target.named_parameters():
            if name in shipped and shipped[name].dtype == torch.float8_e4m3fn:
                scale = shipped[name.removesuffix("weight") + "weight_scale_inv"]
                w.copy_(shipped[name].float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1))
    sequences, taps = make_sequences(LENGTHS), [1, 3]
    _, want = capture(tiny_target, sequences, taps)
    _, got = capture(model, sequences, taps)
    torch.testing.assert_close(got.taps, want.taps, atol=1e-5, rtol=1e-5)


def test_layerwise_build_has_one_real_layer_more_at_each_step_and_the_model_init(tiny_target_config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_target_config, dtype=torch.float32)
    layers = find_decoder_layers(model)
    real = []

    def per_layer(layer):
        real.append(sum(not l.mlp.up_proj.weight.is_meta for l in layers))
        assert model.lm_head.weight.device.type == "cpu"  # everything outside the layers comes first
        with torch.no_grad():
            layer.mlp.down_proj.weight.zero_()  # per_layer's changes are kept

    torch.manual_seed(0)
    materialize_layerwise(model, layers, torch.device("cpu"), per_layer)
    model.requires_grad_(False)
    assert real == list(range(1, len(layers) + 1))
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    reference = AutoModelForCausalLM.from_config(tiny_target_config, dtype=torch.float32)
    for name, buffer in reference.named_buffers():  # rotary frequencies, recomputed from the config
        torch.testing.assert_close(model.get_buffer(name), buffer)
    assert float(layers[2].input_layernorm.weight.min()) == 1.0
    std = float(layers[2].self_attn.q_proj.weight.std())
    assert abs(std - tiny_target_config.initializer_range) < 0.005, std
    assert float(layers[2].mlp.down_proj.weight.abs().max()) == 0.0
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(12)[None]).logits).all()


def test_target_tensors_of_an_fp8_checkpoint_are_never_its_unscaled_fp8_values(checkpoints, monkeypatch):
    from dflash_trainer.target.head import read_target_tensors

    name = "model.layers.2.mlp.up_proj.weight"
    fake_packages(monkeypatch, accelerate=False)  # the dequantizing load is refused: an error, not a wrong value
    with pytest.raises(ConfigError, match="needs the accelerate package"):
        read_target_tensors(TargetConfig(path=str(checkpoints[1]), dtype="float32"), [name])
    plain = read_target_tensors(TargetConfig(path=str(checkpoints[0]), dtype="float32", quantize=None), [name])
    assert plain[name].dtype == torch.float32  # plain checkpoints are still read tensor by tensor


def test_target_tensors_of_an_fp8_checkpoint_are_dequantized(checkpoints):
    pytest.importorskip("accelerate")
    from dflash_trainer.target.head import read_target_tensors

    name = "model.layers.2.mlp.up_proj.weight"
    got = read_target_tensors(TargetConfig(path=str(checkpoints[1]), dtype="float32"), [name])[name]
    shipped = load_file(str(checkpoints[1] / "model.safetensors"))
    scale = shipped[name.removesuffix("weight") + "weight_scale_inv"]
    want = shipped[name].float() * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    torch.testing.assert_close(got, want)


def test_expert_banks_left_in_bf16_by_fp8_are_reported_and_dense_layers_are_not(caplog):
    """torchao's float8 quantizes nn.Linear layers only: a MoE target's experts (3-D weight banks) and routers stay
    in bf16, which a user of target.quantize=fp8 must be told (most of such a target's weights)."""
    from dflash_trainer.target.presets import preset_config
    from dflash_trainer.target.quantize import warn_weights_left_unquantized

    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(preset_config("qwen3-30b-a3b"), dtype=torch.bfloat16)
        dense = AutoModelForCausalLM.from_config(preset_config("qwen3-8b"), dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger="dflash_trainer.target.quantize"):
        left = warn_weights_left_unquantized(find_decoder_layers(moe), "bfloat16")
        assert warn_weights_left_unquantized(find_decoder_layers(dense), "bfloat16") == 0
    # 48 layers x 128 experts x (gate, up, down) x H x width, plus each layer's (128, H) router; 2 bytes each
    assert left == pytest.approx(48 * 128 * (3 * 2048 * 768 + 2048) * 2 / 2**30)
    [record] = [r for r in caplog.records if r.name == "dflash_trainer.target.quantize"]  # none for the dense one
    # of 55.7 GiB in all: + 48 x (q, o: 2048 x 4096; k, v: 2048 x 512) x 2 bytes of attention = 1.7 GiB
    assert "target.quantize=fp8: 54.0 GiB of the decoder layers' 55.7 GiB" in record.getMessage()
    assert "144 weight tensors" in record.getMessage()


def test_fp8_moe_target_quantizes_attention_and_reports_its_experts(monkeypatch, caplog):
    pytest.importorskip("torchao")
    import torchao.float8.inference as torchao_inference

    from dflash_trainer.target import load as target_load
    from dflash_trainer.target.quantize import warn_weights_left_unquantized

    monkeypatch.setattr(torchao_inference.torch.xpu, "is_available", lambda: True)  # FP8 layers on the CPU
    monkeypatch.setattr(target_load, "require_fp8_device", lambda device: None)
    with caplog.at_level("WARNING", logger="dflash_trainer.target.quantize"):
        model = load_target(TargetConfig(random_init="tiny-moe", quantize="fp8"), "cpu", seed=0)
    layers = find_decoder_layers(model)
    assert type(layers[0].self_attn.q_proj.weight).__name__ == "Float8Tensor"
    assert layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    [record] = [r for r in caplog.records if r.name == "dflash_trainer.target.quantize"]
    experts = sum(p.numel() * 2 for n, p in layers.named_parameters() if ".experts." in n or ".gate." in n)
    assert warn_weights_left_unquantized(layers, "bfloat16") == pytest.approx(experts / 2**30)
    # FP8 weights count one byte each (plus a float32 scale a row), not the bf16 their tensors report
    q_proj = layers[0].self_attn.q_proj.weight
    assert quantize._nbytes(q_proj) == q_proj.numel() + 4 * q_proj.shape[0]
    assert f"{len(layers) * 3} weight tensors" in record.getMessage()


def test_llama3_70b_preset_has_the_70b_shape():
    from dflash_trainer.target.presets import preset_config

    config = preset_config("llama3-70b")
    assert config.model_type == "llama"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layers = find_decoder_layers(model)
    linear = sum(p.numel() for n, p in layers.named_parameters() if n.endswith("proj.weight"))
    assert len(layers) == 80 and 68.4e9 < linear < 68.5e9  # what FP8 holds: 1 byte each (+ one scale a row)
    assert 70.5e9 < sum(p.numel() for p in model.parameters()) < 70.6e9


# ------------------------------------------------------------------------- on a GPU with FP8 tensor cores

needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs a GPU with FP8 tensor cores")


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_taps_are_close_to_the_bf16_taps_of_the_same_weights(compiled):
    pytest.importorskip("torchao")
    from dflash_trainer.target.capture import TapCapture, compile_decoder_layers, prepare_inputs
    from dflash_trainer.target.quantize import quantize_layer_fp8
    from dflash_trainer.transport.wire import WireSpec, allocate

    def taps_of(model):
        sequences = make_sequences(LENGTHS)
        spec = WireSpec(token_budget=64, max_seqs=6, num_taps=2, hidden=64, dtype=torch.bfloat16,
                        has_last_hidden=False)
        out = allocate(spec, "cuda")
        TapCapture(model, [1, 3]).run(prepare_inputs(sequences, out), out)
        return out.taps.float()

    model = load_target(TargetConfig(random_init="tiny"), "cuda")
    want = taps_of(model)
    for layer in find_decoder_layers(model):
        quantize_layer_fp8(layer)
    if compiled:
        compile_decoder_layers(model)
    got = taps_of(model)
    assert type(find_decoder_layers(model)[0].mlp.up_proj.weight).__name__ == "Float8Tensor"
    error = float((got - want).norm() / want.norm())
    assert 0 < error < 0.1, error  # e4m3 rounding of weights and activations


@pytest.mark.gpu
@needs_fp8_gpu
def test_random_fp8_target_is_made_in_fp8_on_the_gpu_with_bf16_embeddings_and_head():
    pytest.importorskip("torchao")
    model = load_target(TargetConfig(random_init="tiny", quantize="fp8"), "cuda")
    layer = find_decoder_layers(model)[2]
    assert type(layer.self_attn.q_proj.weight).__name__ == "Float8Tensor"
    assert model.lm_head.weight.dtype == torch.bfloat16 and type(model.lm_head.weight) is torch.nn.Parameter
    assert layer.input_layernorm.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(12, device="cuda")[None]).logits).all()


def test_a_left_padded_batch_on_an_fp8_target_stays_finite(monkeypatch):
    """The attention output of a query with every key masked (a left-padded prompt's padding) is a zero row; its
    FP8 scale must not be 0 (NaN), which masked attention would spread to the real tokens of its row.
    Runs where torchao is installed: on a GPU with FP8 tensor cores, else with torch's scaled matmul on the CPU."""
    pytest.importorskip("torchao")
    import torchao.float8.inference as torchao_inference

    from dflash_trainer.target import load as target_load

    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        device = CUDA
    else:  # torchao builds FP8 layers only where it sees FP8 hardware (or an XPU); torch's matmul runs on the CPU
        device = torch.device("cpu")
        monkeypatch.setattr(torchao_inference.torch.xpu, "is_available", lambda: True)
        monkeypatch.setattr(target_load, "require_fp8_device", lambda device: None)
    model = load_target(TargetConfig(random_init="tiny", quantize="fp8"), device, seed=0)
    assert type(find_decoder_layers(model)[0].self_attn.o_proj.weight).__name__ == "Float8Tensor"
    ids = torch.randint(10, 200, (2, 12), device=device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second prompt is 7 tokens, left-padded
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.isfinite(logits[mask.bool()]).all()
