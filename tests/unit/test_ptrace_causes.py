"""Why the kernel refused an attach, told apart (`ptrace_denied`): the sysctl hint only where
Yama exists and forbids the trace (with its value), another user's process by name, a process
holding capabilities memtui lacks, a container without CAP_SYS_PTRACE; read from status files
shaped as /proc's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import memtui.commands.attach_target as attach_target
from memtui.commands.attach_target import ptrace_denied

PTRACE = 1 << 19
RESOURCE = 1 << 24


def status(folder: Path, name: str, uid: int, permitted: int, effective: int | None = None) -> Path:
    path = folder / name
    path.write_text(
        f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nCapPrm:\t{permitted:016x}\n"
        f"CapEff:\t{permitted if effective is None else effective:016x}\n"
    )
    return path


@pytest.fixture(autouse=True)
def outside_containers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(attach_target, "CONTAINER_MARKERS", (tmp_path / "no-dockerenv",))


def test_the_sysctl_only_where_yama_forbids_it(tmp_path: Path) -> None:
    scope = tmp_path / "ptrace_scope"
    own = status(tmp_path, "own", os.getuid(), 0)
    target = status(tmp_path, "target", os.getuid(), 0)
    scope.write_text("1\n")
    line = ptrace_denied(7, scope, own, target)
    assert "kernel.yama.ptrace_scope=1: a process may trace only its own descendants" in line
    assert "sudo sysctl kernel.yama.ptrace_scope=0" in line
    for absent in (tmp_path / "no-yama", scope):
        scope.write_text("0\n")
        line = ptrace_denied(7, absent, own, target)
        assert "sysctl" not in line and "although it is yours" in line, line


def test_another_users_process_is_named_with_its_owner(tmp_path: Path) -> None:
    own = status(tmp_path, "own", os.getuid(), PTRACE)
    target = status(tmp_path, "target", os.getuid() + 1, 0)
    line = ptrace_denied(1, tmp_path / "no-yama", own, target)
    assert line.startswith("process 1 belongs to ") and "attaches to your own processes" in line
    assert "sysctl" not in line


def test_capabilities_memtui_lacks_are_named(tmp_path: Path) -> None:
    own = status(tmp_path, "own", os.getuid(), 0)
    target = status(tmp_path, "target", os.getuid(), RESOURCE)
    line = ptrace_denied(1, tmp_path / "no-yama", own, target)
    assert "process 1 holds capabilities memtui lacks (cap_sys_resource)" in line
    assert "CAP_SYS_PTRACE" in line and "sysctl" not in line
    with_ptrace = status(tmp_path, "own2", os.getuid(), PTRACE)
    line = ptrace_denied(1, tmp_path / "no-yama", with_ptrace, target)
    assert "although it is yours" in line and "(cap_sys_resource)" in line


def test_a_container_without_cap_sys_ptrace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / ".dockerenv"
    marker.touch()
    monkeypatch.setattr(attach_target, "CONTAINER_MARKERS", (marker,))
    own = status(tmp_path, "own", os.getuid(), 0)
    target = status(tmp_path, "target", os.getuid(), 0)
    line = ptrace_denied(9, tmp_path / "no-yama", own, target)
    assert "this container has no CAP_SYS_PTRACE" in line and "--cap-add=SYS_PTRACE" in line
    assert "sysctl" not in line


def test_no_such_process(tmp_path: Path) -> None:
    own = status(tmp_path, "own", os.getuid(), 0)
    line = ptrace_denied(9, tmp_path / "no-yama", own, tmp_path / "gone")
    assert line == "no process with pid 9 (it has ended?)"
