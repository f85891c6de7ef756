"""Every `dflash-train` command in the README and docs/ is one the CLI takes: its subcommand and options parse, its
`--config` names a shipped recipe (or a placeholder such as my.yaml or a run's config.yaml), and each of its
`section.key=value` overrides names a config key (with a value of the key's type where the page gives a real one)."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from dflash_trainer.cli import parse_args
from dflash_trainer.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"\.\.\.|[A-Z][A-Z_]{2,}")  # `data.path=...`, `RUN_DIR/...`, `DIR`: the reader's own


def documented_commands() -> list[tuple[str, str]]:
    """(page name, command) for each `dflash-train` line of a fenced block, continuation lines joined."""
    found = []
    for page in PAGES:
        blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", page.read_text(), flags=re.S)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" # ")[0].strip()
                if line.startswith("dflash-train ") and "SUBCOMMAND" not in line:
                    found.append((page.name, line))
    return found


def config_key_exists(key: str) -> bool:
    node: object = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return isinstance(node, dict)  # a mapping field (e.g. kernel options): any key below it
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            return False
        field = fields[part]
        node = field.default_factory() if callable(field.default_factory) else field.default  # type: ignore[misc]
        node = type(node) if dataclasses.is_dataclass(node) else node
    return True


COMMANDS = documented_commands()


def test_the_pages_document_commands():
    assert len(COMMANDS) >= 20 and {c.split()[1] for _, c in COMMANDS} >= {"train", "eval", "export", "regenerate"}


@pytest.mark.parametrize("page, command", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_documented_command_parses_and_names_real_keys(page, command):
    args = parse_args(shlex.split(command)[1:])
    recipe = args.config
    if recipe and not (PLACEHOLDER.search(recipe) or recipe.startswith("my") or recipe.endswith("config.yaml")):
        assert (ROOT / recipe).is_file(), f"{page}: {command}: no recipe {recipe}"
    else:
        recipe = "demo"  # the reader's own recipe or run config: the demo's stands in for it
    unknown = [o.split("=")[0] for o in args.overrides if not config_key_exists(o.split("=")[0])]
    assert not unknown, f"{page}: {command}: no such config keys {unknown}"
    real = [o for o in args.overrides if not PLACEHOLDER.search(o.split("=", 1)[1])]
    load_config(recipe, real)  # the values the page gives are of the keys' types and pass validation
