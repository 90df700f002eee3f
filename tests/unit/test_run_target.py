"""`memtui run TARGET`: a target that cannot run is one line saying what is wrong with it (a
folder, a file that is neither a Python script nor an executable), never "command not found"
for a path that exists; what runs today still runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memtui.commands.run_command import UsageError, build_job


def refusal(target: list[str]) -> str:
    with pytest.raises(UsageError) as caught:
        build_job(target, None, None, no_record=True)
    return str(caught.value)


def test_a_folder_is_named_as_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "somedir").mkdir()
    assert refusal(["somedir"]) == "somedir is a directory: give the training script inside it"
    assert refusal(["somedir/"]).startswith("somedir/ is a directory")


def test_a_file_that_is_no_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("hi\n")
    line = refusal(["notes.txt"])
    assert line.startswith("notes.txt is neither a Python script (.py) nor an executable")
    assert "command not found" not in line and "\n" not in line


def test_an_executable_off_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\necho ran\n")
    tool.chmod(0o755)
    assert refusal(["tool"]) == "tool is not on PATH: give it as ./tool"
    assert build_job(["./tool"], None, None, no_record=True).command == ["./tool"]


def test_what_runs_still_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    assert build_job(["train.py"], None, None, no_record=True).display == ["python", "train.py"]
    assert build_job([sys.executable, "train.py"], None, None, no_record=True).command == [
        sys.executable,
        "train.py",
    ]
    assert build_job(["sh", "-c", "true"], None, None, no_record=True).command[0] == "sh"
    assert build_job([], "json.tool", None, no_record=True).display[:3] == [
        "python",
        "-m",
        "json.tool",
    ]
    assert refusal(["no-such-command-here"]) == "command not found: no-such-command-here"
