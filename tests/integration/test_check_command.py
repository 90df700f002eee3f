"""`memtui check` on recordings of real jobs run under `memtui run --headless` (docs/check.md):
exit 0 when every rule holds, 1 with one line per broken rule, 2 with one line for a command line
or a recording it cannot judge, never a traceback.

The truths come from the jobs themselves: the leaking job prints its holder's name, the NaN job
turns its loss Inf at a step it names (`BAD_STEP`); the peak is held against the report's own
per-step peak (the one definition, `memtui_protocol.peak`), whose figures other tests hold
against the jobs' own counts.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI, run_memtui, scrubbed_env
from recording_files import hello, write_recording
from repo_paths import FIXTURES

from memtui.commands.cli import main
from memtui_protocol import schema

NAN_STEP = 31
"""`tests/fixtures/nan/log_loss.py`'s BAD_STEP: its loss is Inf from this step on."""
JOBS = {
    "healthy": (FIXTURES / "growing" / "healthy.py", "40"),
    "leak": (FIXTURES / "growing" / "total_loss.py", "30"),
    "nan": (FIXTURES / "nan" / "log_loss.py", ""),
}


def _record(name: str, tmp: Path) -> tuple[Path, str]:
    script, steps = JOBS[name]
    path = tmp / f"{name}.memtui"
    result = subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", str(path), str(script), *([steps] if steps else [])],
        cwd=script.parent, env=scrubbed_env(tmp / "rt"), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return path, result.stdout


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each job's recording and its own output (two at a time: CI has two cores)."""
    tmp = tmp_path_factory.mktemp("check")
    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {name: pool.submit(_record, name, tmp) for name in JOBS}
        return {name: future.result() for name, future in started.items()}


def check(path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return run_memtui("check", str(path), *flags, cwd=path.parent, timeout=120)


def report_peaks(path: Path) -> list[tuple[int, int | None]]:
    result = run_memtui("report", str(path), "--json", cwd=path.parent, timeout=120)
    assert result.returncode == 0, result.stderr
    return [(step["step"], step["peak"]["held"]) for step in json.loads(result.stdout)["steps"]]


@pytest.mark.slow
def test_the_peak_limit_is_held_against_the_reports_peak(
    recorded: dict[str, tuple[Path, str]],
) -> None:
    path, _ = recorded["healthy"]
    peaks = report_peaks(path)
    known = [(number, peak) for number, peak in peaks if peak is not None]
    top_step, top = max(known, key=lambda item: item[1])
    unknown = len(peaks) - len(known)
    allowance = ("--max-not-known", "100")
    at = check(path, "--max-peak", str(top), *allowance)
    assert at.returncode == 0, at.stdout + at.stderr
    assert at.stdout.splitlines()[-1] == "memtui check: the rule holds over 40 steps (job ok)"
    under = check(path, "--max-peak", str(top - 1), *allowance)
    assert under.returncode == 1
    first = under.stdout.splitlines()[0]
    assert first.startswith("peak ") and f"({top:,} B) at step {top_step} is over " in first
    assert f"--max-peak {top - 1} ({top - 1:,} B)" in first
    document = json.loads(check(path, "--max-peak", str(top - 1), *allowance, "--json").stdout)
    assert (document["ok"], document["steps"], document["job"]) == (False, 40, "ok")
    (rule,) = document["rules"]
    assert (rule["highest"], rule["highest_step"], rule["not_known_steps"]) == (
        top,
        top_step,
        unknown,
    )
    (violation,) = document["violations"]
    assert violation["rule"] == "max_peak" and violation["breach"] == "over_limit"
    assert (violation["measured"], violation["limit"], violation["step"]) == (
        top,
        top - 1,
        top_step,
    )
    assert violation["message"] == first


@pytest.mark.slow
def test_a_decimal_limit_is_answered_in_decimal_units(
    recorded: dict[str, tuple[Path, str]],
) -> None:
    path, _ = recorded["healthy"]
    result = check(path, "--max-peak", "1KB", "--max-not-known", "100")
    assert result.returncode == 1
    assert " kB (" in result.stdout and "--max-peak 1KB (1,000 B)" in result.stdout
    assert "KiB" not in result.stdout.splitlines()[0]


@pytest.mark.slow
def test_no_leak_names_the_jobs_own_holder(recorded: dict[str, tuple[Path, str]]) -> None:
    path, output = recorded["leak"]
    job = json.loads(next(line[4:] for line in output.splitlines() if line.startswith("JOB ")))
    result = check(path, "--no-leak", "--no-nan")
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"leak: {job['holder']} keeps ")
    assert lines[0].endswith("--no-leak allows none")
    assert lines[1] == "ok: no NaN/Inf alert in 30 steps"
    assert lines[-1] == "memtui check: 1 of 2 rules broken over 30 steps (job ok)"
    healthy, _ = recorded["healthy"]
    assert check(healthy, "--no-leak", "--no-nan").returncode == 0


@pytest.mark.slow
def test_no_nan_names_the_step_the_job_went_non_finite(
    recorded: dict[str, tuple[Path, str]],
) -> None:
    path, _ = recorded["nan"]
    result = check(path, "--no-nan", "--json")
    assert result.returncode == 1
    document = json.loads(result.stdout)
    kinds = {v["holder"]: v for v in document["violations"]}
    assert kinds["nonfinite_loss"]["step"] == NAN_STEP
    assert kinds["nonfinite_loss"]["message"].startswith(f"NaN/Inf loss at step {NAN_STEP} ")
    assert document["rules"][0]["ok"] is False


def _one_line_refusal(result: subprocess.CompletedProcess[str], said: str) -> None:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert said in result.stderr


@pytest.mark.slow
def test_a_recording_cut_short_is_refused_not_judged(
    recorded: dict[str, tuple[Path, str]], tmp_path: Path
) -> None:
    whole, _ = recorded["nan"]
    cut = tmp_path / "cut.memtui"
    data = whole.read_bytes()
    cut.write_bytes(data[: len(data) - 100])
    _one_line_refusal(check(cut, "--no-nan"), "judges whole recordings only")


# In-process below: the command line and recordings written by hand (no interpreter started).


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = main(["check", *args])
    except SystemExit as exit:
        code = int(exit.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def small(tmp_path: Path) -> Path:
    held = schema.Piles(10, 10, 20, 60)
    steps: list[Any] = [schema.Step(n, n, n + 0.5, held, held, held) for n in (1, 2)]
    end = schema.End(time=3.0, status="ok", code=0)
    return write_recording(tmp_path / "small.memtui", [hello(), *steps, end])


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--max-peak", "12XB"), "invalid size '12XB'"),
        (("--max", "optimizer=1MiB"), "no pile 'optimizer': the piles are weights, gradients"),
        (("--max", "activations"), "give PILE=SIZE"),
        (("--max-peak", "1MiB", "--max-not-known", "101"), "a percent from 0 to 100, not '101'"),
        (("--max-peak", "1MiB", "--max-not-known", "nan"), "a percent from 0 to 100"),
        ((), "give at least one rule"),
        (("--max-not-known", "5"), "give at least one rule"),
    ],
)
def test_a_bad_command_line_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], small: Path, flags: tuple[str, ...], said: str
) -> None:
    code, out, err = _main(capsys, str(small), *flags)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and said in err, err


def test_a_file_that_is_no_recording_is_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    other = tmp_path / "notes.txt"
    other.write_text("not a recording\n" * 100)
    for path in (other, tmp_path / "missing.memtui", tmp_path):
        code, out, err = _main(capsys, str(path), "--no-nan")
        assert (code, out) == (2, ""), err
        assert err.startswith(f"memtui: error: {path}") and err.count("\n") == 1


def test_every_rule_holding_is_exit_0(capsys: pytest.CaptureFixture[str], small: Path) -> None:
    code, out, _ = _main(capsys, str(small), "--max-peak", "100", "--max", "activations=60")
    assert code == 0
    assert out.splitlines() == [
        "ok: peak 100 B at step 1 is within --max-peak 100",
        "ok: activations 60 B at step 1 is within --max activations=60",
        "memtui check: all 2 rules hold over 2 steps (job ok)",
    ]
    code, out, _ = _main(capsys, str(small), "--max-peak", "99B")
    assert code == 1
    assert out.splitlines()[0] == (
        "peak 100 B (100 B) at step 1 is over --max-peak 99B (99 B); over on 2 of 2 steps, "
        "first at step 1"
    )
