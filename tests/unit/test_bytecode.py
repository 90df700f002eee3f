"""The launcher writes the bytecode cache of memtui's packages (memtui/commands/bytecode.py)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from memtui.commands.bytecode import package_folders, write_bytecode


def _package(root: Path) -> Path:
    folder = root / "pkg"
    (folder / "sub").mkdir(parents=True)
    (folder / "__init__.py").write_text("VALUE = 1\n")
    (folder / "sub" / "mod.py").write_text("def f():\n    return 2\n")
    return folder


def _cache(source: Path) -> Path:
    return Path(importlib.util.cache_from_source(str(source)))


def test_the_cache_is_written_even_where_python_would_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE=1
    folder = _package(tmp_path)
    assert write_bytecode([folder])
    for source in (folder / "__init__.py", folder / "sub" / "mod.py"):
        assert _cache(source).is_file()


def test_a_stale_cache_is_rewritten_and_a_fresh_one_kept(tmp_path: Path) -> None:
    folder = _package(tmp_path)
    source = folder / "__init__.py"
    write_bytecode([folder])
    cached = _cache(source)
    first = cached.stat().st_mtime_ns
    assert write_bytecode([folder])
    assert cached.stat().st_mtime_ns == first  # up to date: not written again
    source.write_text("VALUE = 22\n")
    os.utime(source, ns=(first + 5 * 10**9, first + 5 * 10**9))
    assert write_bytecode([folder])
    assert cached.stat().st_mtime_ns != first


def test_a_folder_it_cannot_write_is_left_alone(tmp_path: Path) -> None:
    # A file where the cache folder would go fails as a read-only install does, even for root.
    folder = _package(tmp_path)
    (folder / "__pycache__").write_text("not a folder")
    assert write_bytecode([folder]) is False
    assert (folder / "__pycache__").read_text() == "not a folder"


def test_the_packages_are_memtuis_own() -> None:
    import memtui
    import memtui_agent
    import memtui_protocol

    assert package_folders() == [
        Path(memtui_protocol.__file__).parent,
        Path(memtui_agent.__file__).parent,
        Path(memtui.__file__).parent,
    ]
