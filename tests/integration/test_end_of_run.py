"""The end of a run on the terminal (issue 26): the alerts named by kind with their first step
(headless, after the TUI, `detach`), a failed job's error as Python printed it, and no screen
for a job that never got as far as importing torch.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
from cli_harness import scrubbed_env

from memtui.commands.attach_command import detached_lines
from memtui.commands.job_start import AgentStart, wait_for_agent
from memtui.commands.run_command import JobSpec, summary_line
from memtui.model.alert_summary import alert_tally
from memtui.model.recording import read_recording
from memtui_protocol import schema

_CONSOLE = Path(sys.executable).with_name("memtui")
MEMTUI = [str(_CONSOLE)] if _CONSOLE.exists() else [sys.executable, "-m", "memtui"]


def _alert(kind: str, message: str = "m", group: int | None = None) -> schema.Alert:
    return schema.Alert(kind=kind, message=message, group=group)


def troubled_run(builder: ModuleType) -> list[schema.Message]:
    """The fixture run (a skipped step 9, NaN loss and activations at 17), with the NaN loss
    again on 18 and 19 (follow-on alerts), a budget overrun said early for step 21 and a leak."""
    messages: list[schema.Message] = builder.demo_messages()
    for index, message in enumerate(messages):
        if isinstance(message, schema.Step) and message.step in (18, 19):
            messages[index] = msgspec.structs.replace(
                message,
                loss=float("nan"),
                alerts=[_alert("nonfinite_loss", group=builder.NAN_STEP)],
            )
    over = schema.AlertNow(time=0.0, step=21, alert=_alert("over_budget", "21 GiB > 20 GiB"))
    leak = _alert("leak", "grows 1 MiB a step")
    leak = msgspec.structs.replace(leak, where="history")
    messages.insert(-3, over)  # before step 22: said before its step closed
    messages.insert(-1, schema.AlertNow(time=0.0, step=23, alert=leak))
    return messages


def _write(tmp_path: Path, builder: ModuleType, messages: list[schema.Message]) -> Path:
    path = tmp_path / "run.memtui"
    path.write_bytes(builder.encode_recording(messages))
    return path


def test_the_alerts_line_names_each_kind_from_its_first_step(
    tmp_path: Path, builder: ModuleType
) -> None:
    path = _write(tmp_path, builder, troubled_run(builder))
    recording = read_recording(path)
    total = len(recording.alerts)
    assert total == 8  # first-step growth, skipped, NaN loss x3, activations, budget, leak
    # The errors first (each by its first step), then the warnings: the skipped step of step 9
    # is the fifth kind, counted among the "more kinds".
    assert alert_tally(recording).line(path) == (
        "NaN loss from step 17; NaN/Inf activations at step 17; over budget at step 21; "
        f"leak in history at step 23; 1 more kinds; {total} alerts: memtui report {path}"
    )


def test_a_healthy_runs_notes_are_counted_not_named(tmp_path: Path, builder: ModuleType) -> None:
    messages = [
        message
        if not isinstance(message, schema.Step)
        else msgspec.structs.replace(
            message, loss=1.0, skipped=False, alerts=message.alerts if message.step == 1 else []
        )
        for message in builder.demo_messages()
    ]
    path = _write(tmp_path, builder, messages)
    tally = alert_tally(read_recording(path))
    assert tally.total == 1 and tally.line(path) is None  # the first step's growth only


def test_a_kind_this_version_does_not_know_is_named_as_written(
    tmp_path: Path, builder: ModuleType
) -> None:
    messages: list[schema.Message] = builder.demo_messages()
    messages.insert(-1, schema.AlertNow(time=0.0, step=24, alert=_alert("thermal_throttle")))
    path = _write(tmp_path, builder, messages)
    assert "thermal_throttle at step 24" in (alert_tally(read_recording(path)).line(None) or "")


def test_the_run_summary_and_detach_say_the_alerts(tmp_path: Path, builder: ModuleType) -> None:
    """One line, built once, at the end of `run` (headless and after the TUI) and `detach`."""
    path = _write(tmp_path, builder, troubled_run(builder))
    expected = alert_tally(read_recording(path)).line(path)
    job = JobSpec(command=[], display=["python", "train.py"], env={}, recording=path)
    lines = summary_line(job, 0).splitlines()
    assert lines[-2] == f"memtui: {expected}"
    assert lines[-1] == f"memtui: recording {path}"
    # Between them and the headline: the over-budget alert of step 21 explained.
    assert lines[1].startswith("memtui: over budget at step 21: ")
    detached = detached_lines(path)
    assert detached[0].startswith("memtui: recorded 24 steps; peak ")
    assert "(piles + DDP/FSDP buffers); highest piles: " in detached[0]
    assert detached[-2] == f"memtui: {expected}"
    assert detached[1:-2] == lines[1:-2]


def test_each_process_of_a_session_folder_names_its_alerts(
    tmp_path: Path, builder: ModuleType
) -> None:
    folder = tmp_path / "session"
    folder.mkdir()
    (folder / "rank-0.memtui").write_bytes(builder.encode_recording(troubled_run(builder)))
    (folder / "rank-1.memtui").write_bytes(builder.encode_recording(builder.demo_messages()))
    troubled = alert_tally(read_recording(folder / "rank-0.memtui")).line(None)
    job = JobSpec(command=[], display=["torchrun", "train.py"], env={}, recording=folder)
    lines = summary_line(job, 0).splitlines()
    assert lines[1].startswith("memtui:   rank 0: ok after 24 steps; peak ")
    assert "(piles + DDP/FSDP buffers); highest piles: " in lines[1]
    assert lines[1].endswith(f"; {troubled}")
    assert lines[2].endswith(
        "; NaN loss at step 17; NaN/Inf activations at step 17; skipped step at step 9; 4 alerts"
    )


# ----- before the screen opens ----------------------------------------------------------------


class ScriptedJob:
    """A job that prints `lines`, then either ends (exit 1) or writes its recording."""

    def __init__(self, lines: list[str], recording: Path | None = None) -> None:
        self.script = list(lines)
        self.lines: list[str] = []
        self.printed = 0
        self.recording = recording
        self.waited = False

    def lines_after(self, seen: int) -> list[str]:
        return self.lines[seen:]

    def tick(self) -> None:
        if self.script:
            self.lines.append(self.script.pop(0))
            self.printed += 1
        elif self.recording is not None:
            self.recording.write_bytes(b"new")

    def poll(self) -> int | None:
        return 1 if not self.script and self.recording is None else None

    def wait(self) -> int:
        self.waited = True
        return 1


def test_a_job_that_ends_before_its_agent_leaves_its_output_and_no_screen(
    tmp_path: Path,
) -> None:
    spec = JobSpec(command=[], display=["python"], env={}, recording=tmp_path / "r.memtui")
    job = ScriptedJob(['  File "bad.py", line 1', "SyntaxError: '(' was never closed"])
    shown: list[str] = []
    started = wait_for_agent(AgentStart(spec), job, echo=shown.append, sleep=lambda _: job.tick())
    assert started is False and job.waited
    assert shown == ['  File "bad.py", line 1', "SyntaxError: '(' was never closed"]


def test_the_screen_waits_for_a_new_recording_not_an_old_one(tmp_path: Path) -> None:
    old = tmp_path / "r.memtui"
    old.write_bytes(b"an earlier run's recording")
    spec = JobSpec(command=[], display=["python"], env={}, recording=old)
    start = AgentStart(spec)
    assert not start.started()
    job = ScriptedJob(["loading data"], recording=None)
    job.recording = tmp_path / "elsewhere"  # never the watched name: the job runs on
    ticks = 0

    def sleep(_: float) -> None:
        nonlocal ticks
        ticks += 1
        job.tick()
        if ticks == 5:  # the agent starts: it replaces the file
            old.unlink()
            old.write_bytes(b"this run's")

    assert wait_for_agent(start, job, echo=lambda _: None, sleep=sleep)
    assert ticks == 5


# ----- as a user runs it, on a terminal ---------------------------------------------------------


def _on_terminal(
    argv: list[str], cwd: Path, env: dict[str, str], keys_when: Path | None = None
) -> tuple[int, str]:
    """`argv` on a pseudo-terminal (100x30); 'q' is typed once the job recording to
    `keys_when` has ended. Returns the exit code and everything the terminal was sent."""
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        os.chdir(cwd)
        os.execve(argv[0], argv, env)
    import fcntl
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    shown = b""
    deadline = time.monotonic() + 120
    typed_at = 0.0
    while time.monotonic() < deadline:
        if keys_when is not None and time.monotonic() - typed_at > 1.0 and _ended(keys_when):
            os.write(fd, b"q")
            typed_at = time.monotonic()
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
    else:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return os.waitstatus_to_exitcode(status), shown.decode(errors="replace").replace("\r\n", "\n")


def _ended(path: Path) -> bool:
    """The job wrote its final frame and its process is gone (typing `q` sooner asks whether
    to stop it)."""
    try:
        recording = read_recording(path)
    except Exception:
        return False
    if recording.end is None:
        return False
    try:
        os.kill(recording.hello.pid, 0)
    except ProcessLookupError:
        return True
    return False


ALTERNATE_SCREEN = "\x1b[?1049h"

FAILS_AT_STEP_2 = """\
import torch

def check(step):
    if step == 2:
        raise ValueError(f"bad batch at step {step}")

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 4):
    model(torch.randn(3, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    check(step)
"""


@pytest.mark.slow
def test_a_script_that_does_not_compile_opens_no_screen(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("import torch\nx = (\n")
    code, shown = _on_terminal(
        [*MEMTUI, "run", "bad.py"], tmp_path, scrubbed_env(tmp_path / "rt", TERM="xterm")
    )
    assert code == 1
    assert ALTERNATE_SCREEN not in shown  # no full screen at all
    assert '  File "' in shown and 'bad.py", line 2\n    x = (\n' in shown
    assert "SyntaxError: '(' was never closed" in shown
    assert "job exited with code 1" in shown
    assert "did it import torch" not in shown


@pytest.mark.slow
def test_a_job_that_fails_under_the_screen_leaves_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(FAILS_AT_STEP_2)
    env = scrubbed_env(tmp_path / "rt", TERM="xterm")
    headless = subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", "plain.memtui", "train.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert headless.returncode == 1
    start = headless.stderr.index("Traceback (most recent call last):")
    end = headless.stderr.index("\n", headless.stderr.index("ValueError: bad batch")) + 1
    traceback = headless.stderr[start:end]  # as Python printed it, on a plain terminal
    assert 'train.py", line 13, in <module>\n    check(step)\n' in traceback
    recording = tmp_path / "screen.memtui"
    code, shown = _on_terminal(
        [*MEMTUI, "run", "-o", str(recording), "train.py"], tmp_path, env, keys_when=recording
    )
    assert code == 1
    assert ALTERNATE_SCREEN in shown
    after = shown[shown.rindex("\x1b[?1049l") :]  # what stays once the screen has closed
    assert traceback in after, after
    assert after.index(traceback) < after.index("memtui: job error (exit code 1)")


NAN_AND_OVER_BUDGET = """\
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(1, 11):
    x = torch.randn(8 if step < 8 else 64, 16)  # a larger batch from step 8
    if step >= 5:
        x[0, 0] = float("nan")  # bad data from step 5
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@pytest.mark.slow
def test_a_headless_run_ends_naming_its_alerts(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(NAN_AND_OVER_BUDGET)
    result = subprocess.run(
        [*MEMTUI, "run", "--headless", "--budget", "24KiB", "-o", "rec.memtui", "train.py"],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt", TERM="xterm"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    recording = tmp_path / "rec.memtui"
    total = len(read_recording(recording).alerts)
    lines = result.stderr.splitlines()
    headline = next(index for index, line in enumerate(lines) if line.startswith("memtui: job"))
    assert lines[headline].startswith(
        "memtui: job exited (exit code 0) with an error: NaN loss from step 5; "
        "after 10 steps; peak "
    )
    assert lines[headline + 1].startswith("memtui: over budget at step 8: tracked peak ")
    assert lines[-2] == (
        # Step 6's activations follow from step 5's poisoned weights: folded, not named.
        "memtui: NaN loss from step 5; NaN/Inf gradients from step 5; "
        f"over budget at step 8; {total} alerts: memtui report {recording}"
    )
    assert lines[-1] == f"memtui: recording {recording}"
