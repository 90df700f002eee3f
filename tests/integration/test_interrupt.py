"""Ctrl-C before a job's first step: `memtui run` says the job was interrupted and where it
stopped, exits 130, and leaves no empty file of its own (an `X.log` the job wrote nothing to).

Each job writes a readiness marker, then waits: the Ctrl-C comes once the marker exists, never
after a fixed time. Headless, the terminal's Ctrl-C reaches the job's process group (emulated
with `killpg`); with the screen, it is typed on a real pseudo-terminal, where it reaches memtui
alone (the job runs in a session of its own) before the screen opens."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_harness import MEMTUI, scrubbed_env

pytestmark = pytest.mark.slow  # each test starts memtui and a job

AFTER_TORCH = """
import sys, time, torch
model = torch.nn.Linear(8, 8)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(int(sys.argv[2])):
    optimizer.zero_grad(); model(torch.randn(4, 8)).sum().backward(); optimizer.step()
open(sys.argv[1], "w").close()
while True:
    time.sleep(0.05)
"""

BEFORE_TORCH = """
import signal, sys, time
if sys.argv[2] == "silent":  # a job that ends on Ctrl-C without a word
    signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
open(sys.argv[1], "w").close()
time.sleep(120)
import torch
"""


def sigint_as_in_a_terminal() -> None:
    """A terminal's job gets Ctrl-C's default action; a suite started in the background hands
    its children SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(marker: Path, process: subprocess.Popen[str] | int) -> None:
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline, "the job never became ready"
        if isinstance(process, subprocess.Popen):
            assert process.poll() is None, process.communicate()
        time.sleep(0.05)


@pytest.mark.parametrize("steps", [0, 2])
def test_headless_ctrl_c_says_where_the_job_stopped(tmp_path: Path, steps: int) -> None:
    (tmp_path / "job.py").write_text(AFTER_TORCH)
    marker = tmp_path / "ready"
    process = subprocess.Popen(
        [*MEMTUI, "run", "--headless", "-o", "X", "job.py", str(marker), str(steps)],
        cwd=tmp_path, env=scrubbed_env(tmp_path / "rt"), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=sigint_as_in_a_terminal,
    )  # fmt: skip
    wait_for(marker, process)
    os.killpg(process.pid, signal.SIGINT)  # the terminal's Ctrl-C: memtui and the job
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    where = "before its first step" if steps == 0 else f"after {steps} steps;"
    [line] = [line for line in stderr.splitlines() if "job interrupted by Ctrl-C" in line]
    assert line.startswith(f"memtui: job interrupted by Ctrl-C (exit code 130) {where}"), line
    assert f"memtui: recording {tmp_path / 'X'}" in stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["X", "job.py", "ready", "rt"]


def on_terminal(argv: list[str], cwd: Path, marker: Path) -> tuple[int, str]:
    """`argv` on a pseudo-terminal; Ctrl-C typed once `marker` exists. The exit code and what
    the terminal showed."""
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        sigint_as_in_a_terminal()
        os.chdir(cwd)
        os.execve(argv[0], argv, scrubbed_env(cwd / "rt", TERM="xterm"))
    shown = b""
    typed = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not typed and marker.exists():
            os.write(fd, b"\x03")
            typed = True
        ready, _, _ = select.select([fd], [], [], 0.05)
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


@pytest.mark.parametrize("job", ["traceback", "silent"])
def test_ctrl_c_before_the_screen_opens(tmp_path: Path, job: str) -> None:
    (tmp_path / "job.py").write_text(BEFORE_TORCH)
    marker = tmp_path / "ready"
    argv = [sys.executable, "-m", "memtui", "run", "-o", "X", "job.py", str(marker), job]
    code, shown = on_terminal(argv, tmp_path, marker)
    assert code == 130, shown
    assert (
        "memtui: job interrupted by Ctrl-C (exit code 130) before its first step; no recording "
        "was written (the job had not imported torch yet)"
    ) in shown
    assert not (tmp_path / "X").exists()
    log = tmp_path / "X.log"
    if job == "silent":  # nothing but memtui's own first line: no file left for it
        assert not log.exists() and "job output kept" not in shown
    else:  # the job's KeyboardInterrupt: kept, and shown as Python shows it
        assert "KeyboardInterrupt" in log.read_text() and "KeyboardInterrupt" in shown
        assert f"job output kept in {log}" in shown
