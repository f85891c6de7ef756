"""The documentation: the generated configuration reference matches the config classes, and every relative link
in README.md and docs/*.md reaches a file (and a heading, for a link with an anchor into a Markdown file)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _generator():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "scripts" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_regenerated(tmp_path):
    """A config field added, removed or re-documented without regenerating the page fails here."""
    generator = _generator()
    out = tmp_path / "configuration.md"
    assert generator.main(["--out", str(out)]) == 0
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert out.read_text(encoding="utf-8") == committed, (
        f"docs/configuration.md is out of date with the config classes: run `{generator.COMMAND}` and commit it")
    assert generator.main(["--check", "--out", str(ROOT / "docs" / "configuration.md")]) == 0


def test_configuration_reference_lists_every_field_with_its_docstring():
    """Every leaf of Config's tree is a row with its default and the docstring under the field in the source."""
    from dflash_trainer.config import Config
    from dflash_trainer.drafter.config import DrafterConfig

    generator = _generator()
    rows = {key: (kind, default, doc) for key, kind, default, doc in generator.rows(Config, "")}

    def leaves(cls, prefix):
        for field in dataclasses.fields(cls):
            default = field.default_factory() if field.default is dataclasses.MISSING else field.default
            if dataclasses.is_dataclass(default):
                yield from leaves(type(default), f"{prefix}{field.name}.")
            else:
                yield f"{prefix}{field.name}"

    assert set(leaves(Config, "")) <= set(rows)
    assert rows["train.betas"][1] == "[0.9, 0.95]"
    assert rows["data.sources[].weight"][:2] == ("float", "1.0")
    assert rows["run.seed"][2] == ""  # a field without a docstring gets an empty description
    source = (ROOT / "src" / "dflash_trainer" / "drafter" / "config.py").read_text()
    variant_doc = source.split('variant: str = "dflash"\n', 1)[1].split('"""')[1]
    assert rows["drafter.variant"] == ("str", '"dflash"', " ".join(variant_doc.split()))
    assert DrafterConfig().variant == "dflash"


def test_check_names_the_command_when_the_page_is_stale(tmp_path, capsys):
    generator = _generator()
    stale = tmp_path / "configuration.md"
    stale.write_text("# an older page\n")
    assert generator.main(["--check", "--out", str(stale)]) == 1
    assert "run `python scripts/config_reference.py`" in capsys.readouterr().err


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6} (.+)", line)
        if match:
            slug = _slug(match.group(1))
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text.replace("[`", "[").replace("`]", "]"))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            yield target


def test_slug_follows_github():
    assert _slug("Serving (vLLM and SGLang)") == "serving-vllm-and-sglang"
    assert _slug("DFlash2 drafters (`drafter.variant: dflash2`)") == "dflash2-drafters-draftervariant-dflash2"
    assert _slug("5. Drafter quality on the practice target") == "5-drafter-quality-on-the-practice-target"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_relative_links_reach_a_file_and_heading(page):
    broken = []
    links = list(_links(page))
    for target in links:
        path_text, _, anchor = target.partition("#")
        path = (page.parent / path_text).resolve() if path_text else page
        if not path.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)
    if page.name == "README.md":
        assert len(links) > 10  # the README is mostly links into docs/ and bench/RESULTS.md


def test_readme_links_every_docs_page():
    """A page in docs/ that the README does not link is one a newcomer never finds."""
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in _links(ROOT / "README.md")}
    orphans = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert not orphans, f"README.md links no docs/ page named {orphans}: add it to the Documentation table"
