"""The repository stands on its own: no file in it cites a document or a path outside it.

The contracts the code relies on live in `docs/` (`docs/design.md` and the pages it links to).
A citation of something the repository does not hold (design notes or a style guide kept beside
the checkout, a shared folder of the machine it was written on) sends a reader nowhere: a clone
has none of it. So every file git would commit is read (`git ls-files`, tracked and new ones),
and each of these is an error:

- the name of a document kept outside (`OUTSIDE_DOCUMENTS`);
- a path into the machine's shared or checkout folders (`MACHINE_PATHS`);
- a relative path that climbs out of the repository from the file that holds it.

Screen captures (`*.svg`) are exempt from the machine paths only: they show a real run's command
line, which names the interpreter it ran, and cite nothing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from repo_paths import REPO

ROOT = REPO

OUTSIDE_DOCUMENTS = ("DESIGN" + ".md", "STYLE" + ".md")
"""Spelled in two parts, so that this file does not cite them either."""
MACHINE_PATHS = re.compile(r"(?<![\w.])(?:\.\./)+shared\b|/work/(?:shared|main|wt|\.library)\b")
"""The shared folder beside the checkout, and the machine's checkout and library folders."""
CLIMBING = re.compile(r"(?<![\w./-])((?:\.\./)+)(?!\.\./)(?=[\w.-])")
"""A relative path that goes up one folder or more; where it lands is checked."""
SKIPPED_FOLDERS = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def repository_files(root: Path) -> list[Path]:
    """The files git would commit: tracked, and new ones it does not ignore. Outside a git
    checkout (a copy of the tree), every file but the tools' caches."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=root,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return sorted(
            path
            for path in root.rglob("*")
            if path.is_file() and not SKIPPED_FOLDERS.intersection(path.relative_to(root).parts)
        )
    names = [name for name in listed.decode("utf-8", "replace").split("\0") if name]
    return sorted(root / name for name in names if (root / name).is_file())


def text_of(path: Path) -> str | None:
    """The file's text; None for a binary file (not UTF-8, or holding a NUL)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return None if "\0" in text else text


def citations_outside(path: Path, root: Path) -> list[str]:
    """Each place in `path` that cites something outside `root`, as `file:line: what`."""
    text = text_of(path)
    if text is None:
        return []
    found = []
    shown = path.relative_to(root)
    for number, line in enumerate(text.splitlines(), start=1):
        for name in OUTSIDE_DOCUMENTS:
            if name in line:
                found.append(f"{shown}:{number}: cites {name}, which is not in the repository")
        machine = MACHINE_PATHS.search(line)
        if machine is not None and path.suffix != ".svg":
            found.append(f"{shown}:{number}: names {machine.group(0)}, outside the repository")
        for climb in CLIMBING.finditer(line):
            landing = (path.parent / climb.group(1)).resolve()
            if landing != root and root not in landing.parents:
                found.append(f"{shown}:{number}: {climb.group(1)} leaves the repository")
    return found


def test_no_file_cites_anything_outside_the_repository() -> None:
    files = repository_files(ROOT)
    assert ROOT / "docs" / "design.md" in files and Path(__file__) in files
    found = [line for path in files for line in citations_outside(path, ROOT)]
    assert found == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("See " + OUTSIDE_DOCUMENTS[0] + ', "Steps".', "cites DESIGN"),
        ("as " + OUTSIDE_DOCUMENTS[1] + " says", "cites STYLE"),
        ("the contracts in ../" + "shared/notes.md", "names ../" + "shared"),
        ("read /work/" + "shared/seeds/memory.md", "names /work/" + "shared"),
        ("[the notes](../../../" + "elsewhere.md)", "leaves the repository"),
    ],
)
def test_a_citation_outside_is_found(tmp_path: Path, text: str, expected: str) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(f"# Page\n\n{text}\n", encoding="utf-8")
    (found,) = citations_outside(tmp_path / "docs" / "page.md", tmp_path)
    assert found.startswith("docs/page.md:3: ") and expected in found


def test_paths_inside_and_paths_that_only_look_alike_are_not_citations(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[the guide](../README.md), [a page](./other.md), a job's /work/job/model.py,\n"
        "a `shared/` folder of the user's cluster, DESIGN notes, ./..., style.md\n",
        encoding="utf-8",
    )
    assert citations_outside(page, tmp_path) == []
    capture = tmp_path / "screen.svg"
    capture.write_text("<text>/work/" + "main/.venv/bin/torchrun</text>\n", encoding="utf-8")
    assert citations_outside(capture, tmp_path) == []
