"""The config a resumed run trains with: the run's own `config.yaml`, changed only where a resume may change it.

`dflash-train train --resume run.dir=RUN` continues the run RUN as it was configured. Dotted overrides may change
its budgets (`train.max_steps`, `max_minutes`, `num_epochs`: the lr schedule follows them), checkpoint and log
cadence, evaluation cadence, logging, the placement (`pipeline.*` but its token budget; more drafter ranks take
more batches a step), the device, and speed knobs that compute the same thing. Those are applied, printed, written
into `config.yaml` and kept in `summary.json`. Any other difference would change the data, the plan, the model, the
optimizer's settings, or how tau is measured (which `best/` is chosen by) mid-run: it is refused, naming each key
with the run's value and the one given. Paths compare by the file they name. A `--config` recipe is not applied on
resume (the run's config is the base): where it differs from the run, each difference is named as not applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf

from dflash_trainer.config import Config, load_config
from dflash_trainer.errors import ConfigError

MAY_CHANGE = (
    "run.dir", "run.device", "run.name", "run.cpu_threads",
    "target.attn_implementation", "target.compile", "target.cudnn_attention",
    "drafter.attention", "drafter.flex_kernel_options", "drafter.loss_chunk_rows", "drafter.loss_kernel",
    "drafter.mask_tiles",
    "data.cache_dir", "data.num_workers",
    "pipeline",
    "train.num_epochs", "train.max_steps", "train.max_minutes", "train.resume", "train.overwrite", "train.keep_last",
    "train.checkpoint_interval", "train.log_interval", "train.max_nonfinite_steps", "train.compile",
    "train.compile_mode", "train.fsdp", "train.blocks_per_chunk",
    "eval.interval", "eval.at_end", "eval.batch_size", "eval.prompt_lookup", "regenerate", "synthesize",
    "logging",
)
"""Keys (or whole sections) a resume may change: budgets, cadence, evaluation, logging, placement, speed knobs."""
MUST_STAY = ("pipeline.token_budget", "pipeline.context_parallel")
"""Keys inside a MAY_CHANGE section that still may not change (the batch shape: plan and blocks; context parallel
plans one sequence per job)."""
NOT_REPORTED = ("run.dir", "run.name", "train.resume", "train.overwrite")
"""Differences that only say how this command was called."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One setting that differs between the run's config and this command's."""

    key: str
    """Dotted key, e.g. `train.max_steps`."""
    old: Any
    """The run's value (its config.yaml)."""
    new: Any
    """The value given now."""

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumedConfig:
    """What `resumed_config` decided."""

    config: Config
    """The run's config with the changes applied."""
    changes: tuple[Change, ...]
    """Overrides applied (each one a resume may make)."""
    recipe_not_applied: tuple[Change, ...]
    """Where `--config`'s recipe differs from the run: the run's value is kept (`old`), the recipe's (`new`) is not."""
    recipe_problem: Optional[str] = None
    """Why `--config`'s recipe could not be read (it is not applied on resume, so it is only not compared)."""


def _leaves(config: Config) -> dict[str, Any]:
    """Dotted key -> value; lists (and lists of mappings, such as data.sources) are one value each."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(OmegaConf.structured(config)), "")
    return out


def _compared(value: Any) -> Any:
    """`value` as a resume compares it: a string naming an existing file or folder by the path it resolves to
    (`data` and `./data` are one folder), inside lists and mappings too."""
    if isinstance(value, str) and value and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    if isinstance(value, list):
        return [_compared(v) for v in value]
    if isinstance(value, dict):
        return {k: _compared(v) for k, v in value.items()}
    return value


def differences(old: Config, new: Config) -> list[Change]:
    """Every leaf setting whose value differs (paths by the file they name), in the config tree's order."""
    before, after = _leaves(old), _leaves(new)
    return [Change(key=k, old=before.get(k), new=after.get(k)) for k in after
            if _compared(before.get(k)) != _compared(after.get(k))]


def may_change(key: str) -> bool:
    def under(prefixes: Sequence[str]) -> bool:
        return any(key == p or key.startswith(p + ".") for p in prefixes)

    return under(MAY_CHANGE) and not under(MUST_STAY)


def resumed_config(run_dir: Path, overrides: Sequence[str], recipe: Optional[str] = None) -> ResumedConfig:
    """The config to resume `run_dir` with: its config.yaml plus `overrides` (see the module docstring). Raises a
    ConfigError naming every refused difference."""
    saved_path = Path(run_dir) / "config.yaml"
    saved = load_config(saved_path)
    requested = load_config(saved_path, [*overrides, f"run.dir={run_dir}"])
    changes = [c for c in differences(saved, requested) if c.key not in NOT_REPORTED]
    refused = [f"{c} (given)" for c in changes if not may_change(c.key)]
    not_applied: list[Change] = []
    try:
        from_recipe = None if recipe is None else load_config(recipe, [*overrides, f"run.dir={run_dir}"])
    except ConfigError as e:  # never applied: a recipe that cannot be read only goes unchecked
        recipe_problem, from_recipe = str(e), None
    else:
        recipe_problem = None
    if from_recipe is not None:  # never applied, so never refused: its differences are named
        not_applied = [c for c in differences(requested, from_recipe) if c.key not in NOT_REPORTED]
    if refused:
        raise ConfigError(
            f"--resume continues the run in {run_dir} as its config.yaml says, and these settings would change what it "
            f"trains (the run's value -> the one given): {'; '.join(refused)}. Resume without them (a resume may "
            "change budgets such as train.max_steps, train.max_minutes and train.num_epochs, evaluation, logging, "
            "the placement and speed settings), or start a new run: another run.dir, or --overwrite")
    return ResumedConfig(config=requested, changes=tuple(changes), recipe_not_applied=tuple(not_applied),
                         recipe_problem=recipe_problem)
