"""What a new user meets first: strict JSON, the job's own errors shown as Python shows them,
and one spelling per concept (issue 16).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
from repo_paths import REPO

from memtui.commands.cli import main
from memtui.exit_codes import EXIT_BAD_INPUT
from memtui_agent.steps.failures import without_agent_frames
from memtui_protocol import schema

AGENT = REPO / "agent" / "memtui_agent"


def _strict(text: str) -> Any:
    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def _write(tmp_path: Path, builder: ModuleType, messages: list[schema.Message]) -> Path:
    path = tmp_path / "run.memtui"
    path.write_bytes(builder.encode_recording(messages))
    return path


def test_report_json_is_strict_on_a_nan_run(
    tmp_path: Path, builder: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    messages = builder.demo_messages()
    for index, message in enumerate(messages):
        if isinstance(message, schema.Step) and message.step == 2:
            messages[index] = msgspec.structs.replace(
                message, loss=float("nan"), scale=float("inf")
            )
    path = _write(tmp_path, builder, messages)
    assert main(["report", str(path), "--json"]) == 0
    report = _strict(capsys.readouterr().out)
    second = next(step for step in report["steps"] if step["step"] == 2)
    assert second["loss"] is None and second["scale"] is None
    assert report["format"] == "memtui-report" and report["version"] == 2


def test_report_steps_say_whether_activations_were_measured(
    tmp_path: Path, builder: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    messages = builder.demo_messages()
    for index, message in enumerate(messages):
        if isinstance(message, schema.Step) and message.step == 3:
            messages[index] = msgspec.structs.replace(
                message, activations_measured=False, activations_from=2
            )
    path = _write(tmp_path, builder, messages)
    assert main(["report", str(path), "--json"]) == 0
    steps = {step["step"]: step for step in _strict(capsys.readouterr().out)["steps"]}
    assert (steps[3]["activations_measured"], steps[3]["activations_from"]) == (False, 2)
    # Older recordings (no such fields) measured every step.
    assert (steps[2]["activations_measured"], steps[2]["activations_from"]) == (True, None)


def test_an_interrupt_is_described_once() -> None:
    end = schema.End(
        time=0.0, status="error", error_type="KeyboardInterrupt", error="KeyboardInterrupt"
    )
    assert end.describe_error() == "KeyboardInterrupt"
    end = schema.End(time=0.0, status="error", error_type="ValueError", error="bad lr")
    assert end.describe_error() == "ValueError: bad lr"


def test_a_traceback_of_only_runner_frames_trims_to_none() -> None:
    assert without_agent_frames(None) is None
    try:
        compile("x = (", "bad.py", "exec")
    except SyntaxError as error:
        frames = error.__traceback__
    # A traceback whose frames are all ours (runpy failing before the job's code ran).
    import memtui_agent.steps.failures as failures

    original = failures._is_ours
    failures._is_ours = lambda _traceback: True  # type: ignore[assignment]
    try:
        assert without_agent_frames(frames) is None
    finally:
        failures._is_ours = original


def _runner(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memtui_agent.startup.runner", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


@pytest.mark.slow  # starts an interpreter
def test_a_script_that_does_not_compile_fails_as_python_says(tmp_path: Path) -> None:
    (tmp_path / "bad.py").write_text("x = (\n")
    result = _runner(tmp_path, "bad.py")
    assert result.returncode == 1
    assert "SyntaxError: '(' was never closed" in result.stderr
    assert "Traceback" not in result.stderr and "memtui_agent" not in result.stderr


@pytest.mark.slow  # starts an interpreter
def test_a_missing_module_fails_as_python_says(tmp_path: Path) -> None:
    result = _runner(tmp_path, "--module", "no_such_module_here")
    assert result.returncode == 1
    assert result.stderr.strip().endswith(": No module named no_such_module_here")
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # starts an interpreter
def test_ctrl_c_shows_the_jobs_frames_only(tmp_path: Path) -> None:
    (tmp_path / "stop.py").write_text("raise KeyboardInterrupt\n")
    result = _runner(tmp_path, "stop.py")
    assert result.returncode == 130
    assert result.stderr.rstrip().endswith("\nKeyboardInterrupt")
    assert "runpy" not in result.stderr and "runner.py" not in result.stderr


def test_every_alert_kind_the_code_emits_is_an_alert_kind() -> None:
    """One spelling per concept: every alert the code builds names its kind by an AlertKind
    member, never by a string literal."""
    sources = [*AGENT.rglob("*.py"), *(AGENT.parents[1] / "memtui").rglob("*.py")]
    members, literals = set(), set()
    for path in sources:
        text = path.read_text()
        members.update(re.findall(r"Alert\(\s*kind=AlertKind\.([A-Z_]+)", text))
        members.update(re.findall(r"Alert\(\s*kind=schema\.AlertKind\.([A-Z_]+)", text))
        literals.update(re.findall(r'Alert\(\s*kind="([a-z_]+)"', text))
    assert len(members) >= 10, f"the scan found too few alerts built: {members}"
    assert members <= {kind.name for kind in schema.AlertKind}
    assert not literals, f"alert kinds spelled as strings: {literals}"


def test_an_unknown_alert_kind_still_decodes() -> None:
    alert = msgspec.msgpack.decode(
        msgspec.msgpack.encode({"kind": "from_the_future", "message": "m"}), type=schema.Alert
    )
    assert alert.kind == "from_the_future"
    assert schema.AlertKind.parse(alert.kind) is None
    assert schema.AlertKind.parse("oom") is schema.AlertKind.OOM
    assert f"{schema.AlertKind.OOM}" == "oom"


def test_piles_are_spelt_once() -> None:
    assert tuple(pile.value for pile in schema.Pile) == schema.PILES
    assert tuple(schema.Piles.__struct_fields__) == schema.PILES


def test_a_bad_flag_points_at_the_subcommands_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["run", "--bogus", "train.py"])
    assert stopped.value.code == 2
    assert "(see 'memtui run --help')" in capsys.readouterr().err


def test_demo_arguments_are_given_once() -> None:
    from memtui.commands.cli import demo_pace

    assert demo_pace(["--steps", "6"]) == ["--sleep=0.15", "--steps", "6"]
    assert demo_pace([]) == ["--steps=60", "--sleep=0.15"]


def test_attach_help_says_what_no_pid_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["attach", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: list them" not in text and "the only live job" in text


def test_replay_of_a_damaged_recording_exits_partial_with_the_whole_warning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from memtui.commands.tui_commands import replay_outcome
    from memtui.exit_codes import EXIT_PARTIAL
    from memtui.model.session import Session

    long = "the last 37 bytes are a partial frame (the writer stopped mid-frame); " * 3
    damaged = Session(live=False, warning=long)
    assert replay_outcome({"": damaged}, 0) == EXIT_PARTIAL
    assert long.strip() in capsys.readouterr().err
    assert replay_outcome({"": Session(live=False)}, 0) == 0
    assert replay_outcome({"": damaged}, 1) == 1  # a crash's own code wins


def test_a_job_stopped_from_the_tui_is_not_called_killed(
    tmp_path: Path, builder: ModuleType
) -> None:
    from memtui.commands.run_command import JobSpec, summary_line

    path = _write(tmp_path, builder, builder.demo_messages(with_end=False))
    job = JobSpec(command=[], display=["python", "train.py"], env={}, recording=path)
    line = summary_line(job, 143, stopped=True)
    assert "stopped from memtui (SIGTERM)" in line and "killed" not in line
    assert "killed" in summary_line(job, 137)


def test_command_errors_are_printed_in_one_place() -> None:
    """Commands raise `UserError`; only `cli.main` (and argparse's hook) word `memtui: error:`.

    Only cli.py prints them (`main`'s handler)."""
    import memtui

    package = Path(memtui.__file__).parent
    printing = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if 'print(f"memtui: error:' in path.read_text(encoding="utf-8")
    )
    assert printing == ["commands/cli.py"]


def test_a_command_error_is_one_escaped_line_with_its_exit_code(
    tmp_path: Path, builder: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, builder, builder.demo_messages())
    assert main(["export", str(path), "--format", "csv", "-o", str(path)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == f"memtui: error: {path}: would overwrite the recording\n"
    assert main(["report", str(tmp_path / "no\x1bsuch")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and err.startswith("memtui: error: ")
