"""The README and docs/ link to each other: every relative link must reach a file, and every
`#anchor` a heading of that file, or a reader following the user's guide into the docs lands
nowhere. Also: the README's two set-up commands are what users and CI run, so they stay as they
are and `.ci/run` runs the same test command."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
from repo_paths import REPO

ROOT = REPO
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN_THE_DEMO = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    "pip install -e . && memtui demo"
)
PASS_THE_TESTS = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    "pip install -e '.[test]' && python -m pytest -q"
)

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks: a `# comment` or `[x](y)` in code is not markdown."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    kept = []
    for char in text:
        if char in " -_" or unicodedata.category(char)[0] in "LN":
            kept.append(char)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    """Targets of the file's links and images that point inside the repository."""
    targets = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            target = match.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # http:, https:, mailto:
            targets.append(target)
    return targets


def broken_links(path: Path) -> list[str]:
    """Each link of `path` whose file or heading does not exist, with the reason."""
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
        elif anchor and resolved.suffix != ".md":
            broken.append(f"{target}: an anchor into a file that has no headings")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_the_docs_are_reachable_from_the_readme() -> None:
    """A page no link leads to is lost to a reader who starts at the README."""
    linked = {
        (ROOT / t.partition("#")[0]).resolve()
        for t in relative_links(ROOT / "README.md")
        if t.partition("#")[0]
    }
    assert [p.name for p in DOCS[1:] if p.resolve() not in linked] == []


def test_a_broken_file_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\nSee [b](b.md) and [c](c.md).\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# B\n", encoding="utf-8")
    assert [line.split(":")[0] for line in broken_links(tmp_path / "a.md")] == ["c.md"]


def test_a_broken_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "# A\n\n## The screen's model\n\n[here](#the-screens-model), [gone](#the-screen)\n"
        "[there](b.md#memtui-cluster), [not there](b.md#cluster)\n",
        encoding="utf-8",
    )
    (tmp_path / "b.md").write_text("# B\n\n## `memtui cluster`\n", encoding="utf-8")
    assert [line.split(":")[0] for line in broken_links(tmp_path / "a.md")] == [
        "#the-screen",
        "b.md#cluster",
    ]


def test_links_and_headings_in_code_are_not_markdown(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "# A\n\n```\n# not a heading\nmemtui run [-o PATH](x.md)\n```\n"
        "`[y](missing.md)` [ok](#a) [no](#not-a-heading)\n",
        encoding="utf-8",
    )
    assert broken_links(tmp_path / "a.md") == ["#not-a-heading: no heading #not-a-heading in a.md"]


def test_slug_follows_github() -> None:
    assert slug("Leaks: memory that grows, named with what holds it") == (
        "leaks-memory-that-grows-named-with-what-holds-it"
    )
    assert slug("Step time: `benchmarks/activations_cost.py`") == (
        "step-time-benchmarksactivations_costpy"
    )
    assert slug("Beside the piles: allocated, reserved, nvidia-smi") == (
        "beside-the-piles-allocated-reserved-nvidia-smi"
    )


def code_blocks(section: str) -> list[str]:
    """The contents of a markdown section's fenced code blocks, one string each."""
    blocks: list[str] = []
    current: list[str] | None = None
    for line in section.splitlines():
        if _FENCE.match(line):
            if current is None:
                current = []
            else:
                blocks.append("\n".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_the_readme_set_up_is_the_two_commands() -> None:
    """Set-up holds exactly the line that runs the demo and the line that passes the tests."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Set-up\n", 1)[1].split("\n## ", 1)[0]
    assert code_blocks(section) == [RUN_THE_DEMO, PASS_THE_TESTS]


def test_ci_runs_the_readme_test_command() -> None:
    """`.ci/run` installs the same torch and runs the same pytest command as the README."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "python -m pip install -q torch==2.13.0\n" in ci
    assert "python -m pip install -q -e '.[test]'\n" in ci
    assert "\npython -m pytest -q\n" in ci
