"""Configuration of the DFlash drafter and its training objective."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dflash_trainer.errors import ConfigError

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
"""Loss decay per block size from the DFlash recipe."""

BLOCKS_PER_TOKEN = 512 / 3072
"""The recipe's anchor density: up to 512 blocks per 3072-token sequence."""

FLEX_BACKENDS = ("AUTO", "TRITON", "FLASH")
"""flex_attention's kernel backends that train: torch picks (AUTO), its Triton kernels, or FlashAttention-4
(FLASH, Hopper and Blackwell; `drafter.model.check_flex_backend`)."""


def check_tap_order(tap_layer_ids, where: str) -> None:
    """Taps must be listed in increasing layer order: vLLM and SGLang concatenate the target's taps in layer
    order whatever the config lists, so a drafter whose `fc` learned another order would be served wrong."""
    taps = list(tap_layer_ids)
    if taps != sorted(taps):
        raise ConfigError(f"{where} must be in increasing order, got {taps}: serving engines (vLLM, SGLang) "
                          f"concatenate the taps in layer order; list them as {sorted(taps)}")


VARIANTS = ("dflash", "dflash2", "dspark", "lilicorr")
"""Drafter variants: DFlash, DFlash2 (DFlash plus block convolutions and a candidate selector, `dflash2.py`), DSpark
(the anchor's slot drafts too, plus a Markov head, `dspark.py`), and LiLiCorr (DFlash, DFlash2's convolutions
optional, plus a lattice head over the top-K candidates, `lilicorr.py`)."""

DFLASH2_OPTIONS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_weight",
                   "selector_warmup", "selector_missing", "selector_detach")
"""DrafterConfig fields only DFlash2 reads."""

DSPARK_OPTIONS = ("markov_rank", "dspark_divergence")
"""DrafterConfig fields only DSpark reads."""

BLOCK_CONV_OPTIONS = ("conv_kernel_size", "conv_group_size")
"""DFlash2's convolution sizes, which LiLiCorr reads too with `lilicorr_conv`."""

LILICORR_OPTIONS = ("lilicorr_conv", "lilicorr_hidden_size", "lilicorr_candidate_topk", "lilicorr_num_layers",
                    "lilicorr_num_heads", "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps",
                    "lilicorr_logit_scale", "lilicorr_w_ce", "lilicorr_w_margin", "lilicorr_margin", "lilicorr_w_pen")
"""DrafterConfig fields only LiLiCorr reads."""

DIVERGENCES = ("l1", "kl")
"""`drafter.dspark_divergence`: the distance to the target's distribution that `drafter.kd_weight` weighs."""

SELECTOR_MISSING = ("inject", "ignore")
"""DFlash2's selector loss where the true token is not among the top-K candidates (`dflash2.selector_targets`)."""


@dataclass
class DrafterConfig:
    variant: str = "dflash"
    """dflash | dflash2 | dspark | lilicorr: DFlash2 adds grouped dynamic convolutions inside each block around every
    sublayer and a candidate selector over the top-K of each slot's logits (drafter/dflash2.py). DSpark's anchor slot
    drafts the next token (B slots draft B tokens) and a Markov head biases each slot by the token before it
    (drafter/dspark.py). LiLiCorr adds a lattice head that walks the top-K candidates as a chain (drafter/lilicorr.py;
    DFlash2's convolutions with lilicorr_conv). `init_from` a DFlash export or checkpoint starts DFlash2 or LiLiCorr
    where that DFlash drafter is."""
    conv_kernel_size: int = 2
    """DFlash2 (and LiLiCorr with lilicorr_conv): taps of each block convolution (the current slot and the ones
    before it)."""
    conv_group_size: int = 16
    """DFlash2 (and LiLiCorr with lilicorr_conv): channels sharing one dynamic kernel weight; must divide the hidden
    size."""
    selector_rank: int = 256
    """DFlash2: rank of the selector's codebooks (vocab x rank each) and hidden projection."""
    selector_top_k: int = 16
    """DFlash2: candidates the selector ranks per slot (the top of the drafter's logits)."""
    selector_weight: float = 1.0
    """DFlash2: weight of the selector's K-way cross-entropy next to the DFlash loss (same per-slot weights)."""
    selector_warmup: float = 0.0
    """DFlash2: fraction of training over which the selector's weight ramps linearly from 0 (0: full from the start)."""
    selector_missing: str = "inject"
    """DFlash2: a slot whose true token is not among the top-K: inject it as the K-th candidate, or ignore the slot
    in the selector's loss."""
    selector_detach: bool = False
    """DFlash2: stop the selector's gradient at the backbone (it then trains the selector's own weights only)."""
    markov_rank: int = 256
    """DSpark: rank of the Markov head (an embedding V x r, then r -> V)."""
    dspark_divergence: str = "l1"
    """DSpark: the distance to the target's distribution that `kd_weight` weighs: l1 (sum |p - q|, twice the total
    variation: DSpark's own loss, 0.1 CE + 0.9 L1 at kd_weight 0.9) or kl (DFlash's KD)."""
    lilicorr_conv: bool = False
    """LiLiCorr: wrap every sublayer in DFlash2's block convolutions (drafter.conv_kernel_size, conv_group_size)."""
    lilicorr_hidden_size: int = 1024
    """LiLiCorr: width of the lattice head, at most the drafter's hidden size (0, or a width at least the drafter's:
    the drafter's). 1024 is ModelOpt's published recipe for Qwen3-8B's 4,096-wide drafter
    (modelopt_recipes/general/speculative_decoding/lilicorr.yaml). The head runs over every candidate of every slot,
    so its cost grows with its width squared (bench/flops.py, lilicorr_step_flops; prices in bench/RESULTS.md)."""
    lilicorr_candidate_topk: int = 8
    """LiLiCorr: candidates per slot (a power of two <= 16, the engines' limit)."""
    lilicorr_num_layers: int = 2
    lilicorr_num_heads: int = 8
    lilicorr_mlp_ratio: float = 2.0
    lilicorr_factor_dim: int = 1024
    """LiLiCorr: width of the out/in vectors whose cosines score the transitions. This and the head's other sizes,
    `lilicorr_vector_eps` and `lilicorr_logit_scale` default to ModelOpt's published recipe (its
    modelopt_recipes/general/speculative_decoding/lilicorr.yaml)."""
    lilicorr_vector_eps: float = 1e-4
    """LiLiCorr: the floor of the out/in vectors' norms when they are normalised."""
    lilicorr_logit_scale: float = 8.0
    """LiLiCorr: the fixed scale of the cosine scores (their log-factors lie in [-scale, scale])."""
    lilicorr_w_ce: float = 0.25
    """LiLiCorr: weight of the lattice's K-way cross-entropy (ModelOpt's `base` recipe: 0.25, `margin`: 0.125)."""
    lilicorr_w_margin: float = 0.0
    """LiLiCorr: weight of the hinge on (true score - best other) (`margin` recipe: 0.125)."""
    lilicorr_margin: float = 2.0
    """LiLiCorr: the hinge's width."""
    lilicorr_w_pen: float = 0.25
    """LiLiCorr: weight of the distractor penalty (E over the head's distribution of the target's logit gap to the
    true token); needs the target's last hidden state, which the run then captures."""
    num_layers: int = 5
    block_size: int = 16
    tap_layer_ids: Optional[list[int]] = None
    """Target layers tapped (output of decoder layer l = HF hidden_states[l + 1]); None: one per drafter layer
    (at most one per target layer but the last), spread evenly."""
    mask_token_id: Optional[int] = None
    """Embedding row used for MASK slots; None: the first spare row past the tokenizer's vocabulary."""
    num_blocks: Optional[int] = None
    """Blocks per packed batch; None: pipeline.token_budget * 512 / 3072."""
    gamma: Optional[float] = None
    """Loss decay exp(-(k-1)/gamma); None: 7/5/4 for B = 16/10/8."""
    init_from: Optional[str] = None
    """Start from an exported drafter directory (e.g. a released DFlash drafter), or `target`: from the
    target's own decoder layers (see drafter/init.py)."""
    intermediate_size: Optional[int] = None
    """MLP width; None: the target's `intermediate_size` (for a MoE target its dense MLP width, or the expert
    width where the config has no other, as gpt-oss), else `moe_intermediate_size x num_experts_per_tok`."""
    attention: str = "auto"
    """auto (flex on GPU, sdpa on CPU) | flex | sdpa."""
    flex_kernel_options: dict[str, Any] = field(default_factory=dict)
    """Passed to flex_attention as `kernel_options` (e.g. `BACKEND: FLASH` for FlashAttention-4's kernels,
    `fwd_BLOCK_M`, `bwd_num_warps`); empty: torch's defaults. A speed knob only: the attention computed is the
    same."""
    loss_chunk_rows: int = 2048
    """Rows per chunk of the vocab projection + CE (bounds fp32 logits memory)."""
    loss_kernel: str = "compiled"
    """compiled | eager: the CE-and-gradient pass over each logits chunk, torch.compile'd on CUDA (one fused
    pass) or eager (an fp32 copy and separate passes); LiLiCorr's lattice head and its terms, and DSpark's loss
    chunks, likewise. A speed knob only: the values are the same."""
    mask_tiles: str = "intervals"
    """intervals | pairs: full-attention BlockMasks find their tiles from each query block's key intervals, or
    from `create_block_mask` evaluating every (query, key) pair. A speed knob only: the mask is the same."""
    kd_weight: float = 0.0
    """Weight of distillation from the target's logits (0: CE only; 1: KD only)."""
    noise: str = "none"
    """Noise on the taps before fc: none | uniform | gaussian."""
    noise_std: float = 0.0
    noise_std_final: Optional[float] = None
    """Linear schedule of the noise std over training (None: constant)."""
    dpace: bool = False
    """D-PACE per-slot loss weights instead of the exponential decay (see drafter/loss.py)."""
    dpace_alpha: float = 0.5
    """D-PACE confidence smoothing: q~ = (1 - alpha) * exp(-CE) + alpha; in (0, 1]."""
    sliding_window: Optional[int] = None
    sliding_layers: list[int] = field(default_factory=list)
    """Drafter layers that use sliding-window attention (layer_types = sliding_attention)."""

    def __post_init__(self) -> None:
        if self.variant == "domino":
            raise ConfigError("drafter.variant=domino: dflash-train evaluates ModelOpt's Domino exports (`dflash-train "
                              "eval --drafter EXPORT`) but does not train Domino; train dflash2 (the recipe), dflash, "
                              "dspark or lilicorr")
        if self.variant not in VARIANTS:
            raise ConfigError(f"drafter.variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        self._check_variant_options()
        if self.selector_missing not in SELECTOR_MISSING:
            raise ConfigError(f"drafter.selector_missing must be inject or ignore, got {self.selector_missing!r}")
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, key) < 1:
                raise ConfigError(f"drafter.{key} must be >= 1, got {getattr(self, key)}")
        if self.block_size < 2:
            raise ConfigError(f"drafter.block_size must be >= 2 (the anchor and at least one drafted slot), got "
                              f"{self.block_size}")
        if self._option_owner("conv_kernel_size") is None and self.conv_kernel_size > self.block_size:
            raise ConfigError(f"drafter.conv_kernel_size={self.conv_kernel_size} reaches past a block of "
                              f"drafter.block_size={self.block_size} slots: at most the block size")
        weights = (self.lilicorr_w_ce, self.lilicorr_w_margin, self.lilicorr_w_pen)
        if self.variant == "lilicorr" and (min(weights) < 0 or not any(weights)):
            raise ConfigError(f"drafter.lilicorr_w_ce, lilicorr_w_margin, lilicorr_w_pen must be >= 0 and one > 0 (or "
                              f"the lattice head never trains), got {weights}")
        if self.variant == "lilicorr" and self.lilicorr_w_margin > 0 and self.lilicorr_margin <= 0:
            raise ConfigError(f"drafter.lilicorr_w_margin > 0 needs drafter.lilicorr_margin > 0, got "
                              f"{self.lilicorr_margin}")
        if self.selector_weight < 0 or not 0.0 <= self.selector_warmup <= 1.0:
            raise ConfigError("drafter.selector_weight must be >= 0 and drafter.selector_warmup in [0, 1]")
        if self.num_layers < 1:
            raise ConfigError(f"drafter.num_layers must be >= 1, got {self.num_layers}")
        if self.tap_layer_ids is not None:
            if not self.tap_layer_ids:
                raise ConfigError("drafter.tap_layer_ids must not be empty (or null to choose them)")
            if any(t < 0 for t in self.tap_layer_ids) or len(set(self.tap_layer_ids)) != len(self.tap_layer_ids):
                raise ConfigError(f"drafter.tap_layer_ids must be distinct and >= 0, got {self.tap_layer_ids}")
            check_tap_order(self.tap_layer_ids, "drafter.tap_layer_ids")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ConfigError(f"drafter.mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ConfigError(f"drafter.intermediate_size must be >= 1 or null (the target's), got "
                              f"{self.intermediate_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"drafter.num_blocks must be >= 1, got {self.num_blocks}")
        if self.gamma is None and self.block_size not in DEFAULT_GAMMA:
            raise ConfigError(
                f"drafter.gamma has no default for block_size={self.block_size}; set drafter.gamma"
            )
        if self.gamma is not None and self.gamma <= 0:
            raise ConfigError(f"drafter.gamma must be > 0, got {self.gamma}")
        if self.attention not in ("auto", "flex", "sdpa"):
            raise ConfigError(f"drafter.attention must be auto, flex or sdpa, got {self.attention!r}")
        if self.loss_kernel not in ("compiled", "eager"):
            raise ConfigError(f"drafter.loss_kernel must be compiled or eager, got {self.loss_kernel!r}")
        if self.mask_tiles not in ("intervals", "pairs"):
            raise ConfigError(f"drafter.mask_tiles must be intervals or pairs, got {self.mask_tiles!r}")
        if self.loss_chunk_rows < 1:
            raise ConfigError(f"drafter.loss_chunk_rows must be >= 1, got {self.loss_chunk_rows}")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise ConfigError(f"drafter.kd_weight must be in [0, 1], got {self.kd_weight}")
        if self.noise not in ("none", "uniform", "gaussian"):
            raise ConfigError(f"drafter.noise must be none, uniform or gaussian, got {self.noise!r}")
        if self.noise_std < 0 or (self.noise_std_final is not None and self.noise_std_final < 0):
            raise ConfigError("drafter.noise_std and drafter.noise_std_final must be >= 0")
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise ConfigError(f"drafter.dpace_alpha must be in (0, 1], got {self.dpace_alpha}")
        if self.noise != "none" and self.noise_std <= 0 and not self.noise_std_final:
            raise ConfigError(f"drafter.noise={self.noise!r} needs drafter.noise_std > 0 (or noise_std_final)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"drafter.sliding_window must be >= 1 or null, got {self.sliding_window}")
        if self.sliding_layers and not self.sliding_window:
            raise ConfigError("drafter.sliding_layers needs drafter.sliding_window > 0")
        self._check_unread_options()
        if self.flex_kernel_options.get("ROWS_GUARANTEED_SAFE"):
            raise ConfigError(
                "drafter.flex_kernel_options.ROWS_GUARANTEED_SAFE=true gives NaN here: a 128-row query tile can span "
                "two packed sequences, so some rows see no key in a tile; remove the option"
            )
        backend = self.flex_kernel_options.get("BACKEND", "AUTO")
        if backend not in FLEX_BACKENDS:
            raise ConfigError(f"drafter.flex_kernel_options.BACKEND must be one of {', '.join(FLEX_BACKENDS)}, "
                              f"got {backend!r}")
        if any(not 0 <= i < self.num_layers for i in self.sliding_layers):
            raise ConfigError(f"drafter.sliding_layers must be in [0, {self.num_layers}), got {self.sliding_layers}")

    def _check_variant_options(self) -> None:
        """Another variant's options set (off their defaults): an error naming the variant that reads them, since the
        chosen one would train without a word of them."""
        defaults = DrafterConfig.__dataclass_fields__
        changed: dict[str, list[str]] = {}
        for key in (*DFLASH2_OPTIONS, *DSPARK_OPTIONS, *LILICORR_OPTIONS):
            owner = self._option_owner(key)
            if owner is not None and getattr(self, key) != defaults[key].default:
                changed.setdefault(owner, []).append(key)
        for owner, keys in changed.items():
            also = " or set drafter.lilicorr_conv=true" if self.variant == "lilicorr" and owner == "dflash2" and \
                all(k in BLOCK_CONV_OPTIONS for k in keys) else ""
            raise ConfigError(f"drafter.{', drafter.'.join(keys)} {'is a' if len(keys) == 1 else 'are'} "
                              f"{owner} option{'s' if len(keys) > 1 else ''}, which drafter.variant={self.variant} "
                              f"ignores: remove {'it' if len(keys) == 1 else 'them'}{also} or set "
                              f"drafter.variant={owner}")
        if self.markov_rank < 1:
            raise ConfigError(f"drafter.markov_rank must be >= 1, got {self.markov_rank}")
        if self.dspark_divergence not in DIVERGENCES:
            raise ConfigError(f"drafter.dspark_divergence must be one of {', '.join(DIVERGENCES)}, got "
                              f"{self.dspark_divergence!r}")

    def _check_unread_options(self) -> None:
        """An option set off its default whose switch is off: the run would train as if it were not there."""
        defaults = DrafterConfig.__dataclass_fields__
        unread = {"noise_std": ("drafter.noise=uniform or gaussian", self.noise == "none"),
                  "noise_std_final": ("drafter.noise=uniform or gaussian", self.noise == "none"),
                  "dpace_alpha": ("drafter.dpace=true", not self.dpace),
                  "sliding_window": ("drafter.sliding_layers (the layers that use it)", not self.sliding_layers)}
        for key, (switch, off) in unread.items():
            if off and getattr(self, key) != defaults[key].default:
                raise ConfigError(f"drafter.{key}={getattr(self, key)} is read only with {switch}: set that, or "
                                  f"remove drafter.{key}")

    def _option_owner(self, key: str) -> Optional[str]:
        """None when this drafter reads option `key`, else the variant that does."""
        if key in BLOCK_CONV_OPTIONS:
            reads = self.variant == "dflash2" or (self.variant == "lilicorr" and self.lilicorr_conv)
            return None if reads else "dflash2"
        owner = "dflash2" if key in DFLASH2_OPTIONS else "dspark" if key in DSPARK_OPTIONS else "lilicorr"
        return None if self.variant == owner else owner

    @property
    def needs_last_hidden(self) -> bool:
        """The loss reads the target's last hidden state: distillation, or LiLiCorr's distractor penalty."""
        return self.kd_weight > 0 or (self.variant == "lilicorr" and self.lilicorr_w_pen > 0)

    @property
    def loss_gamma(self) -> float:
        return self.gamma if self.gamma is not None else DEFAULT_GAMMA[self.block_size]

    def blocks_for_budget(self, token_budget: int) -> int:
        """Fixed number of blocks per packed batch of `token_budget` tokens."""
        if self.num_blocks is not None:
            return self.num_blocks
        return max(1, int(token_budget * BLOCKS_PER_TOKEN))
