"""`memtui attach PID` refused by the kernel or by ownership, on real processes: pid 1 of this
machine and a child that has exited (a child of another user: test_attach.py). Each refusal is
one line naming its cause; the sysctl hint appears only where Yama exists and forbids the trace."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from cli_harness import run_memtui, scrubbed_env

from memtui.commands.attach_target import CAP_SYS_PTRACE, has_capability, ptrace_scope

pytestmark = pytest.mark.slow  # each test starts memtui in a fresh interpreter


def attach(pid: int, tmp_path: Path) -> str:
    result = run_memtui(
        "attach", str(pid), "--headless", "-o", str(tmp_path / "x.memtui"),
        env=scrubbed_env(tmp_path / "rt"),
    )  # fmt: skip
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memtui: cannot attach: "), result.stderr
    return lines[0]


def yama_forbids() -> bool:
    return ptrace_scope() in (1, 2, 3) and not has_capability(
        CAP_SYS_PTRACE, Path("/proc/self/status")
    )


def test_pid_1_names_its_cause_and_no_sysctl_that_does_not_apply(tmp_path: Path) -> None:
    line = attach(1, tmp_path)
    if not yama_forbids():
        assert "sysctl" not in line, line
    if os.stat("/proc/1").st_uid != os.getuid():
        assert "process 1 belongs to " in line


def test_a_process_that_has_ended(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    line = attach(child.pid, tmp_path)
    assert f"no process with pid {child.pid}" in line
