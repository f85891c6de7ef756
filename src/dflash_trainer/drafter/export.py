"""Export and import of drafters in the z-lab DFlash format (`DFlashDraftModel.from_pretrained` reads it).

An export directory holds `config.json` (a Qwen3 config with `architectures: ["DFlashDraftModel"]`,
`num_target_layers`, `block_size`, `dflash_config = {mask_token_id, target_layer_ids}`, one `layer_types`
entry per drafter layer, both `rope_parameters` and `rope_theta`) and `model.safetensors` with exactly the
drafter's parameter names (no embedding, no lm_head). The key set is validated on export and on import.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from dflash_trainer.drafter.domino import DOMINO_KEYS, domino_fields
from dflash_trainer.drafter.dspark import CONFIDENCE_KEYS, MARKOV_KEYS, engine_names
from dflash_trainer.drafter.embedding_scale import (SCALE_KEY, block_embedding_scale, embedding_scale_fields,
                                                    warn_if_vllm_unscaled)
from dflash_trainer.drafter.engines import warn_if_mrope, warn_if_unserved
from dflash_trainer.drafter.finite import check_finite
from dflash_trainer.drafter.fit import drafter_marks, not_generative
from dflash_trainer.drafter.lilicorr import LatticeSpec, lattice_key_names
from dflash_trainer.drafter.model import DFlashDrafter
from dflash_trainer.drafter.spec import DrafterSpec
from dflash_trainer.errors import ConfigError
from dflash_trainer.readback import decode_problem, json_problem
from dflash_trainer.target.checks import choose_tap_layer_ids
from dflash_trainer.target.load import text_config

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

_LAYER_KEYS = (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight",
)


_DFLASH2_LAYER_KEYS = tuple(f"{conv}.{name}" for conv in ("attention_conv", "mlp_conv")
                            for name in ("base_kernel", "kernel_projection.weight"))
_DFLASH2_KEYS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
                 "candidate_selector.hidden_projection.weight")
"""DFlash2's tensors, named as the reference, vLLM and SGLang read them (the codebooks without `.weight`)."""

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel",
                 "lilicorr": "LiLiCorrDraftModel", "domino": "DFlashDraftModel"}
"""`architectures` of each variant's export: the class the reference package, vLLM and SGLang build. A DSpark
export names the class both engines build (ModelOpt's names DFlash's, which neither engine serves as DSpark) and says
`dflash_config.projector_type: dspark` as ModelOpt's does, which is what this file reads."""

DFLASH2_CONFIG_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""DFlash2's `dflash_config` fields (DrafterSpec fields of the same names)."""


def expected_keys(num_layers: int, variant: str = "dflash", spec: Optional[DrafterSpec] = None) -> set[str]:
    """The exact tensor names of an exported drafter with `num_layers` layers (a LiLiCorr drafter's: of `spec`)."""
    if variant == "lilicorr":
        return lilicorr_keys(spec)
    layer_keys = _LAYER_KEYS + (_DFLASH2_LAYER_KEYS if variant == "dflash2" else ())
    keys = {f"layers.{i}.{name}" for i in range(num_layers) for name in layer_keys}
    keys |= set(_DFLASH2_KEYS) if variant == "dflash2" else set()
    keys |= set(MARKOV_KEYS) if variant == "dspark" else set()
    keys |= set(DOMINO_KEYS) if variant == "domino" else set()
    return keys | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def lilicorr_keys(spec: DrafterSpec) -> set[str]:
    """A LiLiCorr drafter's tensor names: DFlash's, DFlash2's convolutions when on, and the lattice head's."""
    layer_keys = _LAYER_KEYS + (_DFLASH2_LAYER_KEYS if spec.block_conv else ())
    keys = {f"layers.{i}.{name}" for i in range(spec.num_layers) for name in layer_keys}
    head = lattice_key_names(spec.lattice, model_hidden=spec.hidden_size, block_size=spec.block_size)
    return keys | head | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def check_keys(keys: set[str], num_layers: int, where: str, variant: str = "dflash",
               spec: Optional[DrafterSpec] = None) -> None:
    expected = expected_keys(num_layers, variant, spec)
    missing, unexpected = sorted(expected - keys), sorted(keys - expected)
    if missing or unexpected:
        raise ConfigError(
            f"{where}: drafter weights do not match the {ARCHITECTURES[variant]} export format "
            f"(missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''})"
        )


def export_config(spec: DrafterSpec, *, dtype: torch.dtype, target_config: Optional[Any] = None) -> dict:
    """The config.json dict for a drafter (a Qwen3 config plus the DFlash fields)."""
    config = spec.qwen3_config().to_dict()
    rope = dict(spec.rope_parameters)
    config.update(
        model_type="qwen3",
        architectures=[ARCHITECTURES[spec.variant]],
        num_hidden_layers=spec.num_layers,
        num_target_layers=spec.num_target_layers,
        block_size=spec.block_size,
        dflash_config={"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.tap_layer_ids),
                       **dflash2_fields(spec), **dspark_fields(spec), **lilicorr_fields(spec)},
        tie_word_embeddings=False,
        layer_types=list(spec.layer_types),
        rope_parameters=rope,
        rope_theta=rope["rope_theta"],
        vocab_size=spec.vocab_size,
        dtype=str(dtype).removeprefix("torch."),
    )
    if spec.variant == "domino":  # as ModelOpt's DominoExporter writes them (domino.py)
        config["emb_dim"] = spec.domino_emb_dim
        config["dflash_config"].update(projector_type="domino", shift_label=True, pure_draft_prefix_len=1,
                                       gru_hidden_dim=spec.domino_gru_hidden, emb_dim=spec.domino_emb_dim)
    if spec.variant == "dspark":  # where the engines read them (dspark.py)
        config.update(markov_rank=spec.markov_rank, markov_head_type="vanilla", sample_from_anchor=True,
                      enable_confidence_head=False)
    if target_config is not None:
        target_config = text_config(target_config)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if getattr(target_config, key, None) is not None:
                config[key] = getattr(target_config, key)
        config["dflash_config"].update(embedding_scale_fields(block_embedding_scale(target_config, dtype)))
    return config


def dspark_fields(spec: DrafterSpec) -> dict[str, Any]:
    """DSpark's `dflash_config` fields of `spec`, as ModelOpt writes them ({} for the other variants)."""
    if spec.variant != "dspark":
        return {}
    return {"projector_type": "dspark", "shift_label": True, "markov_rank": spec.markov_rank,
            "markov_head_type": "vanilla", "use_confidence_head": False}


def lilicorr_fields(spec: DrafterSpec) -> dict[str, Any]:
    """LiLiCorr's `dflash_config` fields ({} for the other variants): the lattice head's geometry, the block size,
    and DFlash2's convolution sizes (0 when off: the engines build none then)."""
    if spec.variant != "lilicorr":
        return {}
    return {**spec.lattice.export_fields(), "block_size": spec.block_size,
            "conv_kernel_size": spec.conv_kernel_size, "conv_group_size": spec.conv_group_size}


def dflash2_fields(spec: DrafterSpec) -> dict[str, int]:
    """DFlash2's config fields of `spec` ({} for DFlash)."""
    return {k: getattr(spec, k) for k in DFLASH2_CONFIG_KEYS} if spec.variant == "dflash2" else {}


def export_drafter(model: DFlashDrafter, out_dir: str | os.PathLike, *, target_config: Optional[Any] = None,
                   dtype: Optional[torch.dtype] = None) -> Path:
    """Write config.json + model.safetensors to out_dir (created); returns the directory. `dtype`: cast the
    weights (e.g. the target's bf16 for serving; training keeps fp32 master weights)."""
    state = export_state(model, target_config=target_config, dtype=dtype)
    config = export_config(model.spec, dtype=state["fc.weight"].dtype, target_config=target_config)
    warn_if_unserved(target_config)
    warn_if_mrope(target_config)
    warn_if_vllm_unscaled(model.spec.variant, config["dflash_config"].get(SCALE_KEY))
    return write_export(out_dir, config, state)


def export_state(model: DFlashDrafter, *, target_config: Optional[Any] = None,
                 dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """The drafter's weights on the host in `dtype` (default: as they are), key set checked. The same
    tensors serve both export formats: neither stores the embedding or the LM head (the target's)."""
    spec = model.spec
    target_hidden = None if target_config is None else text_config(target_config).hidden_size
    if target_hidden is not None and target_hidden != spec.hidden_size:
        raise ConfigError(f"export: drafter hidden size {spec.hidden_size} != target's {target_hidden}")
    state = {k: v.detach().to("cpu", dtype=dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}  # host copy
    check_keys(set(state), spec.num_layers, "export", spec.variant, spec)
    return state


def write_export(out_dir: str | os.PathLike, config: dict, state: dict[str, torch.Tensor]) -> Path:
    """config.json + model.safetensors into out_dir (created); returns the directory."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"cannot export to {str(out)!r}: it is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    _readable_like_its_config(out / WEIGHTS_NAME, out / CONFIG_NAME)
    return out


def _readable_like_its_config(weights: Path, config: Path) -> None:
    """safetensors writes through a private temporary file (mode 0600): give the weights the mode the config got
    from the umask (0644 usually), so a server running as another user can read the export."""
    try:
        os.chmod(weights, config.stat().st_mode & 0o777)
    except OSError as e:  # a file system without modes (some network mounts): the export itself is fine
        log.warning("could not set the mode of %s (%s); it may be readable by its owner only", weights, e)


def spec_from_export(config: dict) -> DrafterSpec:
    """The DrafterSpec described by an export's config.json dict."""
    dflash = config.get("dflash_config") or {}
    if dflash.get("causal"):  # other trainers (ModelOpt) can train blocks that attend causally
        raise ValueError("dflash_config.causal is true: this drafter's blocks attend causally, and dflash-train's "
                         "drafter attends bidirectionally within a block (the DFlash paper's); it cannot run it")
    num_layers = config["num_hidden_layers"]
    num_target_layers = config["num_target_layers"]
    taps = dflash.get("target_layer_ids") or choose_tap_layer_ids(num_target_layers, num_layers)
    mask = dflash.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        raise ConfigError("export config.json has no dflash_config.mask_token_id")
    rope = dict(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    heads = config["num_attention_heads"]
    layer_types = config.get("layer_types") or ["full_attention"] * num_layers
    variant = "dflash2" if "DFlash2DraftModel" in (config.get("architectures") or []) else "dflash"
    fields = {"variant": variant}
    if variant == "dflash2":
        missing = [k for k in DFLASH2_CONFIG_KEYS if k not in dflash]
        if missing:
            raise ConfigError(f"a DFlash2DraftModel config needs dflash_config.{{{', '.join(DFLASH2_CONFIG_KEYS)}}}; "
                              f"it lacks {missing}")
        fields |= {k: int(dflash[k]) for k in DFLASH2_CONFIG_KEYS}
    if "LiLiCorrDraftModel" in (config.get("architectures") or []):
        fields = {"variant": "lilicorr", "lattice": LatticeSpec.from_export(dflash),
                  **{k: int(dflash.get(k) or 0) for k in ("conv_kernel_size", "conv_group_size")}}
    projector = dflash.get("projector_type")
    if projector == "dspark":
        fields = {"variant": "dspark", "markov_rank": dspark_rank(dflash)}
    elif projector == "domino":
        fields = domino_fields(dflash, config)
    elif projector not in (None, "dflash"):  # other trainers' heads
        raise ConfigError(f"dflash_config.projector_type is {projector!r}: dflash-train runs DFlash, DFlash2, "
                          "DSpark (projector_type dspark) and Domino (domino) drafters only")
    return DrafterSpec(
        hidden_size=config["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_parameters=rope,
        max_position_embeddings=config["max_position_embeddings"],
        num_layers=num_layers,
        block_size=int(dflash.get("block_size", config.get("block_size", 16))),
        tap_layer_ids=tuple(taps),
        mask_token_id=int(mask),
        num_target_layers=num_target_layers,
        vocab_size=config["vocab_size"],
        layer_types=tuple(layer_types),
        sliding_window=config.get("sliding_window") if "sliding_attention" in layer_types else None,
        **fields,
    )


def dspark_rank(dflash: dict) -> int:
    """The Markov head's rank of a DSpark export's `dflash_config`, after checking it is a head `dspark.py` runs."""
    if dflash.get("shift_label") is False:
        raise ConfigError("a DSpark export with dflash_config.shift_label false (each slot predicting its own "
                          "position, as DFlash): dflash-train runs DSpark drafters whose anchor slot drafts (true)")
    kind = dflash.get("markov_head_type", "vanilla")
    if kind != "vanilla":
        raise ConfigError(f"a DSpark export with markov_head_type {kind!r}: dflash-train runs the vanilla Markov head "
                          "(a bias from the previous token) only")
    if not isinstance(dflash.get("markov_rank"), int):
        raise ConfigError("a DSpark export (dflash_config.projector_type dspark) needs dflash_config.markov_rank")
    return dflash["markov_rank"]


def read_export(path: str | os.PathLike) -> tuple[DrafterSpec, dict[str, torch.Tensor]]:
    root = Path(path)
    if not (root / CONFIG_NAME).is_file() or not (root / WEIGHTS_NAME).is_file():
        raise ConfigError(f"{root} is not a drafter export: it needs {CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        config = json.loads((root / CONFIG_NAME).read_text())
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
        if (classes := config.get("architectures")) and isinstance(classes, list) and not drafter_marks(config) \
                and not not_generative(classes):
            raise ConfigError(f"{root} is a target model ({', '.join(map(str, classes))}), not a drafter export: pass "
                              "a drafter's folder (written by `dflash-train export`, RUN/export, RUN/best) or a "
                              "training checkpoint (RUN/checkpoints/step_N)")
        if "speculators_model_type" in config:  # `export --format speculators`: for vLLM / speculators only
            raise ConfigError(f"{root} is a speculators-format export, which this command does not read; export "
                              "the checkpoint again in the default format (`dflash-train export --checkpoint ... "
                              "--out DIR`) and pass that")
        spec = spec_from_export(config)
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{root / CONFIG_NAME} is not a drafter export config ({_config_problem(e)}); "
                          "export the drafter again") from None
    try:
        state = load_file(str(root / WEIGHTS_NAME))
    except Exception as e:  # safetensors raises its own error type for a cut or corrupt file
        raise ConfigError(f"{root / WEIGHTS_NAME} is unreadable ({e}): cut short or damaged; export the drafter "
                          "again") from None
    check_finite(state, root / WEIGHTS_NAME, fix="export the drafter again from a checkpoint whose weights are finite")
    if spec.variant == "dspark":
        state = engine_names(state)  # ModelOpt's flat Markov names
    if spec.variant == "dspark" and any(k in state for k in CONFIDENCE_KEYS):
        log.info("%s: the DSpark confidence head is left out (chain verification does not use it)", root)
        state = {k: v for k, v in state.items() if k not in CONFIDENCE_KEYS}
    check_keys(set(state), spec.num_layers, str(root), spec.variant, spec)
    return spec, state


def shape_mismatches(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> list[str]:
    """`key: (state's shape) vs (own shape)` for each weight of `state` whose shape differs from `own`'s."""
    return [f"{k}: {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
            if k in own and v.shape != own[k].shape]


def _config_problem(error: Exception) -> str:
    """What is wrong with an export's config.json, in words: damage (cut, not UTF-8) as such, else the error."""
    if isinstance(error, json.JSONDecodeError):
        return json_problem(error)
    if isinstance(error, UnicodeDecodeError):
        return decode_problem(error)
    if isinstance(error, KeyError):
        return f"no {error.args[0]!r} key"
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


def load_drafter(path: str | os.PathLike, *, attention: str = "auto") -> DFlashDrafter:
    """A drafter rebuilt from an export directory, on CPU in the exported dtype. Weights whose shapes differ from
    what config.json describes (a config edited by hand, or from another export) are named, not a traceback."""
    spec, state = read_export(path)
    model = DFlashDrafter(spec, attention=attention).to(state["fc.weight"].dtype)
    wrong = shape_mismatches(model.state_dict(), state)
    if wrong:
        root = Path(path)
        raise ConfigError(f"{root / WEIGHTS_NAME} does not fit {root / CONFIG_NAME} (the weights' shape vs the "
                          f"config's: {wrong[:4]}): the config was edited or belongs to another export; restore it "
                          "or export the drafter again")
    model.load_state_dict(state, strict=True)
    return model


def init_from_export(model: DFlashDrafter, path: str | os.PathLike) -> None:
    """`drafter.init_from`: copy an export's weights into `model` (`warm_start`)."""
    spec, state = read_export(path)
    warm_start(model, state, variant=spec.variant, tap_layer_ids=spec.tap_layer_ids, where=f"drafter.init_from={path}")


def warm_start(model: DFlashDrafter, state: dict[str, torch.Tensor], *, variant: str, tap_layer_ids, where: str) -> None:
    """Copy a drafter's weights `state` (of `variant`, tapping `tap_layer_ids`) into `model`: the same taps and
    shapes, else an error naming `where`. A DFlash drafter's weights start a DFlash2 `model` too: its convolutions
    and selector keep their initialisation (the identity, and a selector that adds nothing), so it computes what
    the DFlash drafter computed, and a DSpark `model` its backbone (its Markov head keeps its initialisation); a
    LiLiCorr `model` starts from one likewise (its lattice head as initialised), and with its convolutions on from a
    DFlash2 drafter too (its backbone and convolutions; the selector is left out)."""
    if variant == "domino":
        raise ConfigError(f"{where} is a Domino drafter (ModelOpt's), which dflash-train evaluates but does not train "
                          "or start a run from: give a DFlash, DFlash2, DSpark or LiLiCorr drafter")
    if variant == "dspark" and model.spec.variant != "dspark":  # its slots predict one position further on
        raise ConfigError(f"{where} is a DSpark drafter and this one is {model.spec.variant}: its slots predict one "
                          "token further on and its Markov head would be lost; set drafter.variant=dspark")
    if variant == "lilicorr" and model.spec.variant != "lilicorr":
        raise ConfigError(f"{where} is a LiLiCorr drafter and this one is {model.spec.variant}: its lattice head would "
                          "be lost; set drafter.variant=lilicorr")
    if variant == "dflash2" and model.spec.variant == "lilicorr" and not model.spec.block_conv:
        raise ConfigError(f"{where} is a DFlash2 drafter and this LiLiCorr one has no convolutions: set "
                          "drafter.lilicorr_conv=true (with its conv_kernel_size and conv_group_size) to start from it")
    if variant == "dflash2" and model.spec.variant == "lilicorr":  # the backbone and convolutions, not the selector
        check_keys(set(state), model.spec.num_layers, f"{where} (for a {model.spec.num_layers}-layer drafter)", variant)
        state, variant = {k: v for k, v in state.items() if not k.startswith("candidate_selector.")}, "lilicorr"
        state = state | {k: v for k, v in model.state_dict().items() if k.startswith("lilicorr.")}
    if variant == "dflash2" and model.spec.variant != "dflash2":
        raise ConfigError(f"{where} is a DFlash2 drafter and this one is {model.spec.variant}: its convolutions and "
                          "selector would be lost; set drafter.variant=dflash2")
    check_keys(set(state), model.spec.num_layers, f"{where} (for a {model.spec.num_layers}-layer drafter)", variant,
               model.spec)
    if tuple(tap_layer_ids) != model.spec.tap_layer_ids:
        raise ConfigError(
            f"{where} taps layers {list(tap_layer_ids)} but this drafter taps "
            f"{list(model.spec.tap_layer_ids)}; set drafter.tap_layer_ids to match"
        )
    own = model.state_dict()
    wrong = shape_mismatches(own, state)
    if wrong:
        raise ConfigError(f"{where} has shapes that do not fit this drafter: {wrong[:4]}")
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v)
