"""A job stopped from the TUI (q, y) is recorded as stopped from memtui, not as killed.

memtui creates the job's stop file (`AgentConfig.stop_file`, in the private runtime folder),
then sends SIGTERM; the runner's handler sees the file, writes `End(status=stopped)` and dies of
the signal as the job would have without memtui.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memtui.job_process import JobProcess
from memtui.recording import read_recording
from memtui.report import render_text
from memtui.session import Session
from memtui_agent import schema
from memtui_agent.config import AgentConfig


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


@pytest.mark.slow
def test_the_runner_records_a_stop_from_memtui(tmp_path: Path) -> None:
    """A real torch job under the runner: SIGTERM with the stop file -> End(status=stopped)."""
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
            import torch
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(100000):
                opt.zero_grad()
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                if step == 2:
                    print("ready", flush=True)
        """)
    )
    recording = tmp_path / "run.memtui"
    stop_file = tmp_path / "rt" / "stop-test"
    config = AgentConfig(record=str(recording), socket=False, stop_file=str(stop_file))
    env = dict(os.environ, MEMTUI_RUNTIME_DIR=str(tmp_path / "rt"), **config.to_env())
    job = subprocess.Popen(
        [sys.executable, "-m", "memtui_agent.runner", str(script)],
        env=env, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert job.stdout is not None and job.stdout.readline().strip() == "ready"
    stop_file.parent.mkdir(mode=0o700, exist_ok=True)
    stop_file.touch()
    job.send_signal(signal.SIGTERM)
    assert job.wait(timeout=60) == -signal.SIGTERM  # dies of the signal, as without memtui
    ending = read_recording(recording).end
    assert ending is not None and ending.status == schema.ExitStatus.STOPPED
    assert ending.code == 143 and ending.step is not None and ending.step >= 3
    assert not stop_file.exists()
