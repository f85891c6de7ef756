"""Export in the `speculators` format (vllm-project/speculators), the one vLLM loads natively.

The weights are the DFlash format's (drafter/export.py: `layers.N.*`, `fc`, `hidden_norm`, `norm`; no
embedding, no LM head). Only config.json differs; it follows speculators 0.9's `DFlashSpeculatorConfig`:
- `speculators_model_type: dflash`: vLLM and speculators pick the model class by it;
- `transformer_layer_config`: the drafter's Qwen3 config, nested;
- `draft_vocab_size`: the target's vocabulary size. Any other value (speculators' default is 32000) switches
  on a reduced draft vocabulary, which needs token maps we do not train;
- `block_size` and `mask_token_id` at the top level;
- `aux_hidden_state_layer_ids`: tap ids + 1. Speculators counts a tapped layer by its HF `hidden_states`
  index (0 is the embedding), we count decoder layers;
- `speculators_config.verifier.name_or_path`: the target. Loaders take the embedding and LM head from it;
  without it they stay NaN. `vllm serve EXPORT` (vLLM 0.33) takes it as the model to serve and accepts only a
  hub repository id; speculators' own loader also reads a local folder;
- `sliding_window_non_causal`: vLLM turns it into one causality for every layer (`dflash_config.causal = not
  it`, its `algos.py`), speculators reads it for sliding layers only. Our full-attention layers are
  non-causal inside the block and our sliding layers causal, so `true` serves an all-full drafter as trained
  and `false` an all-sliding one; no value serves a drafter that mixes them (`causality_field` refuses it).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import PretrainedConfig

from dflash_trainer.drafter.embedding_scale import block_embedding_scale, refuse_speculators_scale
from dflash_trainer.drafter.engines import model_classes, warn_if_mrope, warn_if_unserved
from dflash_trainer.drafter.export import ARCHITECTURES, dflash2_fields, export_config, export_state, write_export
from dflash_trainer.drafter.fit import GENERATIVE_SUFFIXES, drafter_marks, not_generative, target_mismatches
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import DrafterSpec
from dflash_trainer.errors import ConfigError
from dflash_trainer.hub import hub_unreachable
from dflash_trainer.target.config import TargetConfig, model_reference

log = logging.getLogger(__name__)

FORMAT_VERSION = "0.9.0"
"""The speculators release whose format this writes (its `speculators_version` field)."""

# export_config's DFlash fields: the speculators format keeps them at its top level, not in the layer config
_DFLASH_ONLY_KEYS = ("architectures", "block_size", "dflash_config", "num_target_layers")


SERVE_LOCAL = ("vllm serve {target} --speculative-config "
               "'{{\"method\": \"dflash\", \"model\": \"EXPORT\", \"num_speculative_tokens\": BLOCK_SIZE-1}}'")
"""The vLLM command that serves a drafter with a target from a local folder (no verifier read from the export)."""


def verifier_reference(verifier: Optional[str], target: TargetConfig) -> str:
    """The verifier to record: `--verifier` if given, else the target's hub id (`target.path`, or the repository a
    local target folder is a hub-cache snapshot of). `vllm serve EXPORT` serves the recorded model, so a local
    `target.path` is never taken to be the model its config.json's `_name_or_path` names (a fine-tune saved with
    its base model's name would be served as the base): without `--verifier` it is refused, naming that model and the
    fixes. A local folder given as `--verifier` is recorded as an absolute path (speculators' loader reads it), with a
    warning saying how vLLM serves it."""
    if verifier:
        reference = model_reference(verifier, "--verifier", "config.json")
        local = Path(reference).expanduser()
        if not local.is_dir():
            return reference  # a hub id
        return local_verifier(local, f"--verifier {verifier}")
    if not target.path:
        raise ConfigError(
            "export --format speculators records the target (the verifier), from which vLLM and speculators load "
            "the drafter's embedding and LM head, and this config has no target.path (a random-init target has "
            "no weights to load): pass --verifier HUB_ID_OR_FOLDER, the model you will serve the drafter with"
        )
    reference = model_reference(target.path, "target.path", "config.json")
    local = Path(reference).expanduser()
    if not local.is_dir():
        return reference  # a hub id
    snapshot_of = _hub_cache_repository(local)
    if snapshot_of:
        log.info("recording the verifier as %s, the hub repository whose downloaded copy %s is", snapshot_of, local)
        return snapshot_of
    folder = local.resolve()
    named = _hub_id_named_in(local)
    said = (f"whose config.json names {named} (`_name_or_path`), which transformers also writes into a fine-tune "
            f"saved from {named}, so it need not be this model" if named else "whose config.json names no hub id")
    if_same = f"--verifier {named} if it is that very model, " if named else ""
    raise ConfigError(
        f"export --format speculators records the verifier, the model `vllm serve EXPORT` serves the drafter with, and "
        f"vLLM (0.33) takes only a hub repository id there; target.path={target.path} is a local folder {said}. Say "
        f"which: pass {if_same}--verifier HUB_ID (this target's own hub id), or --verifier {folder} to record the "
        f"folder (speculators' loader reads it; vLLM then serves it as `{SERVE_LOCAL.format(target=folder)}`)"
    )


def local_verifier(folder: Path, given: str) -> str:
    """A local verifier folder (`given` names where it came from), recorded as an absolute path, with a warning
    saying how vLLM serves it."""
    folder = Path(folder).expanduser().resolve()
    log.warning("%s is a local folder: speculators' loader reads it, but `vllm serve` of the export (vLLM 0.33) refuses "
                "a local verifier; serve %s with the export as its --speculative-config model (the command is printed "
                "when the export is written), or export again with --verifier HUB_ID", given, folder)
    return str(folder)


def _hub_cache_repository(folder: Path) -> Optional[str]:
    """The hub model id of a folder that is a snapshot in the Hugging Face cache (`models--ORG--NAME/snapshots/REV`,
    as `snapshot_download` leaves it): that copy is the repository itself, whatever its config names."""
    folder = folder.resolve()
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    name = repo.removeprefix("models--").replace("--", "/")
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _hub_id_named_in(folder: Path) -> Optional[str]:
    """The hub id a model folder's config.json names (`_name_or_path`, written by older transformers: the model it
    was loaded from, so a fine-tune's names its base), if it is a valid repository id and no local path."""
    try:
        name = json.loads((folder / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str) or Path(name).expanduser().exists():
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def causality_field(spec: DrafterSpec) -> bool:
    """`sliding_window_non_causal` for `spec`: the one value with which vLLM and speculators run every layer with
    the causality it was trained with (full attention non-causal in the block, sliding windows causal)."""
    sliding = [t == "sliding_attention" for t in spec.layer_types]
    if any(sliding) and not all(sliding):
        raise ConfigError(
            f"export --format speculators cannot describe this drafter: its layers mix full attention (non-causal "
            f"inside the block) and sliding windows (causal), {list(spec.layer_types)}, and the format has one "
            f"causality for every layer in vLLM (`sliding_window_non_causal`), so vLLM would serve some layers "
            f"unlike their training. Export with --format dflash, which vLLM and SGLang read per layer "
            f"(`vllm serve TARGET --speculative-config '{{\"method\": \"dflash\", \"model\": \"EXPORT\", ...}}'`)"
        )
    return not all(sliding)


def verifier_architectures(verifier: str, spec: DrafterSpec, target_config: Optional[Any], *,
                           is_target: bool = False) -> list[str]:
    """The verifier's `architectures`, from its config.json (a folder's; a hub id's from the cache or the hub;
    the target's when `is_target`), which must be a target (not a drafter) that the drafter fits (hidden size,
    vocabulary, depth: `drafter/fit.py`, as `eval` checks its target). A hub id whose config
    cannot be read stands for the target (a warning says so). A config without `architectures` gets the model
    class that transformers maps its model type to."""
    config = _verifier_config(verifier, target_config, is_target=is_target)
    if marks := drafter_marks(config):
        raise ConfigError(f"verifier {verifier} is a drafter ({marks}), not a target: name the target model the "
                          "drafter was trained for (its hub id or folder), which engines serve and draft for")
    try:
        text = config.get("text_config") or config  # multimodal configs nest the language model's fields
        layers = text.get("num_hidden_layers")
        wrong = target_mismatches(spec, hidden_size=int(text["hidden_size"]), vocab_size=int(text["vocab_size"]),
                                  num_layers=None if layers is None else int(layers))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"verifier {verifier}: cannot read hidden_size and vocab_size from its config.json "
                          f"({type(e).__name__}: {e})") from None
    if wrong:
        raise ConfigError(f"verifier {verifier} does not fit this drafter: it has {'; '.join(wrong)}; name the "
                          "target the drafter was trained for")
    architectures = model_classes(config)
    if encoder := not_generative(architectures):
        raise ConfigError(f"verifier {verifier} is no model that generates text ({encoder}; engines serve a "
                          f"class ending in {' or '.join(GENERATIVE_SUFFIXES)}): name the target model the drafter was "
                          "trained for (its hub id or folder)")
    if not architectures:
        log.warning("verifier %s: its config names no architectures, and transformers maps its model type %r to no "
                    "model class: the export records none", verifier, config.get("model_type"))
    return architectures


def _verifier_config(verifier: str, target_config: Optional[Any], *, is_target: bool) -> dict:
    """The verifier's config.json as a dict (raw: no model code runs): the target's when the verifier is the
    target (a folder `--save-target` is still writing, too); else a folder's; else a hub id's from the cache or the
    hub, or the target's where it cannot be read."""
    if is_target and target_config is not None:
        return target_config.to_dict()
    path = Path(verifier)
    if path.is_dir():
        try:
            return json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"verifier {verifier}: cannot read its config.json ({type(e).__name__}: {e})") from None
    try:
        try:
            return PretrainedConfig.get_config_dict(verifier, local_files_only=True)[0]
        except OSError:  # not in the cache
            from huggingface_hub import constants

            if not constants.HF_HUB_OFFLINE and (why := hub_unreachable(constants.ENDPOINT)):
                raise OSError(f"the hub ({constants.ENDPOINT}) cannot be reached from here: {why}") from None
            return PretrainedConfig.get_config_dict(verifier)[0]
    except (OSError, ValueError) as e:
        fix = "pass a folder holding the verifier's config.json as --verifier"
        why = f"{type(e).__name__}: {str(e).splitlines()[0]}" if str(e) else type(e).__name__
        if target_config is None:
            raise ConfigError(f"verifier {verifier}: cannot read its config.json ({why}); {fix}") from None
        log.warning("verifier %s: its config.json cannot be read (%s); the target's config stands for it (%s to "
                    "record the verifier's own)", verifier, why, fix)
        return target_config.to_dict()


def speculators_config(spec: DrafterSpec, *, dtype: torch.dtype, verifier: str, architectures: list[str],
                       target_config: Optional[Any] = None) -> dict:
    """The config.json dict of a speculators-format DFlash drafter."""
    layer_config = export_config(spec, dtype=dtype, target_config=target_config)
    for key in _DFLASH_ONLY_KEYS:
        layer_config.pop(key)
    return {
        "architectures": [ARCHITECTURES[spec.variant]],
        "speculators_model_type": spec.variant,  # dflash | dflash2: speculators' and vLLM's names
        **dflash2_fields(spec),  # DFlash2's sizes at the top level, where both read them
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": spec.vocab_size,
        "block_size": spec.block_size,
        "mask_token_id": spec.mask_token_id,
        "aux_hidden_state_layer_ids": [t + 1 for t in spec.tap_layer_ids],
        # the block's first slot holds the last committed token, as in our training (B - 1 drafted tokens)
        "sample_from_anchor": False,
        # vLLM applies `causal = not this` to every layer: true for full attention, false for sliding windows
        "sliding_window_non_causal": causality_field(spec),
        "tie_word_embeddings": False,
        "dtype": layer_config["dtype"],
        "speculators_config": {
            "algorithm": spec.variant,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
    }


def export_speculators(model: DFlashDrafter, out_dir: str | os.PathLike, *, verifier: str,
                       target_config: Optional[Any] = None, dtype: Optional[torch.dtype] = None,
                       verifier_is_target: bool = False) -> Path:
    """Write config.json + model.safetensors in the speculators format to out_dir (created); returns it.
    `verifier`: the target's hub id or folder (verifier_reference); `verifier_is_target`: it is `target.path`,
    whose config `target_config` is."""
    if model.spec.variant == "dspark":  # vLLM's speculators path for it defaults to DFlash's slots (sample_from_anchor)
        raise ConfigError("a DSpark drafter exports in the dflash format only (vLLM and SGLang serve it as "
                          "Qwen3DSparkModel with method dspark): drop --format speculators")
    if model.spec.variant == "lilicorr":
        raise ConfigError("the speculators format has no LiLiCorr drafter (speculators 0.9 knows dflash and dflash2): "
                          "export it in the default format (`dflash-train export` without --format), which vLLM "
                          "and SGLang serve as LiLiCorrDraftModel")
    causality_field(model.spec)  # a drafter no value describes is refused before anything is read or written
    if target_config is not None:
        refuse_speculators_scale(block_embedding_scale(target_config, dtype or next(model.parameters()).dtype))
    architectures = verifier_architectures(verifier, model.spec, target_config, is_target=verifier_is_target)
    warn_if_unserved({"architectures": architectures})
    warn_if_mrope(target_config)
    state = export_state(model, target_config=target_config, dtype=dtype)
    config = speculators_config(model.spec, dtype=state["fc.weight"].dtype, verifier=verifier,
                                architectures=architectures, target_config=target_config)
    return write_export(out_dir, config, state)
