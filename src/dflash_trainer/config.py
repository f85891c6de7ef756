"""The typed configuration tree: YAML recipes in `configs/` plus dotted command-line overrides.

Each component owns its config dataclass next to its code; this module assembles the tree, merges a
recipe and overrides with OmegaConf (unknown keys and wrong types are errors naming the key), and
instantiates the dataclasses so every `__post_init__` validates its values.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dflash_trainer.data.config import DataConfig, RegenerateConfig
from dflash_trainer.drafter.config import DrafterConfig
from dflash_trainer.errors import ConfigError
from dflash_trainer.eval.config import EvalConfig
from dflash_trainer.readback import decode_problem
from dflash_trainer.runtime.config import PipelineConfig
from dflash_trainer.synth.config import SynthesizeConfig
from dflash_trainer.target.config import TargetConfig
from dflash_trainer.train.config import TrainConfig

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
"""Recipes shipped in the repository (a source checkout)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchShape:
    """Shapes shared by the epoch plan, the target's send buffers and the drafter step (fixed for a run, so
    buffers are preallocated and the step compiled once)."""

    token_budget: int
    """Token slots of a packed batch (`pipeline.token_budget`)."""
    max_seqs: int
    """Most sequences a batch can hold: every kept sequence has >= 2 * block_size tokens; one under context
    parallel (a batch is one sequence sharded over the CP group)."""
    num_blocks: int
    """Drafter blocks per batch (`drafter.num_blocks`, default the recipe's 512 per 3072 tokens)."""

    @staticmethod
    def of(pipeline: PipelineConfig, drafter: DrafterConfig) -> "BatchShape":
        packed = max(1, pipeline.token_budget // (2 * drafter.block_size))
        return BatchShape(
            token_budget=pipeline.token_budget,
            max_seqs=1 if pipeline.context_parallel > 1 else packed,
            num_blocks=drafter.blocks_for_budget(pipeline.token_budget),
        )


@dataclass
class RunConfig:
    name: str = "run"
    """Recipe name; the default run dir is runs/<name>-<timestamp>."""
    dir: Optional[str] = None
    """Run directory (chosen once by rank 0 when null)."""
    seed: int = 0
    device: str = "auto"
    """auto (cuda when available) | cpu | cuda."""
    cpu_threads: Optional[int] = None
    """Threads of each process on the CPU; None: its share of the cores that are free at start (the log says how many;
    runtime/cpu_threads.py)."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"run.device must be auto, cpu or cuda, got {self.device!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"run.cpu_threads must be >= 1 or null (chosen from the free cores), got "
                              f"{self.cpu_threads}")
        if not self.name or "/" in self.name:
            raise ConfigError(f"run.name must be a non-empty name without '/', got {self.name!r}")


@dataclass
class LoggingConfig:
    progress: bool = True
    """Live progress bar on rank 0."""
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "dflash-trainer"
    level: str = "INFO"
    report: bool = True
    """Write RUN_DIR/report/ (figures, index.html) at the end of a run (`dflash-train report RUN_DIR` does it any time)."""


NO_TARGET = "set target.path (a model dir or hub id) or target.random_init (a config)"
"""The error of a config that names no target (the one an eval or export outside a run dir gets with no --config)."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    synthesize: SynthesizeConfig = field(default_factory=SynthesizeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        _check_finite(self, "")
        if self.target.path is None and self.target.random_init is None:
            raise ConfigError(NO_TARGET)
        if self.target.quantize == "fp8" and self.run.device == "cpu":
            raise ConfigError("target.quantize=fp8 needs a CUDA GPU with FP8 tensor cores (compute capability "
                              "8.9+), and run.device=cpu asks for none: set target.quantize=null on the CPU")
        if self.pipeline.context_parallel > 1 and self.drafter.kd_weight > 0:
            raise ConfigError(
                f"pipeline.context_parallel={self.pipeline.context_parallel} does not support distillation yet (a "
                "block's teacher rows can lie in the next shard): set drafter.kd_weight=0"
            )
        if self.pipeline.context_parallel > 1 and self.drafter.variant == "lilicorr":
            raise ConfigError(
                f"pipeline.context_parallel={self.pipeline.context_parallel} does not support drafter.variant=lilicorr "
                "yet (a block's anchor context and teacher rows can lie in another shard): set "
                "pipeline.context_parallel=1"
            )
        if self.pipeline.pool_capacity < self.train.grad_accum:
            raise ConfigError(
                f"pipeline.pool_capacity ({self.pipeline.pool_capacity}) must be >= train.grad_accum "
                f"({self.train.grad_accum}): a step holds its batches until it completes"
            )

    @property
    def batch(self) -> BatchShape:
        """The shape of every packed batch (token budget, max sequences, blocks)."""
        return BatchShape.of(self.pipeline, self.drafter)


def _check_finite(node: object, prefix: str) -> None:
    """Refuse NaN and infinity in every float of the tree (sections, lists of sources): no setting means
    "unbounded" by infinity (null or 0 does), and a NaN slips through a section's `if value < 0: raise`."""
    items = ((f.name, getattr(node, f.name)) for f in fields(node)) if is_dataclass(node) else enumerate(node)
    for name, value in items:
        key = f"{prefix}.{name}" if is_dataclass(node) else f"{prefix}[{name}]"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key.lstrip('.')} must be a finite number, got {value}")
        if is_dataclass(value) or isinstance(value, (list, tuple)):
            _check_finite(value, key)


def resolve_recipe(recipe: str | os.PathLike) -> Path:
    """A recipe path, or the name of a recipe shipped in `configs/` (e.g. `demo`)."""
    path = Path(recipe)
    if path.is_file():
        return path
    for candidate in (CONFIGS_DIR / f"{recipe}.yaml", CONFIGS_DIR / str(recipe)):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"recipe {str(recipe)!r} not found: give a YAML file path or one of {list_recipes()}")


def list_recipes() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")) if CONFIGS_DIR.is_dir() else []


def _load_recipe(path: Path):
    """The recipe's YAML mapping; a syntax error, a duplicate key or another top level is a ConfigError."""
    import yaml

    try:
        text = path.read_bytes().decode("utf-8")  # first, so that a byte that is not UTF-8 is named by its offset
        _check_not_cut(path, text)
        layer = OmegaConf.load(path)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"recipe {path}: not valid YAML{at}: {problem}; fix the file") from None
    except UnicodeDecodeError as e:  # a byte damaged on disk, or a file saved in another encoding
        raise ConfigError(f"recipe {path}: {decode_problem(e)}; fix the file (save it as UTF-8; a run's config.yaml "
                          "is written again from the recipe and overrides it was started with)") from None
    if not OmegaConf.is_dict(layer):
        raise ConfigError(f"recipe {path}: the top level must be a mapping of sections (run:, target:, ...), "
                          f"not a list")
    return layer


def load_config(recipe: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> Config:
    """Defaults < recipe YAML < dotted overrides (`train.lr=3e-4`), validated."""
    try:
        merged = OmegaConf.structured(Config)
        layers = []
        if recipe is not None:
            path = resolve_recipe(recipe)
            layer = _load_recipe(path)
            if "run" not in layer or "name" not in layer.get("run", {}):
                layer = OmegaConf.merge(layer, {"run": {"name": path.stem}})
            layers.append(layer)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like section.key=value")
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(merged, *layers)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        first = str(e).splitlines()[0]
        where = f"config key {key!r}: " if key else "config: "
        if key and "not in" in first and "Did you mean" not in first and (known := _synonym(key)):
            first += f". Did you mean: {known!r}?"
        raise ConfigError(where + _with_fix(first)) from None
    except ConfigError:
        raise
    except ValueError as e:  # a __post_init__ outside our ConfigError
        raise ConfigError(str(e)) from None


KINDS = {"Float": "a number (such as 3e-4)", "Integer": "a whole number", "Boolean": "true or false",
         "String": "a string"}
"""What a value of each of omegaconf's types looks like, for the error of a value that is not one."""


def _with_fix(message: str) -> str:
    """omegaconf's message for a value of the wrong type, with what to give instead."""
    found = re.search(r"could not be converted to (\w+)|is not a valid (bool)", message)
    kind = found and (found.group(1) or "Boolean")
    return f"{message}: give {KINDS[kind]}" if kind in KINDS else message


SYNONYMS = {"learning_rate": "lr", "lr_min": "min_lr_ratio", "epochs": "num_epochs", "max_epochs": "num_epochs",
            "steps": "max_steps", "num_steps": "max_steps", "total_steps": "max_steps", "warmup": "warmup_ratio",
            "warmup_steps": "warmup_ratio", "gradient_accumulation_steps": "grad_accum", "clip_grad": "grad_clip",
            "max_grad_norm": "grad_clip", "save_interval": "checkpoint_interval", "save_steps": "checkpoint_interval",
            "model": "path", "model_path": "path", "num_draft_layers": "num_layers", "layers": "num_layers",
            "batch_size": "token_budget", "max_seq_len": "max_length", "seq_len": "max_length",
            "eval_interval": "interval"}
"""Names other trainers give to our settings (section-less: the key's last part), for the error of a wrong key."""


def _synonym(key: str) -> str | None:
    """Our key for `key` when its last part is another trainer's name for one of our settings."""
    section, _, name = key.rpartition(".")
    ours = SYNONYMS.get(name)
    if ours is None:
        return None
    wanted = [f.name for f in fields(Config) if callable(f.default_factory)
              and ours in {g.name for g in fields(f.default_factory())}]
    if section in wanted:
        return f"{section}.{ours}"
    return f"{wanted[0]}.{ours}" if wanted else None


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


RUN_CONFIG_HEAD = "# dflash-train: the run's config, every setting; its last line marks its end"
RUN_CONFIG_END = "# end of the run's config"
"""The first and last lines of a run's `config.yaml` (`run_config_text`): a file that opens with the first and lacks
the last was cut short (a copy or a disk fault), and the settings past the cut would silently take their defaults.
Both are comments, so the file stays a recipe anyone can edit."""


def run_config_text(config: Config) -> str:
    """A run's `config.yaml`: `config` between `RUN_CONFIG_HEAD` and `RUN_CONFIG_END`."""
    return f"{RUN_CONFIG_HEAD}\n{to_yaml(config)}{RUN_CONFIG_END}\n"


def _check_not_cut(path: Path, text: str) -> None:
    """A run's config.yaml (it opens with `RUN_CONFIG_HEAD`) that lacks its last line is a ConfigError."""
    if text.startswith(RUN_CONFIG_HEAD) and text.rstrip().splitlines()[-1].strip() != RUN_CONFIG_END:
        raise ConfigError(f"recipe {path}: cut short: a run's config.yaml ends with the line {RUN_CONFIG_END!r} and "
                          "this one does not, so the settings past the cut would silently take their defaults; "
                          "restore the file (from a copy, or write the missing settings back and end it with that "
                          "line)")
