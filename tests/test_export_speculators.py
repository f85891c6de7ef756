"""`export --format speculators`: the config fields vLLM and speculators read, the weights, the verifier.

These run without the `speculators` package; tests/test_speculators_compat.py loads the result with it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_trainer.drafter.export import export_drafter
from dflash_trainer.drafter.export_speculators import export_speculators, verifier_reference
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.config import TargetConfig
from tests.drafter_helpers import single_thread, tiny_drafter  # noqa: F401 (single_thread: autouse fixture)


def _verifier_folder(path, target_config):
    """A target folder as loaders see it: its config.json (architectures set, as save_pretrained does)."""
    target_config.architectures = ["Qwen3ForCausalLM"]
    target_config.save_pretrained(path)
    return path


def test_config_fields_and_weights(tmp_path):
    drafter, target = tiny_drafter(sliding_layers=[0, 1], sliding_window=6)
    verifier = _verifier_folder(tmp_path / "verifier", target)
    export_speculators(drafter, tmp_path / "spec", verifier=str(verifier), target_config=target)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert config["draft_vocab_size"] == target.vocab_size  # not the 32000 default: no reduced vocabulary
    assert config["block_size"] == 4 and config["mask_token_id"] == target.vocab_size - 1
    assert config["aux_hidden_state_layer_ids"] == [2, 4]  # taps [1, 3] as HF hidden_states indices
    assert config["sample_from_anchor"] is False
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2
    assert layer["hidden_size"] == target.hidden_size and layer["vocab_size"] == target.vocab_size
    assert layer["layer_types"] == ["sliding_attention"] * 2 and layer["sliding_window"] == 6
    assert config["sliding_window_non_causal"] is False  # vLLM: causal = not it, in every layer: as trained
    assert not {"dflash_config", "block_size", "num_target_layers", "architectures"} & set(layer)
    spec = config["speculators_config"]
    assert spec["algorithm"] == "dflash" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": str(verifier), "architectures": ["Qwen3ForCausalLM"]}
    # the weights are the DFlash format's, tensor for tensor
    export_drafter(drafter, tmp_path / "dflash", target_config=target)
    ours, theirs = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("spec", "dflash"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("layers, non_causal", [((), True), ((0, 1), False)])
def test_vllm_runs_every_layer_with_the_causality_it_was_trained_with(tmp_path, layers, non_causal):
    """vLLM 0.33 (`transformers_utils/configs/speculators/algos.py`) sets `dflash_config.causal = not
    sliding_window_non_causal` for every layer; our full-attention layers are non-causal inside the block and our
    sliding layers causal (scripts/serving-check.sh runs vLLM's own classes on these exports)."""
    drafter, target = tiny_drafter(sliding_layers=layers, sliding_window=6 if layers else None)
    verifier = _verifier_folder(tmp_path / "verifier", target)
    export_speculators(drafter, tmp_path / "spec", verifier=str(verifier), target_config=target)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["sliding_window_non_causal"] is non_causal
    vllm_causal = not config["sliding_window_non_causal"]
    trained_causal = [t == "sliding_attention" for t in drafter.spec.layer_types]
    assert trained_causal == [vllm_causal] * drafter.spec.num_layers


def test_a_drafter_mixing_full_and_sliding_layers_is_refused_in_the_speculators_format(tmp_path):
    drafter, target = tiny_drafter(sliding_layers=[1], sliding_window=6)
    verifier = _verifier_folder(tmp_path / "verifier", target)
    with pytest.raises(ConfigError, match="mix full attention .* Export with --format dflash"):
        export_speculators(drafter, tmp_path / "spec", verifier=str(verifier), target_config=target)
    assert not (tmp_path / "spec").exists()
    export_drafter(drafter, tmp_path / "dflash", target_config=target)  # the DFlash format describes it per layer
    assert json.loads((tmp_path / "dflash" / "config.json").read_text())["layer_types"] == [
        "full_attention", "sliding_attention"]


def test_verifier_reference(tmp_path, monkeypatch, caplog):
    with pytest.raises(ConfigError, match="pass --verifier HUB_ID_OR_FOLDER"):
        verifier_reference(None, TargetConfig(random_init="tiny"))
    assert verifier_reference("Qwen/Qwen3-8B", TargetConfig(random_init="tiny")) == "Qwen/Qwen3-8B"
    assert verifier_reference(None, TargetConfig(path="Qwen/Qwen3-8B")) == "Qwen/Qwen3-8B"
    _, target = tiny_drafter()
    _verifier_folder(tmp_path / "target", target)
    monkeypatch.chdir(tmp_path)
    # vLLM 0.33 `vllm serve EXPORT` takes only a hub id: a local target folder naming none is refused, with the fixes
    with pytest.raises(ConfigError, match=r"local folder whose config.json names no hub id\. Say which: pass "
                                          r"--verifier HUB_ID .*or --verifier .*target to record the folder .*vllm "
                                          r"serve .*target --speculative-config"):
        verifier_reference(None, TargetConfig(path="target"))
    # a local folder given as --verifier is what the user asked for: recorded absolute, with how vLLM serves it
    assert verifier_reference("./target", TargetConfig(path="Qwen/Qwen3-8B")) == str(tmp_path / "target")
    assert "refuses a local verifier; serve " + str(tmp_path / "target") + " with the export as its" in caplog.text
    assert "EXPORT" not in caplog.text and "BLOCK_SIZE" not in caplog.text  # the warning names what it knows
    with pytest.raises(ConfigError, match="--verifier='./nothing' does not exist"):
        verifier_reference("./nothing", TargetConfig(random_init="tiny"))
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    (tmp_path / "target" / "config.json").write_text(json.dumps({**config, "_name_or_path": str(tmp_path)}))
    with pytest.raises(ConfigError, match="names no hub id"):  # a local path there is no hub id
        verifier_reference(None, TargetConfig(path="target"))


@pytest.mark.parametrize("named", ["Qwen/Qwen3-8B", "org/tiny"])
def test_a_local_target_is_never_taken_for_the_model_its_config_names(tmp_path, monkeypatch, named):
    """A fine-tune saved from Qwen/Qwen3-8B keeps `_name_or_path: Qwen/Qwen3-8B` in its config.json: recording that
    name would make `vllm serve EXPORT` serve the base model. The user says which, with --verifier."""
    _, target = tiny_drafter()
    folder = _verifier_folder(tmp_path / "my-finetune", target)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_name_or_path": named}))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        verifier_reference(None, TargetConfig(path="my-finetune"))
    message = str(raised.value)
    assert f"whose config.json names {named} (`_name_or_path`), which transformers also writes into a fine-tune" \
        in message
    assert f"pass --verifier {named} if it is that very model, --verifier HUB_ID" in message
    assert f"--verifier {folder} to record the folder" in message
    assert verifier_reference(named, TargetConfig(path="my-finetune")) == named  # said which: recorded as given
    assert verifier_reference("org/my-finetune", TargetConfig(path="my-finetune")) == "org/my-finetune"


def test_a_hub_cache_snapshot_is_recorded_as_its_repository(tmp_path):
    """`snapshot_download`'s folder is the repository itself (its name is in the cache's path), whatever its
    config.json names."""
    _, target = tiny_drafter()
    snapshot = _verifier_folder(tmp_path / "hub" / "models--org--tiny-chat" / "snapshots" / "0123abcd", target)
    config = json.loads((snapshot / "config.json").read_text())
    (snapshot / "config.json").write_text(json.dumps({**config, "_name_or_path": "org/tiny-base"}))
    assert verifier_reference(None, TargetConfig(path=str(snapshot))) == "org/tiny-chat"
    elsewhere = _verifier_folder(tmp_path / "models--org--x" / "not-snapshots" / "rev", target)
    with pytest.raises(ConfigError, match="names no hub id"):
        verifier_reference(None, TargetConfig(path=str(elsewhere)))


def test_a_verifier_of_another_size_is_refused(tmp_path):
    drafter, target = tiny_drafter()
    target.hidden_size *= 2
    verifier = _verifier_folder(tmp_path / "other", target)
    with pytest.raises(ConfigError, match="has hidden_size 128 .* name the target the drafter was trained for"):
        export_speculators(drafter, tmp_path / "spec", verifier=str(verifier))
    assert not (tmp_path / "spec").exists()


def _verifier_architectures(spec_dir):
    return json.loads((spec_dir / "config.json").read_text())["speculators_config"]["verifier"]["architectures"]


@pytest.mark.parametrize("error", [OSError, ValueError])
def test_verifier_architectures_without_its_config_at_hand(tmp_path, monkeypatch, caplog, error):
    from dflash_trainer.drafter import export_speculators as module

    def unreadable(name, **kwargs):
        raise error(f"{name}: offline, not in the cache")

    drafter, target = tiny_drafter()
    target.architectures = None  # a random-init target's config names none
    # a hub id whose config.json cannot be read: the target's config stands for it, its model type gives the class
    monkeypatch.setattr(module.PretrainedConfig, "get_config_dict", unreadable)
    export_speculators(drafter, tmp_path / "a", verifier="org/unreadable", target_config=target)
    assert _verifier_architectures(tmp_path / "a") == ["Qwen3ForCausalLM"]
    assert "its config.json cannot be read" in caplog.text
    # the target itself is not looked up again
    export_speculators(drafter, tmp_path / "t", verifier="org/target", target_config=target, verifier_is_target=True)
    assert _verifier_architectures(tmp_path / "t") == ["Qwen3ForCausalLM"]
    # a folder whose config.json has a model type but no architectures
    folder = tmp_path / "verifier"
    target.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("architectures", None)
    (folder / "config.json").write_text(json.dumps(config))
    export_speculators(drafter, tmp_path / "b", verifier=str(folder))
    assert _verifier_architectures(tmp_path / "b") == ["Qwen3ForCausalLM"]


def test_a_hub_verifier_config_is_read_raw_and_checked_like_a_folders(tmp_path, monkeypatch):
    from dflash_trainer.drafter import export_speculators as module

    drafter, target = tiny_drafter()
    text = {k: target.to_dict()[k] for k in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers")}
    served = {"model_type": "qwen3_vl", "text_config": text}  # multimodal, no architectures
    configs = {"org/vl": served, "org/other": {**text, "hidden_size": 2 * target.hidden_size}}
    monkeypatch.setattr(module.PretrainedConfig, "get_config_dict", lambda name, **kw: (configs[name], {}))
    export_speculators(drafter, tmp_path / "vl", verifier="org/vl", target_config=target)
    assert _verifier_architectures(tmp_path / "vl") == ["Qwen3VLForConditionalGeneration"]
    with pytest.raises(ConfigError, match="verifier org/other does not fit this drafter: it has hidden_size 128"):
        export_speculators(drafter, tmp_path / "c", verifier="org/other", target_config=target)


def _demo_checkpoint(run_dir):
    """A training checkpoint of the demo recipe's drafter (random weights), as `train` writes it."""
    from dflash_trainer.config import load_config
    from dflash_trainer.data.tokenizer import load_tokenizer
    from dflash_trainer.drafter.model import DFlashDrafter
    from dflash_trainer.drafter.spec import drafter_spec, first_spare_row
    from dflash_trainer.target.load import target_model_config
    from dflash_trainer.train.checkpoint import CheckpointState, save_checkpoint

    config = load_config("demo", [f"run.dir={run_dir}"])
    target = target_model_config(config.target)
    mask = first_spare_row(load_tokenizer(config.target, config.data.chat_template))
    drafter = DFlashDrafter(drafter_spec(target, config.drafter, mask_token_id=mask))
    state = CheckpointState(step=1, epoch=0, ledger={}, model_signature={}, data_fingerprint="", scheduler={}, extra={})
    return save_checkpoint(run_dir, state, drafter.state_dict(), {}, keep_last=1), drafter, target


def test_cli_export_speculators(tmp_path, capsys):
    from dflash_trainer.cli import main

    ckpt, drafter, target = _demo_checkpoint(tmp_path / "run")
    args = ["export", "--config", "demo", f"run.dir={tmp_path / 'run'}", "--checkpoint", str(ckpt)]
    assert main([*args, "--out", str(tmp_path / "a"), "--format", "speculators"]) == 2
    assert "has no target.path" in capsys.readouterr().err and not (tmp_path / "a").exists()  # random-init target
    assert main([*args, "--out", str(tmp_path / "b"), "--verifier", "Qwen/Qwen3-8B"]) == 2
    err = capsys.readouterr().err
    assert "--verifier Qwen/Qwen3-8B does nothing in --format dflash" in err and "add --format speculators" in err
    assert not (tmp_path / "b").exists()
    verifier = _verifier_folder(tmp_path / "verifier", target)
    assert main([*args, "--out", str(tmp_path / "c"), "--format", "speculators", "--verifier", str(verifier)]) == 0
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(verifier)
    assert config["aux_hidden_state_layer_ids"] == [2, 4] and config["block_size"] == 8  # demo: taps [1, 3], B=8
    weights = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert all(torch.equal(weights[k], v) for k, v in drafter.state_dict().items())
    # eval reads the default format only, and says so for a speculators export
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["eval", "--config", "demo", f"eval.prompts={prompts}", "--drafter", str(tmp_path / "c"),
                 "--out", str(tmp_path / "e")]) == 2
    assert f"{tmp_path / 'c'} is a speculators-format export, which this command does not read" in \
        capsys.readouterr().err


def _drafter_export(path, kind):
    """An export of a drafter of the tiny target, in `kind`: ours in the DFlash or speculators format, DFlash2."""
    drafter, target = tiny_drafter(variant="dflash2" if kind == "dflash2" else "dflash")
    if kind == "speculators":
        export_speculators(drafter, path, verifier="org/target", target_config=target, verifier_is_target=True)
    else:
        export_drafter(drafter, path, target_config=target)
    return path


@pytest.mark.parametrize("kind", ["dflash", "speculators", "dflash2"])
def test_a_drafter_export_is_refused_as_the_verifier(tmp_path, kind):
    """A drafter has the target's hidden size and vocabulary, so only its own marks tell it from its target."""
    drafter, target = tiny_drafter()
    export = _drafter_export(tmp_path / "drafter", kind)
    with pytest.raises(ConfigError, match=rf"verifier {export} is a drafter \(.*\), not a target: name the target"):
        export_speculators(drafter, tmp_path / "spec", verifier=str(export), target_config=target)
    assert not (tmp_path / "spec").exists()


@pytest.mark.parametrize("architectures", [["BertModel"], ["Qwen3ForSequenceClassification"]])
def test_a_model_that_generates_no_text_is_refused_as_the_verifier(tmp_path, architectures):
    """An encoder or a classifier of the target's sizes fits every size check: its class says it is no target."""
    drafter, target = tiny_drafter()
    verifier = _verifier_folder(tmp_path / "other", target)
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, "architectures": architectures}))
    with pytest.raises(ConfigError) as raised:
        export_speculators(drafter, tmp_path / "spec", verifier=str(verifier))
    assert f"verifier {verifier} is no model that generates text (architectures {architectures}" in str(raised.value)
    assert "name the target model" in str(raised.value) and not (tmp_path / "spec").exists()


def test_a_target_model_given_where_a_drafter_export_is_read_is_named_as_a_target(tmp_path):
    from dflash_trainer.drafter.export import read_export

    _, target = tiny_drafter()
    folder = _verifier_folder(tmp_path / "target", target)
    (folder / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ConfigError) as raised:
        read_export(folder)
    assert f"{folder} is a target model (Qwen3ForCausalLM), not a drafter export: pass a drafter's folder" in \
        str(raised.value)


@pytest.mark.parametrize("change, named", [
    ({"num_hidden_layers": 3}, "decoder layers 3 (the drafter's: 6, taps [1, 3])"),
    ({"num_hidden_layers": 8}, "decoder layers 8 (the drafter's: 6)"),
    ({"vocab_size": 999}, "vocab_size 999 (the drafter's: 1088)"),
    ({"hidden_size": 32, "vocab_size": 999}, "hidden_size 32 (the drafter's: 64); vocab_size 999"),
])
def test_a_verifier_the_drafter_does_not_fit_is_refused_naming_the_mismatch(tmp_path, change, named):
    drafter, target = tiny_drafter()
    assert (target.num_hidden_layers, target.vocab_size, target.hidden_size) == (6, 1088, 64)
    for key, value in change.items():
        setattr(target, key, value)
    target.layer_types = None
    verifier = _verifier_folder(tmp_path / "other", target)
    with pytest.raises(ConfigError) as raised:
        export_speculators(drafter, tmp_path / "spec", verifier=str(verifier))
    assert f"verifier {verifier} does not fit this drafter: it has {named}" in str(raised.value)
    assert "\n" not in str(raised.value) and not (tmp_path / "spec").exists()


def test_cli_export_with_a_drafter_as_the_verifier(tmp_path, capsys):
    from dflash_trainer.cli import main

    ckpt, _, _ = _demo_checkpoint(tmp_path / "run")
    args = ["export", "--config", "demo", f"run.dir={tmp_path / 'run'}", "--checkpoint", str(ckpt)]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--out", str(tmp_path / "b"), "--format", "speculators", "--verifier",
                 str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "is a drafter (architectures ['DFlashDraftModel']), not a target" in err, err
    assert not (tmp_path / "b").exists()
