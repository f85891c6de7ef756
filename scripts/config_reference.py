"""Writes docs/configuration.md, the configuration reference, from the typed config classes themselves.

Every key of `dflash_trainer.config.Config`'s dataclass tree gets a row: its dotted name, its type as the source
writes it, its default, and the attribute docstring that follows the field in the class body (read with `ast` from
the module's source; a field without one gets an empty description). The classes are the one source, so the page
cannot drift: tests/test_docs.py regenerates it and compares it with the committed file.

    python scripts/config_reference.py               # rewrite docs/configuration.md
    python scripts/config_reference.py --check       # exit 1, naming this command, when the page is stale
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import typing
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
COMMAND = "python scripts/config_reference.py"

INTRO = f"""# Configuration reference

A run is a YAML recipe in `configs/` plus dotted overrides (`section.key=value` on the command line, e.g.
`dflash-train train --config configs/demo.yaml train.lr=1e-3`). Each component owns a typed section with defaults
and validation (`__post_init__`), next to its code; the table below names the class and file of each. Unknown
keys, wrong types and impossible values are errors that name the key (with a "did you mean" for a near miss).

This page is generated from those classes' fields and the docstring under each field; do not edit it by hand.
After changing a config class run `{COMMAND}` (tests/test_docs.py fails until the page matches).
"""


@lru_cache(maxsize=None)
def _module_tree(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"))


def field_docstrings(cls: type) -> dict[str, str]:
    """The string literal that follows each annotated field in `cls`'s body, by field name."""
    tree = _module_tree(inspect.getsourcefile(cls))
    body = next((node.body for node in ast.walk(tree)
                 if isinstance(node, ast.ClassDef) and node.name == cls.__name__), None)
    if body is None:
        raise LookupError(f"class {cls.__name__} not found in {inspect.getsourcefile(cls)}")
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


def _default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _shown(value: object) -> str:
    """A default as a YAML recipe writes it (null, true, "text", [1, 2])."""
    if value is dataclasses.MISSING:
        return "(required)"
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _list_item_class(cls: type, name: str) -> type | None:
    """The dataclass of a `list[SomeConfig]` field (each entry documented as `key[].field`), else None."""
    hint = typing.get_type_hints(cls).get(name)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if dataclasses.is_dataclass(item):
            return item
    return None


def rows(cls: type, prefix: str) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every leaf field of `cls`, nested sections flattened."""
    docs = field_docstrings(cls)
    out = []
    for field in dataclasses.fields(cls):
        key = f"{prefix}{field.name}"
        default = _default(field)
        type_text = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        if dataclasses.is_dataclass(default):
            out += rows(type(default), key + ".")
            continue
        out.append((key, type_text, _shown(default), docs.get(field.name, "")))
        item = _list_item_class(cls, field.name)
        if item is not None:
            out += rows(item, key + "[].")
    return out


def _cell(text: str, code: bool = False) -> str:
    """Table-safe text: pipes escaped; outside code spans `<` and `>` too, which would otherwise read as HTML."""
    text = text.replace("|", "\\|")
    if code:
        return text
    pieces = text.split("`")
    pieces[::2] = [piece.replace("<", "&lt;").replace(">", "&gt;") for piece in pieces[::2]]
    return "`".join(pieces)


def render() -> str:
    """The whole page, one table per top-level section of `Config`."""
    import dflash_trainer
    from dflash_trainer.config import Config

    checkout = Path(dflash_trainer.__file__).resolve().parents[2]  # src/dflash_trainer/__init__.py -> the checkout

    parts = [INTRO.strip()]
    index = ["| section | class | defined in |", "|---|---|---|"]
    tables = []
    for field in dataclasses.fields(Config):
        section = type(_default(field))
        source = Path(inspect.getsourcefile(section)).resolve().relative_to(checkout).as_posix()
        index.append(f"| [`{field.name}`](#{field.name}) | `{section.__name__}` | [`{source}`](../{source}) |")
        table = [f"## {field.name}", "", f"`{section.__name__}` in [`{source}`](../{source}).", "",
                 "| key | type | default | description |", "|---|---|---|---|"]
        for key, type_text, default, doc in rows(section, field.name + "."):
            table.append(f"| `{key}` | `{_cell(type_text, code=True)}` | `{_cell(default, code=True)}` | {_cell(doc)} |")
        tables.append("\n".join(table))
    parts.append("\n".join(index))
    parts += tables
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PAGE, help="where to write the page (default docs/configuration.md)")
    parser.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text(encoding="utf-8") != page:
            print(f"{args.out} is out of date with the config classes: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    sys.exit(main())
