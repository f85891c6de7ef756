"""`dflash-train SUBCOMMAND [--config RECIPE] [options] [section.key=value ...]`.

Each subcommand lives in `dflash_trainer.commands.<name>` and exposes `run(config, args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from dflash_trainer.config import NO_TARGET, Config, list_recipes, load_config
from dflash_trainer.errors import ConfigError, DataError, NotBuiltYet, StorageError
from dflash_trainer.resume import resumed_config
from dflash_trainer.runtime.cpu_threads import set_cpu_threads
from dflash_trainer.rundir import RunDir, input_dir_problem, run_dir_given

SUBCOMMANDS = {
    "plan": "tokenize the data and print the epoch plan summary",
    "train": "train a drafter (one process colocated, or under torchrun)",
    "eval": "measure acceptance length (tau) by speculative decoding",
    "export": "write a training checkpoint in an inference format (DFlash, or speculators for vLLM)",
    "regenerate": "answer a dataset's prompts again with the target",
    "synthesize": "the target writes its own prompts (Magpie-style), filtered and deduplicated, and answers them",
    "report": "figures of a run in one self-contained HTML page (RUN_DIR/report/)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train DFlash speculative-decoding drafters.",
        epilog=f"Recipes shipped: {', '.join(list_recipes()) or '(none)'}. "
        "Override any config key with section.key=value, e.g. train.lr=3e-4.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, help_text in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--config", "-c", default=None, help="YAML recipe (path or name in configs/)")
        if name == "report":
            p.add_argument("run_dir", help="the run directory")
        p.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted config overrides")
        if name == "train":
            p.add_argument("--resume", action="store_true", help="same as train.resume=latest")
            p.add_argument("--overwrite", action="store_true",
                           help="replace a training run already in run.dir (same as train.overwrite=true)")
        if name == "eval":
            p.add_argument("--drafter", required=False, help="exported drafter directory")
            p.add_argument("--out", default=None, help="directory for eval.json (default: the run dir)")
        if name == "export":
            p.add_argument("--checkpoint", required=False, help="training checkpoint directory")
            p.add_argument("--out", required=False, help="output directory")
            p.add_argument("--format", choices=("dflash", "speculators"), default="dflash",
                           help="dflash (default): SGLang and the DFlash reference code load it; speculators: "
                           "vLLM loads it natively")
            p.add_argument("--verifier", default=None,
                           help="with --format speculators: hub id or folder of the target you will serve "
                           "(default: target.path)")
            p.add_argument("--save-target", default=None, metavar="DIR",
                           help="with --format speculators: write this config's target (e.g. the demo's random "
                           "one: weights, config, tokenizer) to DIR and record DIR as the verifier")
        if name in ("regenerate", "synthesize"):
            p.add_argument("--out", required=False, help="output dataset directory")
        if name == "report":
            p.add_argument("--out", default=None, help="directory for the report (default: RUN_DIR/report)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The subcommand and its arguments, options accepted anywhere: before, between or after the overrides
    (`train data.path=D --resume run.dir=X`). argparse reads the positional overrides in one run, so the
    overrides after an option come back unparsed: they join the others, in their order."""
    parser = _parser()
    args, extras = parser.parse_known_args(argv)
    stray = [a for a in extras if a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extras:
        args.overrides = [*args.overrides, *extras]
    return args


def _run_config(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The recipe and extra overrides for this command: `--config`, or for `export --checkpoint` and `eval
    --drafter` without one, the run's own `config.yaml` found above that directory (RUN/checkpoints/step_N,
    RUN/export, RUN/best), with `run.dir` set to that run so its held-out prompts and outputs are found."""
    if args.config is not None:
        return args.config, []
    given = getattr(args, "checkpoint", None) or getattr(args, "drafter", None)
    if not given:
        return None, []
    given = Path(given).resolve()
    for run_dir in list(given.parents)[:2]:
        layout = RunDir(run_dir)
        if layout.config.is_file() and (given in (layout.export, layout.best) or given.parent == layout.checkpoints):
            print(f"dflash-train {args.command}: using the run's config {layout.config} (pass --config to "
                  "choose another)", file=sys.stderr)
            return str(layout.config), [f"run.dir={run_dir}"]
    return None, []


def _given(overrides: Sequence[str], key: str) -> str | None:
    """The value the last `key=value` override gives (None when none does)."""
    values = [item.split("=", 1)[1] for item in overrides if item.split("=", 1)[0] == key]
    return values[-1] if values else None


def _resumed_run(args: argparse.Namespace, overrides: list[str]) -> Path | None:
    """For `train --resume`: the run dir to continue when it holds the run's config.yaml (else None: a start)."""
    resume = _given(overrides, "train.resume")
    if args.command != "train" or resume in (None, "", "null", "None"):
        return None
    run_dir = _given(overrides, "run.dir")
    if run_dir is None and resume != "latest":  # a checkpoint of a run: RUN_DIR/checkpoints/step_N
        checkpoint = Path(resume).expanduser()
        if checkpoint.parent.name == "checkpoints" and RunDir(checkpoint.parent.parent).config.is_file():
            run_dir = str(checkpoint.parent.parent)
    if run_dir is None and args.config is not None:  # a recipe that names its run dir
        run_dir = load_config(args.config, [o for o in overrides if not o.startswith("train.resume=")]).run.dir
    if run_dir in (None, "", "null", "None"):
        raise ConfigError("--resume (train.resume) needs the run to continue: add run.dir=RUN_DIR (or give "
                          "train.resume=RUN_DIR/checkpoints/step_N)")
    found = RunDir(Path(run_dir).expanduser())
    if found.config.is_file():
        return found.root
    if args.config is None:
        raise ConfigError(f"--resume: run.dir={run_dir!r} holds no run to continue (no {found.config.name} there); "
                          "give the directory of the run to resume")
    return None


def _restart_overrides() -> list[str]:
    """Under `torchrun --max-restarts`, a relaunched incarnation continues the run an earlier one claimed
    (`runtime/elastic.py`); nothing otherwise."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):  # not under torchrun: nothing to continue
        return []
    # here, not at the top: torch.distributed takes seconds to import, and a config mistake is named before that
    from dflash_trainer.runtime.elastic import continuation, set_aside_summary, this_incarnation

    incarnation = this_incarnation()
    found = incarnation.earlier_run_dir() if incarnation is not None else None
    if found is None:
        return []
    incarnation.check_continues(found)
    extra = continuation(found)
    if os.environ.get("RANK", "0") == "0":
        set_aside_summary(incarnation, found)
        how = "from its newest checkpoint" if "train.resume=latest" in extra else "from the start (no checkpoint yet)"
        print(f"dflash-train train: torchrun restarted the job (incarnation {incarnation.number}): continuing {found} "
              f"{how}", file=sys.stderr)
    return extra


def _resume_config(args: argparse.Namespace, overrides: list[str], run_dir: Path) -> Config:
    """The run's own config with the changes a resume may make (`resume.py`); says what it applied and what of
    `--config` it did not."""
    resumed = resumed_config(run_dir, overrides, args.config)
    args.resume_changes = resumed.changes
    if os.environ.get("RANK", "0") != "0":  # under torchrun every rank resolves the config; rank 0 says so
        return resumed.config
    print(f"dflash-train train: resuming {run_dir} with its own config ({RunDir(run_dir).config})", file=sys.stderr)
    for change in resumed.changes:
        print(f"  changed on resume: {change}", file=sys.stderr)
    if resumed.recipe_not_applied:
        shown, more = resumed.recipe_not_applied[:8], len(resumed.recipe_not_applied) - 8
        print(f"  --config {args.config} is not applied on resume; the run keeps its own "
              f"{', '.join(f'{c.key}={c.old!r} (the recipe: {c.new!r})' for c in shown)}"
              f"{f' and {more} more' if more > 0 else ''}; to change one a resume may change, pass it as an "
              "override (section.key=value)", file=sys.stderr)
    if resumed.recipe_problem:
        print(f"  --config {args.config} is not applied on resume, and could not be read to compare: "
              f"{resumed.recipe_problem}", file=sys.stderr)
    return resumed.config


REQUIRED_INPUTS = {"eval": (("drafter", "--drafter DIR (a directory written by `dflash-train export`, "
                                       "RUN_DIR/export, RUN_DIR/best, or a checkpoint RUN_DIR/checkpoints/step_N)"),),
                   "export": (("checkpoint", "--checkpoint CHECKPOINT_DIR (RUN_DIR/checkpoints/step_N)"),
                              ("out", "--out DIR"))}
"""What a command cannot run without, named before its config (whose run is found from them) is read."""


def _check_inputs_given(args: argparse.Namespace) -> None:
    missing = [text for name, text in REQUIRED_INPUTS.get(args.command, ()) if not getattr(args, name, None)]
    if missing:
        raise ConfigError(f"dflash-train {args.command} needs {' and '.join(missing)}")
    flag = {"eval": "--drafter", "export": "--checkpoint"}.get(args.command)
    given = getattr(args, flag[2:], None) if flag else None
    if given and (problem := run_dir_given(flag, given, checkpoints_only=args.command == "export")):
        raise ConfigError(problem)


def _config(args: argparse.Namespace, overrides: list[str]) -> Config | None:
    """The command's config: none for `report` (it reads everything from its run directory)."""
    if args.command == "report":
        return None
    if (run_dir := _resumed_run(args, overrides)) is not None:
        return _resume_config(args, overrides, run_dir)
    _check_inputs_given(args)
    recipe, found = _run_config(args)
    try:
        return load_config(recipe, found + overrides)
    except ConfigError as e:
        if recipe is None and args.command in ("eval", "export"):
            given = "--drafter" if args.command == "eval" else "--checkpoint"
            path = getattr(args, given[2:])
            if path and (problem := input_dir_problem(given, path)):  # no run around a path that is not there
                # a config naming no target is a consequence of the missing folder, not a second mistake
                raise ConfigError(problem if str(e) == NO_TARGET else f"{problem}; and {e}") from None
            raise ConfigError(f"{e}; or pass --config RUN_DIR/config.yaml, the config of the run that trained it "
                              f"(none was found: {given} is not inside a run directory)") from None
        raise


def _runs_on_cpu(config: Config) -> bool:
    if config.run.device == "cpu":
        return True
    if config.run.device == "cuda":
        return False
    import torch  # auto: the command's device; the command imports torch next anyway

    return not torch.cuda.is_available()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # our INFO lines; other libraries' warnings only (torch logs its FakeTensor cache statistics at INFO on exit)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("dflash_trainer").setLevel(logging.INFO)
    overrides = list(args.overrides)
    if getattr(args, "resume", False):
        overrides.append("train.resume=latest")
    if getattr(args, "overwrite", False):
        overrides.append("train.overwrite=true")
    try:
        if args.command == "train":
            overrides += _restart_overrides()
        config = _config(args, overrides)
        if config is not None and _runs_on_cpu(config):
            set_cpu_threads(config.run.cpu_threads)
        try:
            module = importlib.import_module(f"dflash_trainer.commands.{args.command}")
        except ModuleNotFoundError as e:
            if e.name != f"dflash_trainer.commands.{args.command}":
                raise
            raise NotBuiltYet(f"`dflash-train {args.command}` is not built yet in this version") from None
        return int(module.run(config, args) or 0)
    except (ConfigError, DataError, NotBuiltYet, StorageError) as e:
        if not _tell_other_ranks(args, e):
            print(f"{_rank_label()}dflash-train {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as e:  # the NaN/inf step limit: a data or learning-rate problem, not a bug
        print(f"dflash-train {args.command}: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a command installs its own handling (imports, loading, setup)
        print(f"dflash-train {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except Exception as e:  # a bug: its traceback follows; under torchrun the other ranks stop too
        _tell_other_ranks(args, e)
        raise


def _under_torchrun() -> bool:
    world = os.environ.get("WORLD_SIZE", "1")
    return world.isdigit() and int(world) > 1


def _rank_label() -> str:
    """`[rank R] ` under torchrun, as a rank's failure reads once training started (`runtime/failures.py`)."""
    return f"[rank {os.environ.get('RANK', '0')}] " if _under_torchrun() else ""


def _tell_other_ranks(args: argparse.Namespace, error: BaseException) -> bool:
    """`train` under torchrun, failing before this rank joined the others (its config, its device): record the
    failure where the ranks waiting for it look, so that they stop within seconds, naming it. True when another rank
    recorded this same mistake first (it prints it)."""
    if args.command != "train" or not _under_torchrun():
        return False
    from dflash_trainer.runtime.failures import record_failure_before_join, said_by_another

    return said_by_another(record_failure_before_join(error), int(os.environ.get("RANK", "0")), error)


if __name__ == "__main__":
    raise SystemExit(main())
