"""A job stopped from the TUI (q, y) is recorded as stopped from memtui, not as killed.

memtui installs no SIGTERM handler in the job (issue 27, J4: a Python handler held a job in a
long C call for as long as the call lasted). It sends SIGTERM, knows it did, and once the job
has died of it appends `End(status=stopped)` to each of the job's recordings that lack a final
frame (`memtui/commands/stop_record.py`).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_harness import MEMTUI, scrubbed_env

from memtui.commands.stop_record import record_stop
from memtui.input.job_process import JobProcess
from memtui.model.recording import read_recording
from memtui.model.session import Session
from memtui.reports.report import render_text
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig

HANDLER = """
import signal, sys
import torch
print("handler", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
"""


@pytest.mark.slow
@pytest.mark.parametrize("through", ["script", "command"])
def test_the_job_gets_no_sigterm_handler(tmp_path: Path, through: str) -> None:
    """Under the runner (`memtui run job.py`) and the bootstrap (`-- python job.py`), the job's
    SIGTERM disposition after the agent started is the default one, as without memtui."""
    (tmp_path / "job.py").write_text(HANDLER)
    target = ["job.py"] if through == "script" else ["--", sys.executable, "job.py"]
    result = subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", "rec", *target],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=scrubbed_env(tmp_path / "rt"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["handler", "True"]


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
    code = job.wait()
    assert code == 128 + signal.SIGTERM  # dies of the signal, as without memtui
    assert spec.recording is not None
    path = spec.recording if spec.recording.is_file() else spec.recording / "proc-0.memtui"
    assert read_recording(path).end is None  # the job wrote no final frame: it just died
    assert record_stop(spec.recording, code) == 1  # what `memtui run` does after the job
    recording = read_recording(path)
    ending = recording.end
    assert ending is not None and ending.status == schema.ExitStatus.STOPPED
    assert ending.code == (143 if spec.recording.is_file() else None)
    assert ending.step == recording.steps[-1].step and ending.step >= 3
    assert "stopped from memtui (SIGTERM)" in render_text(recording)
    assert record_stop(spec.recording, code) == 0  # once: it now has its final frame
