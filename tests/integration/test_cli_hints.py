"""What the command line says at the edges a new user meets (issue 26, point 11): attaching to
`memtui run`'s launcher, attach without a terminal, `attach --list` with no job, Ctrl-C under
`--headless`, and the help of `demo` and `export`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_harness import DEFAULT_TIMEOUT_S, MEMTUI, MemtuiCli, scrubbed_env

from memtui.commands.cli import DEMO_STEPS, main, split_demo_argv
from memtui.reports.export import FORMATS


@pytest.mark.slow  # starts an interpreter
def test_attach_list_without_jobs_is_an_answer(tmp_path: Path, memtui_cli: MemtuiCli) -> None:
    result = memtui_cli("attach", "--list")
    assert result.returncode == 0
    assert result.stdout.startswith("no live memtui jobs (looked in ")
    assert result.stderr == ""


def test_demo_help_says_what_the_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"--steps N (default: {DEMO_STEPS} headless, 60 in the TUI)" in text
    assert "--sleep S (seconds after each step: none headless, 0.15 in the TUI" in text
    assert f"no TUI: {DEMO_STEPS} steps (unless --steps), then a summary" in text


def test_demo_help_has_the_demos_own_default() -> None:
    from memtui_agent.demo.tiny_lm import parse_args

    assert parse_args([]).steps == DEMO_STEPS


def test_demo_flags_are_memtuis_wherever_they_are() -> None:
    assert split_demo_argv(["--steps", "3", "--headless", "-o", "x.memtui"]) == (
        ["--headless", "-o", "x.memtui"],
        ["--steps", "3"],
    )
    assert split_demo_argv(["--headless", "--", "--steps", "3"]) == (
        ["--headless"],
        ["--steps", "3"],
    )


def test_export_help_says_where_it_writes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    suffixes = (FORMATS["chrome-trace"], FORMATS["csv"])
    assert "(default: beside the recording, with its name: run.memtui -> " in text
    assert all(f"run{suffix}" in text for suffix in suffixes)
    assert "'-' for stdout" in text


# ----- jobs --------------------------------------------------------------------------------------

SLOW_JOB = """\
import time, torch
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(600):
    model(torch.randn(3, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    time.sleep(0.1)
"""


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for_sidecar(runtime: Path, deadline_s: float = 90) -> dict[str, object]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        for sidecar in runtime.glob("*.json") if runtime.is_dir() else []:
            try:
                return dict(json.loads(sidecar.read_text()))
            except (OSError, ValueError):
                pass
        time.sleep(0.2)
    pytest.fail("the job's agent never started")


@pytest.mark.slow
def test_the_launchers_pid_leads_to_its_job(tmp_path: Path, memtui_cli: MemtuiCli) -> None:
    """`memtui run`'s own pid has not imported torch; its child, the job, runs the agent."""
    (tmp_path / "train.py").write_text(SLOW_JOB)
    recording = tmp_path / "rec.memtui"
    launcher = subprocess.Popen(
        [*MEMTUI, "run", "--headless", "-o", str(recording), "train.py"],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        job = _wait_for_sidecar(tmp_path / "rt")
        child = int(str(job["pid"]))
        assert child != launcher.pid
        shown = memtui_cli("attach", str(launcher.pid))  # no terminal here
        assert shown.returncode == 2
        assert shown.stderr.splitlines() == [
            f"memtui: error: memtui attach needs a terminal for its UI (pid {child} records to "
            f"{recording}: memtui report {recording} reads it so far)"
        ]
        headless = memtui_cli("attach", str(launcher.pid), "--headless", "-o", "x.memtui")
        assert headless.returncode == 1
        assert headless.stderr.strip() == (
            f"memtui: cannot attach: pid {launcher.pid} is the launcher of its child pid {child}, "
            f"which already runs a memtui agent, recording to {recording}: memtui attach {child}"
        )
        assert "has not imported torch" not in headless.stderr
        detach = memtui_cli("detach", str(launcher.pid))
        assert detach.returncode == 1
        assert f"its child pid {child} runs one: memtui detach {child}" in detach.stderr
        direct = memtui_cli("attach", str(child))
        assert "--headless" not in direct.stderr and f"memtui report {recording}" in direct.stderr
    finally:
        os.killpg(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=60)


INTERRUPTED_IN_THE_AGENT = """\
import signal, torch
from memtui_agent.hooks import step_hooks

# Ctrl-C while the agent's optimizer hook runs, at the third step: SIGHUP is handled as SIGINT
# is (KeyboardInterrupt), and raised by the C call the hook makes, so in the hook's own frame.
signal.signal(signal.SIGHUP, signal.default_int_handler)
original = step_hooks.caller_frame
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1, 6):
    model(torch.randn(3, 4)).pow(2).mean().backward()
    if step == 3:
        step_hooks.caller_frame = signal.raise_signal  # the hook calls caller_frame(1)
    optimizer.step()
    optimizer.zero_grad()
"""


@pytest.mark.slow
def test_ctrl_c_inside_the_agent_reads_as_a_plain_interrupt(
    tmp_path: Path, memtui_cli: MemtuiCli
) -> None:
    (tmp_path / "train.py").write_text(INTERRUPTED_IN_THE_AGENT)
    result = memtui_cli("run", "--headless", "-o", "rec.memtui", "train.py")
    assert result.returncode == 130
    traceback = result.stderr[result.stderr.index("Traceback (most recent call last):") :]
    traceback = traceback[: traceback.index("KeyboardInterrupt\n") + len("KeyboardInterrupt\n")]
    assert traceback.endswith(
        'train.py", line 14, in <module>\n    optimizer.step()\nKeyboardInterrupt\n'
    )
    assert "memtui_agent" not in traceback and "post_hook" not in traceback
    assert "memtui: job interrupted by Ctrl-C (exit code 130) after 2 steps" in result.stderr
    assert "job error" not in result.stderr


@pytest.mark.slow
def test_ctrl_c_under_headless_is_an_interrupt(tmp_path: Path) -> None:
    """The terminal's Ctrl-C: SIGINT to the whole foreground group, memtui and its job."""
    (tmp_path / "train.py").write_text(SLOW_JOB)
    run = subprocess.Popen(
        [*MEMTUI, "run", "--headless", "-o", "rec.memtui", "train.py"],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # A terminal's job gets Ctrl-C's default action; a suite started in the background
        # (`cmd &` in a script) hands its children SIGINT ignored, and the job never saw it.
        preexec_fn=_sigint_as_in_a_terminal,
    )
    try:
        _wait_for_sidecar(tmp_path / "rt")
        time.sleep(0.5)
        os.killpg(run.pid, signal.SIGINT)
        # A net for a hang only: 60 s ran out once with both cores and more busy (issue 33),
        # not seen again in 12 tries beside a CPU hog, each ending within seconds.
        _, stderr = run.communicate(timeout=DEFAULT_TIMEOUT_S)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130
    assert "\nKeyboardInterrupt\n" in stderr
    assert "memtui_agent" not in stderr
    # Where it stopped: after its steps so far, or before its first one.
    assert re.search(
        r"memtui: job interrupted by Ctrl-C \(exit code 130\) (after \d+ steps|before its first)",
        stderr,
    )
