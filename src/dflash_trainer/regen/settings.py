"""The settings that decide what a regenerated dataset contains, and the checks built on them.

They are stored in `manifest.json` (`settings`): a resume must use the same ones, and the trainer
warns when they differ from how the drafter will be evaluated (thinking on/off changes acceptance a lot).
"""

from __future__ import annotations

import logging
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional

from dflash_trainer.config import Config
from dflash_trainer.errors import ConfigError, DataError
from dflash_trainer.readback import read_json_file
from dflash_trainer.regen.failures import failures

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FAILED_LOG = "failed.jsonl"
"""Where a regenerate output logs its failed rows (`regen/shards.py` writes it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RegenSettings:
    """What changes the generated replies; a resume refuses a directory written with other values."""

    backend: str
    """local | openai."""
    model: str
    """The target: target.path, `random_init=<preset>`, or the served model name."""
    thinking: bool
    """`enable_thinking` passed to the chat template for the generation prompt."""
    temperature: float
    """0: greedy; otherwise sampling at this temperature."""
    max_new_tokens: int
    """Cap on each reply's tokens."""
    chat_template: Optional[str]
    """data.chat_template used by the local backend (None: the tokenizer's; the server's for openai)."""
    max_turns: Optional[int] = None
    """User turns regenerated per conversation (None: all)."""
    max_prompt_tokens: Optional[int] = None
    """(local backend) A prompt longer than this ended its conversation: skipped at the first turn, cut short
    after the turns answered before it at a later one (None: no cap but the target's context)."""
    top_p: float = 1.0
    """Sampling's nucleus (1.0: the whole distribution)."""
    num_samples: int = 1
    """Replies per conversation, each its own row."""
    seed: int = 0
    """Seed of the sampling."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def settings_from_config(config: Config) -> RegenSettings:
    """The settings of a `Config` (its `regenerate`, `target` and `data` sections)."""
    regen, target = config.regenerate, config.target
    if regen.backend == "openai":
        model = regen.model or target.path
        if model is None:
            raise ConfigError(
                "regenerate.backend=openai needs the served model name: set regenerate.model (or target.path)"
            )
    else:
        model = target.path if target.path is not None else f"random_init={target.random_init}"
    return RegenSettings(
        backend=regen.backend,
        model=str(model),
        thinking=bool(regen.thinking),
        temperature=float(regen.temperature),
        max_new_tokens=int(regen.max_new_tokens),
        chat_template=config.data.chat_template if regen.backend == "local" else None,
        max_turns=regen.max_turns,
        max_prompt_tokens=regen.max_prompt_tokens if regen.backend == "local" else None,
        top_p=float(regen.top_p),
        num_samples=int(regen.num_samples),
        seed=int(regen.seed if regen.seed is not None else config.run.seed),
    )


def settings_differences(stored: dict[str, Any], wanted: RegenSettings) -> list[str]:
    """One line per setting whose stored value differs from `wanted` (a setting newer than the directory's
    manifest counts as its default)."""
    defaults = {f.name: f.default for f in fields(RegenSettings) if f.default is not MISSING}
    lines = []
    for key, value in wanted.to_dict().items():
        had = stored.get(key, defaults.get(key))
        if had != value:
            lines.append(f"{key}: the directory has {had!r}, this run asks for {value!r}")
    return lines


def read_manifest(data_dir: str | Path) -> dict[str, Any] | None:
    """The manifest of a regenerate output directory, or None when `data_dir` is not one. A damaged manifest (cut
    short, not UTF-8, not the object we write) is a DataError naming it: the rows beside it are intact, and a rerun
    of the command rewrites it from them."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        return None
    return read_json_file(path, what="the manifest of a regenerate / synthesize output", fix=(
        f"rerun the same `dflash-train regenerate` (or `synthesize`) command with --out {data_dir}: it rewrites the "
        "manifest from the rows written, which are kept"))


def damaged_manifest_warning(data_dir: str | Path) -> Optional[str]:
    """A warning when `data_dir`'s manifest is damaged (what to do included), else None."""
    try:
        read_manifest(data_dir)
    except DataError as e:
        return f"{e} (until then its settings and completeness are not checked)"
    return None


def check_regen_settings(data_dir: str | Path, thinking: bool, temperature: float, *,
                         check_temperature: bool = True) -> list[str]:
    """Warnings for training on `data_dir` when the drafter is evaluated/served with these settings.

    Empty when `data_dir` is not a regenerate output (nothing to compare) or everything matches.
    `check_temperature=False` leaves the temperature out (a sampled source mixed with a matching one).
    """
    damage = damaged_manifest_warning(data_dir)
    if damage is not None:
        return [damage]
    manifest = read_manifest(data_dir)
    if manifest is None:
        return []
    settings = manifest.get("settings", {})
    warnings = []
    if "thinking" in settings and bool(settings["thinking"]) != bool(thinking):
        warnings.append(
            f"{data_dir} was regenerated with thinking={'on' if settings['thinking'] else 'off'} but the drafter "
            f"is evaluated with thinking={'on' if thinking else 'off'}: acceptance drops sharply when they differ. "
            "Regenerate with regenerate.thinking matching, or set eval/data thinking to match the data."
        )
    if check_temperature and "temperature" in settings and float(settings["temperature"]) != float(temperature):
        warnings.append(
            f"{data_dir} was regenerated at temperature={settings['temperature']} but the drafter is evaluated "
            f"at temperature={temperature}; regenerate with regenerate.temperature={temperature} for labels "
            "that match how the target will answer."
        )
    if not manifest.get("complete", False):
        warnings.append(_partial_warning(data_dir, manifest))
    return warnings


def _partial_warning(data_dir: str | Path, manifest: dict[str, Any]) -> str:
    """Training on `data_dir` trains on part of it: how much is missing, why, and the command that finishes it."""
    command = "synthesize" if "synthesize" in manifest else "regenerate"  # the writer's own block says which
    done, total = manifest.get("rows_done"), manifest.get("rows_total")
    missing = manifest.get("rows_missing")
    if not isinstance(missing, int):  # a manifest written before it was recorded
        missing = total - done if isinstance(done, int) and isinstance(total, int) else "some"
    counts = manifest.get("failures")
    failed = failures(counts if isinstance(counts, dict) else {}, str(Path(data_dir) / FAILED_LOG))
    why = f"; {failed.line()}" if failed.total else ""
    return (f"{data_dir} is a partial {command} output ({done if done is not None else '?'} rows done of "
            f"{total if total is not None else '?'}, {missing} missing{why}): training on it now trains on part of the "
            f"data. Rerun the same `dflash-train {command} --out {data_dir}` to finish.")


def regen_temperature(data_dir: str | Path) -> Optional[float]:
    """The temperature `data_dir` was regenerated at; None when it is not a regenerate output."""
    manifest = None if damaged_manifest_warning(data_dir) else read_manifest(data_dir)
    if manifest is None or "temperature" not in manifest.get("settings", {}):
        return None
    return float(manifest["settings"]["temperature"])


def warn_regen_mismatch(config: Config) -> list[str]:
    """Log (and return) warnings when a regenerated training source used other thinking/temperature settings
    than evaluation (and serving) will.

    Sources sampled at another temperature beside a source regenerated at the evaluation's are extra replies
    on purpose (more distinct labels per prompt; bench/RESULTS.md section 5, the practice recipe):
    logged as such, not warned about.
    """
    temperature = float(config.eval.temperature)
    dirs = [source.path for source in config.data.resolved_sources() if Path(source.path).is_dir()]
    sampled_at = {d: regen_temperature(d) for d in dirs}
    mixed = any(t == temperature for t in sampled_at.values())
    warnings = []
    for d in dirs:
        warnings += check_regen_settings(d, config.data.thinking, temperature, check_temperature=not mixed)
        if mixed and sampled_at[d] is not None and sampled_at[d] != temperature:
            log.info("%s was regenerated at temperature=%g: trained on as extra replies beside the data "
                     "regenerated at the evaluation's temperature=%g", d, sampled_at[d], temperature)
    for warning in warnings:
        log.warning(warning)
    return warnings


def hint_foreign_replies(config: Config) -> Optional[str]:
    """One logged line when a training source holds replies this target did not write (not a `regenerate` or
    `synthesize` output, or one written by another model): a drafter learns to predict its target's own replies, so
    trained on someone else's it accepts little. None when every source is this target's."""
    own = settings_from_config(config).model if config.regenerate.backend == "local" else None
    foreign, other = [], []
    for source in config.data.resolved_sources():
        manifest = None if damaged_manifest_warning(source.path) else read_manifest(source.path)
        if manifest is None:
            foreign.append(str(source.path))
            continue
        settings = manifest.get("settings", {})
        wrote = settings.get("model")
        if own is not None and settings.get("backend") == "local" and wrote and not _same_model(wrote, own):
            other.append(f"{source.path} (by {wrote})")
    if not foreign and not other:
        return None
    parts = []
    if foreign:
        parts.append(f"{', '.join(foreign)} hold{'s' if len(foreign) == 1 else ''} replies the target did not write")
    if other:
        parts.append(f"{', '.join(other)} {'was' if len(other) == 1 else 'were'} regenerated by another model than "
                     f"this target ({own})")
    hint = (f"data: {'; '.join(parts)}. A drafter learns to predict its target's own replies: have the target answer "
            "the prompts first (`dflash-train regenerate --config RECIPE --out DIR data.path=SOURCE`, then "
            "data.path=DIR)")
    log.warning(hint)
    return hint


def _same_model(a: str, b: str) -> bool:
    """The same target: equal names, or paths to the same folder."""
    if a == b:
        return True
    pa, pb = Path(a), Path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
