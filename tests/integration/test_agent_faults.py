"""The agent's own failures stay contained: reported once, the failing part off, the job intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from memtui.model.recording import read_recording
from memtui_agent.steps.failures import is_oom
from memtui_protocol import runtime_dir

pytestmark = pytest.mark.slow  # each test starts a torch job or two

BROKEN_PACK = """
import torch, memtui_agent, memtui_agent.memory.ledger as ledger
def explode(*args):
    raise RuntimeError("injected ledger failure")
ledger.Ledger.acquire_activation = explode
torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
print("FINAL", float(sum(p.sum() for p in model.parameters())))
"""

UNWRITABLE = """
import torch, memtui_agent

with memtui_agent.monitor(record="no/such/folder/rec.memtui", socket=False):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
print("JOB DONE")
"""


def _run(run_python: Any, tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    result: subprocess.CompletedProcess[str] = run_python(source)
    return result


def test_failing_hook_is_reported_once_and_switched_off(tmp_path: Path, run_python: Any) -> None:
    # A fresh interpreter (`run_python`): the job breaks the agent's Ledger class for good.
    result = _run(run_python, tmp_path, BROKEN_PACK)
    assert result.returncode == 0, result.stderr
    assert "FINAL" in result.stdout
    reports = [line for line in result.stderr.splitlines() if "injected ledger failure" in line]
    assert len(reports) == 1
    assert "hook:pack" in reports[0] and "the job continues" in reports[0]
    recording = read_recording(tmp_path / "rec.memtui")
    assert [error.component for error in recording.agent_errors] == ["hook:pack"]
    assert len(recording.steps) == 3
    assert all(step.max.activations == 0 for step in recording.steps)
    assert recording.steps[-1].end.weights == (8 * 8 + 8 + 8 + 1) * 4


def test_unwritable_recording_leaves_the_job_running(tmp_path: Path, shared_python: Any) -> None:
    result = _run(shared_python, tmp_path, UNWRITABLE)
    assert result.returncode == 0, result.stderr
    assert "JOB DONE" in result.stdout
    lines = [line for line in result.stderr.splitlines() if "recording failed" in line]
    assert len(lines) == 1


def test_stale_sidecar_is_ignored_and_removed(tmp_path: Path) -> None:
    directory = runtime_dir.ensure_private_dir(tmp_path / "rt")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale_socket = directory / f"{dead.pid}.sock"
    stale_socket.write_text("")
    runtime_dir.write_sidecar(
        directory, str(dead.pid), runtime_dir.Sidecar(pid=dead.pid, socket=str(stale_socket))
    )
    runtime_dir.write_sidecar(
        directory,
        str(os.getpid()),
        runtime_dir.Sidecar(
            pid=os.getpid(), socket=str(directory / "me.sock"), started_unix=time.time()
        ),
    )
    live = runtime_dir.live_sidecars(directory)
    assert [job["pid"] for job in live] == [os.getpid()]
    assert not (directory / f"{dead.pid}.json").exists()
    assert not stale_socket.exists()
    assert json.loads((directory / f"{os.getpid()}.json").read_text())["pid"] == os.getpid()


def test_runtime_dir_refuses_unsafe_folders(tmp_path: Path) -> None:
    import pytest

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(runtime_dir.RuntimeDirError, match="accessible to other users"):
        runtime_dir.ensure_private_dir(loose)
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(runtime_dir.RuntimeDirError, match="not a plain directory"):
        runtime_dir.ensure_private_dir(link)


def test_oom_recognition_on_cuda_and_cpu_messages() -> None:
    class OutOfMemoryError(RuntimeError):
        """Stands in for torch.OutOfMemoryError, matched by name as on a CUDA build."""

    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 4611686018427387904 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert is_oom(cpu)
    assert is_oom(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom(ValueError("out of memory"))


UNSTOPPED = """
import sys, torch, memtui_agent
memtui_agent.start(record="rec.memtui", socket=False)
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
if sys.argv[1] == "raise":
    raise RuntimeError("the script failed")
"""


def test_an_agent_started_by_hand_and_never_stopped_still_ends_its_recording(
    tmp_path: Path, run_python: Any
) -> None:
    # `start()` without `stop()`: at interpreter exit the agent finishes itself, so the
    # recording says how the job ended instead of looking like a killed one.
    from memtui.reports.report import build_report

    for how, status in (("return", "ok"), ("raise", "error")):
        done = run_python(UNSTOPPED, how)
        assert done.returncode == (1 if how == "raise" else 0), done.stderr
        report = build_report(read_recording(tmp_path / "rec.memtui"))
        assert report["exit"]["status"] == status, report["exit"]
        assert len(report["steps"]) == 3
        if how == "raise":
            assert "the script failed" in (report["exit"]["error"] or "")
