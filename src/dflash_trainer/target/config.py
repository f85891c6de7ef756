"""Configuration of the frozen target model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dflash_trainer.errors import ConfigError
from dflash_trainer.hub import hub_reference

DTYPES = ("bfloat16", "float16", "float32")
QUANTIZE = (None, "fp8")


@dataclass
class TargetConfig:
    path: Optional[str] = None
    """HF model directory or hub id of the target (AutoModelForCausalLM)."""
    random_init: Optional[str] = None
    """Build the target with random weights from a config instead: a builtin preset (target/presets.py:
    tiny | tiny-moe | tiny-gpt-oss | qwen3-1.7b | qwen3-8b | qwen3-30b-a3b | gpt-oss-20b) or a path to a
    config.json / model directory."""
    tokenizer: Optional[str] = None
    """Tokenizer directory or hub id (default: target.path); `tiny` builds the test tokenizer, `tiny:<family>` one
    with a target family's own special tokens and chat template (docs/data.md)."""
    dtype: str = "bfloat16"
    attn_implementation: str = "sdpa"
    trust_remote_code: bool = False
    """Let transformers run the Python files of the model's folder or hub repository (models whose config
    names its classes through `auto_map`). That code runs with your permissions: only for a source you trust."""
    compile: bool = True
    """torch.compile each decoder layer of the target up to the last tap, with automatic dynamic shapes
    (CUDA only; ignored on the CPU; evaluation's decoding runs the layers eager). It costs compile time once
    and pays back in a long run (figures in bench/RESULTS.md). Turn it off for a model that torch.compile
    cannot trace, or a target too small for its forward to matter."""
    cudnn_attention: bool = True
    """Let SDPA pick cuDNN's attention (its first choice on Hopper) in the tap-capture forward. cuDNN builds an
    execution plan the first time it meets a batch shape, and nearly every job of a first epoch has its own; on a
    small target that costs more than the forward (bench/RESULTS.md section 4). false:
    flash attention instead, as evaluation's decoding always runs."""
    quantize: Optional[str] = None
    """`fp8`: the linear layers of the decoder layers in FP8 (e4m3, one scale per weight row and per token of
    the activations, torchao's float8 through `torch._scaled_mm`), on a GPU with FP8 tensor cores (compute
    capability 8.9+: Hopper, Ada); embeddings, norms and the LM head stay in target.dtype, and so do the
    hidden states the taps capture. Needs the torchao package and target.dtype=bfloat16. A checkpoint that
    ships FP8 weights is loaded as it ships with null (that needs transformers' FP8 kernels: the `kernels`
    package and its hub kernel) or, with fp8, dequantized and quantized again here."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"target.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantize not in QUANTIZE:
            raise ConfigError(f"target.quantize must be null or 'fp8', got {self.quantize!r}")
        if self.quantize == "fp8" and self.dtype != "bfloat16":
            # rowwise-scaled FP8 matmuls (torch._scaled_mm) return bfloat16 only
            raise ConfigError(f"target.quantize=fp8 runs the target in bfloat16 around its FP8 matmuls; "
                              f"target.dtype={self.dtype!r} conflicts with it: set target.dtype=bfloat16")
        if self.path is not None and self.random_init is not None:
            raise ConfigError(f"set either target.path or target.random_init, not both: to train on "
                              f"target.path={self.path}, add target.random_init=null (the recipe, e.g. demo, sets a "
                              "random target); to keep the random target, drop target.path")


def loading_error(key: str, name: str, what: str, error: Exception) -> ConfigError:
    """The ConfigError for `error`, raised by transformers loading `what` from `{key}={name}`: a model that
    needs its own code names `target.trust_remote_code` and the risk of turning it on."""
    if "trust_remote_code" in str(error):
        return ConfigError(
            f"{key}={name!r}: its {what} needs Python code shipped with the model (its config.json names classes "
            "through auto_map), and target.trust_remote_code is false. Set target.trust_remote_code=true only if "
            "you trust its source: that code runs on this machine with your permissions"
        )
    return ConfigError(f"{key}={name!r}: cannot load its {what} ({error})")


def model_reference(name: str, key: str, needs: str) -> str:
    """`name` as given when it is an existing folder or looks like a hub id (`org/name`); otherwise a
    ConfigError naming the config key `key` and the file the folder `needs` (e.g. config.json)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / needs).is_file():
            raise ConfigError(f"{key}={name!r} is a folder without {needs}: point it at a Hugging Face model folder")
        return str(path)
    if path.exists():
        raise ConfigError(f"{key}={name!r} is a file: point it at a Hugging Face model folder or a hub id (org/name)")
    looks_local = name.startswith(("/", "./", "../", "~")) or name.count("/") != 1 or "\\" in name
    if looks_local:
        raise ConfigError(f"{key}={name!r} does not exist (relative paths start from {Path.cwd()}); give an existing "
                          "model folder or a hub id (org/name)")
    return name


def model_source(name: str, key: str, needs: str, *, weights: bool = False) -> str:
    """What a loader reads `name` from: `model_reference(name, ...)`, and for a hub id its cached folder when the
    hub cannot be reached (`hub.py`: transformers would retry it for most of a minute); `weights`: the folder must
    hold the weights too."""
    reference = model_reference(name, key, needs)
    if Path(reference).expanduser().is_dir():
        return reference
    return hub_reference(reference, key, needs, weights=weights)
