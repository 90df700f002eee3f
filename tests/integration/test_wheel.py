"""The built wheel ships every subpackage under its installed name (and no bare `agent`)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from repo_paths import REPO

pytestmark = pytest.mark.slow  # every test here starts a torch job in a fresh interpreter

ROOT = REPO


def _source_packages() -> set[str]:
    """Every folder with an `__init__.py` under the four packages, by import name (the folder
    path below `memtui/`, `agent/`, `protocol/` or `pytest_plugin/` is the import path)."""
    found = set()
    for top in (
        "memtui",
        "agent/memtui_agent",
        "protocol/memtui_protocol",
        "pytest_plugin/memtui_pytest",
    ):
        for init in (ROOT / top).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / top).parts
            found.add(".".join([top.split("/")[-1], *relative]))
    return found


def test_wheel_contains_every_subpackage(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    wheel = next(tmp_path.glob("memtui-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    packages = {
        name.rsplit("/", 1)[0].replace("/", ".") for name in names if name.endswith("__init__.py")
    }
    expected = _source_packages()
    assert expected <= packages, expected - packages
    assert "memtui_agent/startup/bootstrap/sitecustomize.py" in names
    assert not any(name.startswith("agent/") for name in names)
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    declared = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "memtui = memtui.commands.cli:main" in declared
    assert "[pytest11]\nmemtui = memtui_pytest.plugin" in declared  # `pytest --memtui`
