"""The package's layers: no module imports a higher layer, and the packages import each other without a circle.

data < transport < target < drafter < eval < train < regen, report < synth, runtime < commands < cli. Below them all: the error
types, the test fault hooks, the run directory on disk (`rundir.py`), reading our own files back (`readback.py`), and the configuration (each component's config section, and the root `config.py`
that assembles them): any layer may read its config. Function-level imports count as much as top-level ones.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "dflash_trainer"

LAYERS = {
    "base": 0,  # errors, faults, config, rundir (the run dir on disk), readback (reading our own files back), resume (a resumed run's config), hub (an unreachable hub), memory (free memory of a device), the *.config sections
    "data": 1, "transport": 2, "target": 3, "drafter": 4, "eval": 5, "train": 6, "regen": 7, "report": 7,
    "synth": 8, "runtime": 8, "commands": 9, "cli": 10, "__main__": 11,
}
BASE = {"errors", "faults", "config", "rundir", "readback", "resume", "hub", "memory", "__init__"}


def _unit(module: str) -> str:
    """The layer unit of a module name `dflash_trainer.a.b`: its package, or `base`."""
    parts = module.split(".")[1:]
    if not parts:
        return "base"
    if parts[0] in BASE or (len(parts) == 2 and parts[1] == "config"):
        return "base"
    return parts[0]


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(("dflash_trainer", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def _imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports; `from package import submodule` counts as the submodule."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                       for n in ast.walk(block)}  # `if TYPE_CHECKING:` imports never run
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash_trainer"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules
                edges[module].update(subs or {node.module})
            elif isinstance(node, ast.Import):
                edges[module].update(a.name for a in node.names if a.name.startswith("dflash_trainer"))
    return edges


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _first_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (a path that ends where it starts), or None."""
    seen: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node):] + [node]
        if node in seen:
            return None
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            circle = visit(nxt)
            if circle:
                return circle
        stack.pop()
        seen.add(node)
        return None

    for node in sorted(graph):
        circle = visit(node)
        if circle:
            return circle
    return None


def test_no_import_runs_up_a_layer():
    upward = []
    for module, targets in sorted(_imports().items()):
        for target in sorted(targets):
            a, b = _unit(module), _unit(target)
            if a != b and LAYERS[b] >= LAYERS[a]:
                upward.append(f"{module} -> {target} ({a}, layer {LAYERS[a]}, imports {b}, layer {LAYERS[b]})")
    assert not upward, "\n".join(upward)


def test_packages_import_each_other_without_a_circle():
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in _imports().items():
        for target in targets:
            if _unit(module) != _unit(target):
                graph[_unit(module)].add(_unit(target))
    circle = _first_circle(graph)
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_modules_import_each_other_without_a_circle():
    """Inside a package too (function-level imports included): a module pair that imports each other."""
    graph = {m: {t for t in targets if t != m} for m, targets in _imports().items()}
    circle = _first_circle(graph)
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_the_layer_map_names_every_package():
    units = {_unit(".".join(("dflash_trainer", *p.relative_to(PACKAGE).with_suffix("").parts)))
             for p in PACKAGE.rglob("*.py")}
    assert units <= set(LAYERS), units - set(LAYERS)
