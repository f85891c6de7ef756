"""`DrafterSpec`: the frozen architecture of a drafter, derived from the target's HF config + DrafterConfig."""

from __future__ import annotations

from types import SimpleNamespace

from dataclasses import dataclass
from typing import Any, Optional

from transformers import Qwen3Config

from dflash_trainer.drafter.config import DrafterConfig, check_tap_order
from dflash_trainer.drafter.lilicorr import LatticeSpec
from dflash_trainer.errors import ConfigError
from dflash_trainer.target.checks import check_one_residual_stream, choose_tap_layer_ids
from dflash_trainer.target.load import text_config


MROPE_KEYS = frozenset({"mrope_section", "mrope_interleaved"})
"""An image-text target's M-RoPE fields (Qwen3-VL's text config): how its own layers rotate image positions. The
drafter rotates by the sequence position alone, which is what both engines hand it (vLLM's V2 runner, SGLang)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DrafterSpec:
    """Everything needed to build a drafter (and its export config). Hidden size = the target's."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    """HF rope parameters, including `rope_theta` and `rope_type`; never an image-text target's M-RoPE fields
    (`MROPE_KEYS`, left out on construction)."""
    max_position_embeddings: int
    num_layers: int
    block_size: int
    tap_layer_ids: tuple[int, ...]
    """Target layers tapped: output of decoder layer l (HF hidden_states[l + 1])."""
    mask_token_id: int
    num_target_layers: int
    vocab_size: int
    """Rows of the target's embedding matrix (the mask token must be one of them)."""
    layer_types: tuple[str, ...]
    """One of full_attention | sliding_attention per drafter layer."""
    sliding_window: Optional[int] = None
    variant: str = "dflash"
    """dflash | dflash2 (`dflash2.py`) | dspark (`dspark.py`) | lilicorr (`lilicorr.py`) | domino (`domino.py`: read
    from other trainers' exports, not trained); the four fields below are DFlash2's (0 otherwise; LiLiCorr's
    convolutions use the first two)."""
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    markov_rank: int = 0
    """DSpark's Markov head rank (0 otherwise)."""
    domino_gru_hidden: int = 0
    """Domino's GRU width (`gru_hidden_dim`; 0 otherwise)."""
    domino_emb_dim: int = 0
    """Domino's correction projection width (`emb_dim`; 0 otherwise)."""
    lattice: Optional[LatticeSpec] = None
    """LiLiCorr's lattice head (`lilicorr.py`; None otherwise); its convolutions, when on, are DFlash2's
    (conv_kernel_size, conv_group_size; 0 when off)."""

    def __post_init__(self) -> None:
        # the drafter's RoPE is 1-D at sequence positions (HF's Qwen3 rotary ignores M-RoPE fields): declared in its
        # export, they would make vLLM build an M-RoPE drafter, which its V1 runner refuses
        object.__setattr__(self, "rope_parameters",
                           {k: v for k, v in self.rope_parameters.items() if k not in MROPE_KEYS})
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"drafter.mask_token_id={self.mask_token_id} is not a row of the target's embedding "
                f"(vocab_size={self.vocab_size}); pick a spare row below {self.vocab_size}"
            )
        check_tap_order(self.tap_layer_ids, "drafter.tap_layer_ids")
        bad = [t for t in self.tap_layer_ids if not 0 <= t < self.num_target_layers - 1]
        if bad:
            raise ConfigError(
                f"drafter.tap_layer_ids {bad} out of range: taps must be in [0, {self.num_target_layers - 2}] "
                "(the last layer's HF hidden state is taken after the final norm, so it cannot be tapped)"
            )
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types needs {self.num_layers} entries, got {len(self.layer_types)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ConfigError("sliding_attention layers need sliding_window > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.variant == "dflash2":
            sizes = (self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k)
            if min(sizes) < 1:
                raise ConfigError(f"a DFlash2 drafter needs conv_kernel_size, conv_group_size, selector_rank and "
                                  f"selector_top_k >= 1, got {sizes}")
            if self.hidden_size % self.conv_group_size:
                raise ConfigError(f"drafter.conv_group_size={self.conv_group_size} must divide the hidden size "
                                  f"{self.hidden_size} (DFlash2's convolution shares a kernel per group of channels)")
            if self.selector_top_k > self.vocab_size:
                raise ConfigError(f"drafter.selector_top_k={self.selector_top_k} exceeds the vocabulary "
                                  f"({self.vocab_size})")
        elif self.variant == "dspark":
            if self.markov_rank < 1:
                raise ConfigError(f"a DSpark drafter needs markov_rank >= 1, got {self.markov_rank}")
        elif self.variant == "domino":
            if min(self.domino_gru_hidden, self.domino_emb_dim) < 1:
                raise ConfigError(f"a Domino drafter needs gru_hidden_dim and emb_dim >= 1, got "
                                  f"{self.domino_gru_hidden} and {self.domino_emb_dim}")
        elif self.variant == "lilicorr":
            if self.lattice is None:
                raise ConfigError("a LiLiCorr drafter needs its lattice head's geometry (lilicorr_*)")
            self.lattice.check(self.hidden_size, self.vocab_size)
            if self.block_conv and self.hidden_size % self.conv_group_size:
                raise ConfigError(f"drafter.conv_group_size={self.conv_group_size} must divide the hidden size "
                                  f"{self.hidden_size} (DFlash2's convolution shares a kernel per group of channels)")
            if bool(self.conv_kernel_size) != bool(self.conv_group_size):
                raise ConfigError("a LiLiCorr drafter's convolutions need both conv_kernel_size and conv_group_size "
                                  f"(or neither), got {self.conv_kernel_size}, {self.conv_group_size}")
        elif self.variant != "dflash":
            raise ConfigError(f"unknown drafter variant {self.variant!r}: dflash, dflash2, dspark, lilicorr or domino")

    @property
    def block_conv(self) -> bool:
        """Every sublayer sits between DFlash2's block convolutions (DFlash2; LiLiCorr when they are on)."""
        return self.variant == "dflash2" or (self.variant == "lilicorr" and self.conv_kernel_size > 0)

    @property
    def num_taps(self) -> int:
        return len(self.tap_layer_ids)

    @property
    def draft_length(self) -> int:
        """Tokens a block drafts: its slots after the anchor's (DFlash, DFlash2), all of them (DSpark, whose anchor
        slot predicts the next token), or all but the last (Domino: its anchor slot predicts the next token, and
        SGLang verifies a block of block_size)."""
        return self.block_size if self.variant == "dspark" else self.block_size - 1

    @property
    def label_offset(self) -> int:
        """How far past its own position a slot's label is: 0 (DFlash: slot k labels anchor + k, slot 0 none), 1
        (DSpark and Domino: slot k labels anchor + k + 1)."""
        return 1 if self.variant in ("dspark", "domino") else 0

    def layer_window(self, layer: int) -> Optional[int]:
        """The attention window of drafter layer `layer` (None: full attention)."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def qwen3_config(self) -> Qwen3Config:
        """A Qwen3Config describing the drafter layers (for the HF building blocks and the export)."""
        sliding = "sliding_attention" in self.layer_types
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters),
            layer_types=list(self.layer_types),
            use_sliding_window=sliding,
            sliding_window=self.sliding_window if sliding else None,
            tie_word_embeddings=False,
            attention_bias=False,
        )


def first_spare_row(tokenizer) -> int:
    """The default mask token: the first embedding row past the tokenizer's vocabulary (Qwen3: 151669)."""
    return len(tokenizer)


def mlp_width(target_config: Any) -> int:
    """The drafter's default MLP width for `target_config`; the drafter is dense whatever the target is.

    The config's `intermediate_size` when it has one: a dense target's MLP width, a Qwen-MoE or DeepSeek-style
    target's dense-layer width (Qwen3-30B-A3B: 6144), and for MoE configs that have no other (gpt-oss, Mixtral)
    the expert width. A MoE config without it gets the width of the experts a token runs,
    `moe_intermediate_size x num_experts_per_tok`: a dense MLP with the sparse layer's per-token MLP FLOPs.
    """
    width = getattr(target_config, "intermediate_size", None)
    if width:
        return int(width)
    expert, active = (getattr(target_config, k, None) for k in ("moe_intermediate_size", "num_experts_per_tok"))
    if expert and active:
        return int(expert) * int(active)
    raise ConfigError("the target config has neither intermediate_size nor moe_intermediate_size with "
                      "num_experts_per_tok: set drafter.intermediate_size (the drafter's MLP width)")


def global_fields(config: Any) -> Any:
    """A config whose layers differ (Gemma 4: full-attention layers with their own head size and kv heads) refuses
    a global read of a per-layer field; its serialized fields are the base values (the sliding layers'), which
    the drafter, its own Qwen3-style model, takes. Other configs are returned as they are."""
    if not getattr(config, "per_layer_attributes", None):
        return config
    return SimpleNamespace(**config.to_dict())


def drafter_spec(
    target_config: Any, drafter: DrafterConfig, *, mask_token_id: Optional[int] = None
) -> DrafterSpec:
    """The drafter's architecture for `target_config` (an HF config). `mask_token_id` overrides
    `drafter.mask_token_id` (the caller passes the first spare row past the tokenizer when that is None)."""
    target_config = global_fields(text_config(target_config))  # an image-text-to-text target: its language model's
    check_one_residual_stream(target_config)
    mask = drafter.mask_token_id if drafter.mask_token_id is not None else mask_token_id
    if mask is None:
        raise ConfigError("set drafter.mask_token_id (a spare row of the target embedding)")
    num_target_layers = target_config.num_hidden_layers
    # By default one tap per drafter layer, as the released drafters, but no more than the target has layers
    # to tap (all but the last): an 8-layer drafter of a 6-layer target taps its 5 first layers.
    taps = drafter.tap_layer_ids or choose_tap_layer_ids(num_target_layers,
                                                         min(drafter.num_layers, max(1, num_target_layers - 1)))
    heads = target_config.num_attention_heads
    rope = dict(getattr(target_config, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        # one set per layer type (Gemma 3: sliding and full attention): the drafter's layers attend to the whole
        # context, so they take the full-attention layers' set
        if "full_attention" not in rope:
            raise ConfigError(f"the target's rope_parameters are per layer type {sorted(rope)} with no "
                              "'full_attention' entry for the drafter's layers: this target is not supported yet")
        rope = dict(rope["full_attention"])
    if "rope_theta" not in rope:
        rope["rope_theta"] = getattr(target_config, "rope_theta", 10000.0)
    rope.setdefault("rope_type", "default")
    return DrafterSpec(
        hidden_size=target_config.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        intermediate_size=drafter.intermediate_size or mlp_width(target_config),
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_parameters=rope,
        max_position_embeddings=target_config.max_position_embeddings,
        num_layers=drafter.num_layers,
        block_size=drafter.block_size,
        tap_layer_ids=tuple(taps),
        mask_token_id=int(mask),
        num_target_layers=num_target_layers,
        vocab_size=target_config.vocab_size,
        layer_types=tuple(
            "sliding_attention" if i in drafter.sliding_layers else "full_attention"
            for i in range(drafter.num_layers)
        ),
        sliding_window=drafter.sliding_window if drafter.sliding_layers else None,
        **variant_fields(drafter, target_config.hidden_size),
    )


def variant_fields(drafter: DrafterConfig, hidden_size: int) -> dict[str, Any]:
    """The DrafterSpec fields of `drafter.variant` (DFlash2's sizes, DSpark's rank, LiLiCorr's lattice; none but the
    name for DFlash), for a drafter `hidden_size` wide. A lattice head set as wide as the drafter or wider is
    recorded as 0: the drafter's width, no token_proj (`drafter.lilicorr_hidden_size`)."""
    if drafter.variant == "dspark":
        return {"variant": "dspark", "markov_rank": drafter.markov_rank}
    if drafter.variant == "lilicorr":
        sizes = {k: getattr(drafter, f"lilicorr_{k}") for k in LatticeSpec.__dataclass_fields__}
        if sizes["hidden_size"] >= hidden_size:
            sizes["hidden_size"] = 0
        lattice = LatticeSpec(**sizes)
        conv = {k: getattr(drafter, k) if drafter.lilicorr_conv else 0 for k in ("conv_kernel_size", "conv_group_size")}
        return {"variant": "lilicorr", "lattice": lattice, **conv}
    if drafter.variant != "dflash2":
        return {"variant": drafter.variant}
    keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    return {"variant": "dflash2", **{k: getattr(drafter, k) for k in keys}}
