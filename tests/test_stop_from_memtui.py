"""A job stopped from the TUI (q, y) is recorded as stopped from memtui, not as killed.

memtui creates the job's stop file (`AgentConfig.stop_file`, in the private runtime folder),
then sends SIGTERM; the runner's handler sees the file, writes `End(status=stopped)` and dies of
the signal as the job would have without memtui.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memtui.input.job_process import JobProcess
from memtui.model.recording import read_recording
from memtui.model.session import Session
from memtui.reports.report import render_text
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig


def test_memtui_creates_the_stop_file_before_its_sigterm(tmp_path: Path) -> None:
    stop_file = tmp_path / "rt" / "stop-x"
    job_code = textwrap.dedent(f"""
        import os, signal, sys, time
        seen = lambda *a: sys.exit(0 if os.path.exists({str(stop_file)!r}) else 5)
        signal.signal(signal.SIGTERM, seen)
        print("ready", flush=True)
        time.sleep(30)
    """)
    env = dict(
        os.environ,
        MEMTUI_RUNTIME_DIR=str(tmp_path / "rt"),
        **AgentConfig(stop_file=str(stop_file)).to_env(),
    )
    job = JobProcess([sys.executable, "-c", job_code], env, None)
    deadline = time.monotonic() + 30
    while "ready" not in job.lines and time.monotonic() < deadline:
        time.sleep(0.02)
    job.terminate()
    assert job.wait() == 0  # the job saw the file when the signal came
    assert job.stopped and not stop_file.exists()  # and memtui cleans it up


def test_a_stopped_end_reads_stopped_everywhere(builder: object) -> None:
    messages = builder.demo_messages(with_end=False)  # type: ignore[attr-defined]
    end = schema.End(
        time=0.0,
        status=schema.ExitStatus.STOPPED,
        code=143,
        error="stopped from memtui (SIGTERM)",
        step=25,
        phase="forward",
    )
    session = Session(live=False)
    session.ingest([*messages, end])
    assert session.status_text() == "stopped from memtui (SIGTERM) (exit 143) at step 25"
    assert session.recording is not None
    assert "job stopped (exit code 143) at step 25 in forward: stopped from memtui (SIGTERM)" in (
        render_text(session.recording)
    )


TRAIN = """
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(100000):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if step == 2:
        print("ready", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("through", ["script", "command"])
def test_quitting_the_tui_records_a_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, through: str
) -> None:
    """`memtui run train.py` (the runner) and `memtui run -- python train.py` (the bootstrap):
    what the TUI's quit does (stop file, SIGTERM) ends the recording `stopped`."""
    from memtui.commands.run_command import build_job

    monkeypatch.setenv("MEMTUI_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(TRAIN)
    target = ["train.py"] if through == "script" else [sys.executable, "train.py"]
    spec = build_job(target, None, str(tmp_path / "out.memtui"), False, AgentConfig(socket=False))
    job = JobProcess(spec.command, spec.env, None)
    deadline = time.monotonic() + 120
    while "ready" not in job.lines and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "ready" in job.lines, list(job.lines)
    job.terminate()
    assert job.wait() == 128 + signal.SIGTERM  # dies of the signal, as without memtui
    assert spec.recording is not None
    path = spec.recording if spec.recording.is_file() else spec.recording / "proc-0.memtui"
    ending = read_recording(path).end
    assert ending is not None and ending.status == schema.ExitStatus.STOPPED
    assert ending.code == 143 and ending.step is not None and ending.step >= 3
    assert "stopped from memtui (SIGTERM)" in render_text(read_recording(path))
    assert not list((tmp_path / "rt").glob("stop-*"))  # memtui removed its stop file
