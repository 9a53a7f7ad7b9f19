"""The docs cannot drift from the code or from each other: docs/cli.md and docs/config.md are what
docs/reference.py generates from the parser and the config classes now, every page of docs/ is in the index,
every relative link of README.md and docs/*.md resolves (to a heading, where it names an anchor), and the
README stays a page a newcomer reads (≤ 250 lines, its test command what CI runs)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import reference  # noqa: E402  (docs/reference.py, not a package)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.S)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    become hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = CODE.sub("", page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for line in text.splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = _anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def _links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", CODE.sub("", page.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: left alone


@pytest.mark.parametrize("name", sorted(reference.PAGES))
def test_generated_reference_equals_the_code(name):
    page = ROOT / "docs" / name
    assert page.read_text(encoding="utf-8") == reference.render(name), \
        f"docs/{name} is stale: run `python docs/reference.py`"


def test_check_names_a_stale_page_in_one_line(tmp_path, monkeypatch):
    """--check fails in one line naming the page when a page differs from the code; passes when it does not."""
    monkeypatch.setattr(reference, "DOCS", tmp_path)
    (tmp_path / "templates").mkdir()
    for name in reference.PAGES:
        (tmp_path / "templates" / name).write_text((ROOT / "docs" / "templates" / name).read_text())
    assert reference.main([]) == 0 and reference.main(["--check"]) == 0
    (tmp_path / "config.md").write_text((tmp_path / "config.md").read_text().replace("| `rounds` | int | `2`",
                                                                                     "| `rounds` | int | `3`"))
    proc = subprocess.run([sys.executable, "-c", "import sys, reference, pathlib; "
                           f"reference.DOCS = pathlib.Path({str(tmp_path)!r}); sys.exit(reference.main(['--check']))"],
                          cwd=ROOT / "docs", capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "docs/config.md" in proc.stderr
    assert "cli.md" not in proc.stderr


def test_config_page_lists_every_field_and_its_toml_is_the_defaults():
    from flows.config import RunConfig

    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    for path, table in reference._rows(RunConfig):
        assert f"### `{path or 'top level'}`" in text
        assert all(row in text for row in table)
    toml = text.split("```toml\n")[1].split("```")[0]
    assert RunConfig().model_dump() == RunConfig.model_validate(tomllib.loads(toml)).model_dump()


def test_cli_page_lists_every_command_and_option():
    from flows.cli.parser import build_parser

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    for name, (_, sub) in reference._subcommands(build_parser()).items():
        assert f"### refinery {name}" in text
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}" in text or f", {flag}" in text, (name, flag)


def test_every_page_of_docs_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    listed = {t.split("#")[0] for t in _links(ROOT / "docs" / "README.md")}
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md" and p.name not in listed]
    assert not missing, f"docs/README.md does not list {missing}"
    assert index


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_readme_is_a_page_and_runs_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    runs = [line.strip() for line in ci.splitlines() if line.strip().startswith("make ")]
    assert runs and all(f"`{cmd}`" in readme or f"\n{cmd}" in readme for cmd in runs), runs


def test_link_check_can_fail(tmp_path):
    """The checker itself: a missing file and a missing heading are both caught."""
    (tmp_path / "a.md").write_text("# Title\n\n[ok](#title) [bad](#nope) [gone](b.md) `[not](c.md)`\n")
    assert _links(tmp_path / "a.md") == ["#title", "#nope", "b.md"]
    assert _anchors(tmp_path / "a.md") == {"title"}
    assert _anchor("§1 EPS: prompt utility and buckets") == "1-eps-prompt-utility-and-buckets"
