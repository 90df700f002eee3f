"""Every flag of every subcommand, given a bad value: one line on stderr, no traceback, no raw
control character, in bounded time; a non-zero exit wherever the value is refused.

The values are the ones a tester fed the CLI (issue 32): 400 digits, a number over int64,
negative, NaN, infinite, bytes that are not UTF-8 (as Python hands them over:
surrogate-escaped), control and bidi characters, empty. Each case runs `memtui.commands.cli.main`
in this process (the baseline arguments around the bad value make sure no job starts: a script
that does not exist, a pid no process has, a closed port); what only a started job shows (the
agent's notes, `memtui run`'s own lines about its recording) is checked in fresh interpreters
at the end (slow).

A case is `REFUSED` (a non-zero exit) or `SHOWN` (a value that is a legitimate name, a file
called `nan` say: any exit, but what is printed is escaped).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from cli_harness import MEMTUI
from repo_paths import FIXTURES

from memtui.commands.cli import main
from memtui.terminal_text import UNSAFE

FIXTURE = FIXTURES / "demo.memtui"
DEMO = "{demo}"
"""A copy of the fixture in the test's own folder (an export's default output goes beside it)."""
NO_SCRIPT = "/nonexistent-memtui-dir/job.py"
NO_PID = "4194305"  # above the kernel's largest pid_max: no process has it
CLOSED = "http://127.0.0.1:1"

VALUES = {
    "huge": "9" * 400,
    "over-int64": str(2**64 + 1),
    "negative": "-1",
    "nan": "nan",
    "inf": "inf",
    "non-utf8": os.fsdecode(b"\xff\xfe"),
    "control": "\x1b]0;title\x07\x1b[31m\u202e\x9b",
    "empty": "",
}
REFUSED, SHOWN = "refused", "shown"
RUN = ["run", "--headless"]

# (name, argv with {} for the bad value, expectation, values left out and why)
FLAGS: list[tuple[str, list[str], str, set[str]]] = [
    ("run --budget", [*RUN, "--budget", "{}", NO_SCRIPT], REFUSED, set()),
    ("run --nan-check", [*RUN, "--nan-check", "{}", NO_SCRIPT], REFUSED, set()),
    ("run --activations", [*RUN, "--activations", "{}", NO_SCRIPT], REFUSED, set()),
    ("run --metrics-port", [*RUN, "--metrics-port", "{}", NO_SCRIPT], REFUSED, set()),
    ("run --metrics-addr", [*RUN, "--metrics-port", "0", "--metrics-addr", "{}",
                            NO_SCRIPT], REFUSED, set()),
    ("run --metrics-job", [*RUN, "--metrics-job", "{}", NO_SCRIPT], REFUSED,
     {"nan", "inf", "negative", "huge", "over-int64"}),  # fine job names
    ("run -o", [*RUN, "-o", "{}", NO_SCRIPT], REFUSED, set()),
    ("run -m", [*RUN, "-m", "{}"], REFUSED, {"nan", "inf"}),  # real module names
    ("run SCRIPT", [*RUN, "{}"], REFUSED, set()),
    ("demo --activations", ["demo", "--headless", "--activations", "{}"], REFUSED, set()),
    ("attach PID", ["attach", "{}", "--headless", "-o", "x.memtui"], REFUSED, set()),
    ("attach --socket", ["attach", "--socket", "{}"], REFUSED, set()),
    ("attach --timeout", ["attach", NO_PID, "--headless", "-o", "x.memtui", "--timeout", "{}"],
     REFUSED, set()),
    ("attach --metrics-port", ["attach", NO_PID, "--headless", "-o", "x.memtui",
                               "--metrics-port", "{}"], REFUSED, set()),
    ("attach --metrics-addr", ["attach", NO_PID, "--headless", "-o", "x.memtui",
                               "--metrics-port", "0", "--metrics-addr", "{}"], REFUSED, set()),
    ("attach -o", ["attach", NO_PID, "--headless", "-o", "{}"], REFUSED, set()),
    ("detach PID", ["detach", "{}"], REFUSED, set()),
    ("detach --timeout", ["detach", NO_PID, "--timeout", "{}"], REFUSED, set()),
    ("replay PATH", ["replay", "{}"], REFUSED, set()),
    ("report PATH", ["report", "{}"], REFUSED, set()),
    ("report --json PATH", ["report", "--json", "{}"], REFUSED, set()),
    ("diff A", ["diff", "{}", DEMO], REFUSED, set()),
    ("diff B", ["diff", DEMO, "{}", "--json"], REFUSED, set()),
    ("diff --rank", ["diff", DEMO, DEMO, "--rank", "{}"], REFUSED, set()),
    ("export PATH", ["export", "{}", "--format", "csv"], REFUSED, set()),
    ("export --format", ["export", DEMO, "--format", "{}"], REFUSED, set()),
    ("export -o", ["export", DEMO, "--format", "csv", "-o", "{}"], SHOWN, set()),
    ("export tensorboard -o", ["export", DEMO, "--format", "tensorboard", "-o", "{}"], SHOWN,
     set()),
    ("cluster --prometheus", ["cluster", "--prometheus", "{}", "--once"], REFUSED, set()),
    ("cluster --job", ["cluster", "--prometheus", CLOSED, "--once", "--job", "{}"], REFUSED,
     set()),
    ("cluster --timeout", ["cluster", "--prometheus", CLOSED, "--once", "--timeout", "{}"],
     REFUSED, set()),
    ("check PATH", ["check", "{}", "--no-nan"], REFUSED, set()),
    ("check --max-peak", ["check", DEMO, "--max-peak", "{}"], REFUSED, set()),
    ("check --max", ["check", DEMO, "--max", "{}"], REFUSED, set()),
    ("check --max PILE=", ["check", DEMO, "--max", "activations={}"], REFUSED, set()),
    ("check --max-not-known", ["check", DEMO, "--no-nan", "--max-not-known", "{}"], REFUSED,
     set()),
    ("estimate --params", ["estimate", "--params", "{}"], REFUSED, set()),
    ("estimate --trainable", ["estimate", "--params", "7B", "--trainable", "{}"], REFUSED, set()),
    ("estimate --scheme", ["estimate", "--params", "7B", "--scheme", "{}"], REFUSED, set()),
    ("estimate --gpus", ["estimate", "--params", "7B", "--gpus", "{}"], REFUSED, set()),
    ("estimate --zero", ["estimate", "--params", "7B", "--zero", "{}"], REFUSED, set()),
    ("estimate --model", ["estimate", "--model", "{}"], REFUSED, set()),
    ("estimate --batch", ["estimate", "--model", "no_such_module_memtui:f", "--batch", "{}"],
     REFUSED, set()),
    ("estimate --optimizer", ["estimate", "--params", "7B", "--optimizer", "{}"], REFUSED, set()),
    ("estimate --autocast", ["estimate", "--params", "7B", "--autocast", "{}"], REFUSED, set()),
    ("estimate --device-memory", ["estimate", "--params", "7B", "--device-memory", "{}"],
     REFUSED, set()),
    ("estimate --budget", ["estimate", "--params", "7B", "--budget", "{}"], REFUSED, set()),
    ("estimate --accum", ["estimate", "--params", "7B", "--accum", "{}"], REFUSED, set()),
    ("estimate --loss", ["estimate", "--params", "7B", "--loss", "{}"], REFUSED, set()),
    ("estimate --from", ["estimate", "--from", "{}", "--budget", "1GB"], REFUSED, set()),
]  # fmt: skip

CASES = [
    pytest.param(argv, expect, value, id=f"{name}={kind}")
    for name, argv, expect, skipped in FLAGS
    for kind, value in VALUES.items()
    if kind not in skipped
]


def raw_controls(text: str) -> list[str]:
    """Unsafe characters (`terminal_text.UNSAFE`) other than the line ends of the output."""
    return [char for char in UNSAFE.findall(text) if char != "\n"]


def check(code: int | None, out: str, err: str, expect: str) -> None:
    assert "Traceback" not in err and "Traceback" not in out
    assert not raw_controls(err), repr(err)
    assert not raw_controls(out), repr(out[:500])
    lines = err.splitlines()
    if expect == REFUSED:
        assert code not in (0, None), (code, err)
        assert len(lines) == 1 and err.endswith("\n"), repr(err)
        assert lines[0].startswith("memtui"), repr(err)
        assert len(lines[0]) <= 2000, len(lines[0])  # no 400-digit number with its commas
    else:
        assert all(line.startswith("memtui") for line in lines), repr(err)


@pytest.mark.parametrize(("argv", "expect", "value"), CASES)
def test_a_bad_value_is_one_line(
    argv: list[str], expect: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # anything a case writes lands here
    demo = tmp_path / "demo.memtui"
    demo.write_bytes(FIXTURE.read_bytes())
    words = {"{}": value, DEMO: str(demo)}
    out, err = io.StringIO(), io.StringIO()
    code: int | None
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([words.get(word, word) for word in argv])
        except SystemExit as exc:  # argparse's own exits
            code = exc.code if isinstance(exc.code, int) else 1
    check(code, out.getvalue(), err.getvalue(), expect)


def test_every_value_flag_of_every_subcommand_is_in_the_table() -> None:
    """A flag added later without a row here fails this test."""
    from memtui.commands.cli import _subcommands, build_parser

    covered = {name for name, *_ in FLAGS}
    missing = []
    for command, parser in _subcommands(build_parser()).items():
        for action in parser._actions:
            if action.nargs == 0 or not action.option_strings:
                continue  # switches and positionals (positionals are named per command)
            if not any(f"{command} {flag}" in covered for flag in action.option_strings) and not (
                command == "export" and "-o" in action.option_strings
            ):
                missing.append(f"{command} {action.option_strings[0]}")
    assert missing == [] or set(missing) <= {"demo -o"}, missing  # demo -o starts the demo


def test_a_budget_over_int64_is_refused_and_the_agent_reads_any_value() -> None:
    """`--budget 20000000000000000000` passed the CLI, and the job's agent then did not start
    (exit 0, no recording): refused at the CLI now, and the config reader takes any value."""
    from memtui_protocol.config import BUDGET, AgentConfig
    from memtui_protocol.units import MAX_SIZE, parse_size

    with pytest.raises(ValueError, match="at most"):
        parse_size("20000000000000000000")
    with pytest.raises(ValueError):
        parse_size("9" * 400)
    assert parse_size(str(MAX_SIZE)) == MAX_SIZE
    for text in ("20000000000000000000", "9" * 400, "-5", "nan", "", "\udcff"):
        assert AgentConfig.from_env({BUDGET: text}).budget is None
    assert AgentConfig.from_env({BUDGET: "1024"}).budget == 1024


# ----- what a started job prints (fresh interpreters) --------------------------------------------

SCRIPT = "print('job ran')\n"


@pytest.mark.slow
def test_run_says_where_it_records_without_raw_controls(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    output = tmp_path / "a\x1b]0;x\x07\x1b[31mb.memtui"
    result = subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", str(output), str(script)],
        capture_output=True, text=True, timeout=120, errors="surrogateescape",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "job ran" in result.stdout
    assert "memtui: recording to" in result.stderr
    assert not raw_controls(result.stderr), repr(result.stderr)


@pytest.mark.slow
def test_the_agents_notes_have_no_raw_controls(tmp_path: Path) -> None:
    """`--metrics-job` and the other texts the agent quotes in its notes come from the user."""
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, memtui_agent\n"
        "memtui_agent.start(record=None, socket=False, metrics_port=1,\n"
        "                   metrics_addr='no-such-host.invalid\\x1b[31m')\n"
        "m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "o.zero_grad(); m(torch.ones(1, 2)).sum().backward(); o.step()\n"
        "memtui_agent.stop()\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("memtui:")]
    assert notes and any("metrics" in line for line in notes), result.stderr
    assert not raw_controls(result.stderr), repr(result.stderr)
    assert re.search(r"\\x1b\[31m", result.stderr)  # shown, escaped
