"""End-to-end tests of the `memtui` command line, run exactly as a user would run it.

Each test starts the real console script in a subprocess, with its own working directory and its
own runtime directory (so sockets and sidecars of concurrent tests never meet), runs a tiny
training script written into the working directory, and reads the result back through
`memtui report`. Nothing here imports torch in the test process: the job owns torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

import memtui_agent
from memtui_protocol import schema, wire

pytestmark = pytest.mark.slow  # every test here starts a torch job in a fresh interpreter

TIMEOUT_S = 120
_CONSOLE = Path(sys.executable).with_name("memtui")
MEMTUI = [str(_CONSOLE)] if _CONSOLE.exists() else [sys.executable, "-m", "memtui"]
AGENT_DIR = Path(memtui_agent.__file__).resolve().parent

PILES = ("weights", "gradients", "optimizer_state", "activations")
ALLOCATOR_KEYS = (
    "allocated",
    "reserved",
    "peak_allocated",
    "process_gpu",
    "device_used",
    "device_total",
)
IN_FEATURES, OUT_FEATURES = 10, 5
PARAM_BYTES = (IN_FEATURES * OUT_FEATURES + OUT_FEATURES) * 4
"""Exact bytes of `Linear(10, 5)` in float32: weight 10x5 plus bias 5."""

TRAIN_TEMPLATE = """\
import argparse
import sys
import time

import torch

FAIL_FORWARD = {fail_forward}
FAIL_BACKWARD = {fail_backward}
FAIL_AFTER = {fail_after}
EXIT_AFTER = {exit_after}
OOM_AT = {oom_at}
STEP = 0

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--sleep", type=float, default=0.0)
args = parser.parse_args()


class Check(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if STEP == FAIL_BACKWARD:
            raise ValueError("boom in backward")
        return grad


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear({inp}, {out})

    def forward(self, x):
        if STEP == FAIL_FORWARD:
            raise ValueError("boom")
        if STEP == OOM_AT:
            torch.empty(1 << 62, dtype=torch.uint8)
        return Check.apply(self.fc(x))


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for index in range(args.steps):
    STEP = index + 1
    loss = model(torch.randn(4, {inp})).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {{STEP}} done", flush=True)
    if STEP == EXIT_AFTER:
        sys.exit(3)
    if STEP == FAIL_AFTER:
        raise ValueError("boom between steps")
    if args.sleep:
        time.sleep(args.sleep)
print("TRAIN-END", flush=True)
"""


def train_source(
    fail_forward: int = 0,
    fail_backward: int = 0,
    fail_after: int = 0,
    exit_after: int = 0,
    oom_at: int = 0,
) -> str:
    """A tiny SGD-with-momentum job on Linear(10, 5); each keyword picks a step to misbehave at."""
    return TRAIN_TEMPLATE.format(
        fail_forward=fail_forward,
        fail_backward=fail_backward,
        fail_after=fail_after,
        exit_after=exit_after,
        oom_at=oom_at,
        inp=IN_FEATURES,
        out=OUT_FEATURES,
    )


def expected_stdout(steps: int) -> str:
    """What the job itself prints on a clean run: memtui must add nothing to stdout."""
    return "".join(f"step {n} done\n" for n in range(1, steps + 1)) + "TRAIN-END\n"


@dataclass
class Workspace:
    """A working directory and a private runtime directory for one or more memtui calls."""

    cwd: Path
    runtime: Path

    def env(self) -> dict[str, str]:
        """The user's environment, minus stray memtui settings, plus our own runtime dir."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("MEMTUI_")}
        env["MEMTUI_RUNTIME_DIR"] = str(self.runtime)
        env["OMP_NUM_THREADS"] = "1"
        return env

    def write(self, name: str, text: str) -> Path:
        path = self.cwd / name
        path.write_text(text)
        return path

    def memtui(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run the console script to completion, as a shell user would."""
        return subprocess.run(
            [*MEMTUI, *args],
            cwd=self.cwd,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )

    def report(self, path: str | Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        """`memtui report PATH --json`, parsed (fails the test if stdout is not JSON)."""
        result = self.memtui("report", str(path), "--json")
        try:
            document = json.loads(result.stdout)
        except json.JSONDecodeError:
            pytest.fail(f"report --json printed no JSON (rc {result.returncode}):\n{result}")
        return result, document


def make_workspace(factory: pytest.TempPathFactory) -> Workspace:
    """Separate short folders: a short runtime path keeps unix socket paths under 108 bytes."""
    return Workspace(cwd=factory.mktemp("cwd"), runtime=factory.mktemp("rt"))


@pytest.fixture
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return make_workspace(tmp_path_factory)


@dataclass
class Recorded:
    """One clean 3-step run, shared by the tests that only read its outputs."""

    ws: Workspace
    run: subprocess.CompletedProcess[str]
    path: Path


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """Running torch costs seconds; the contract, text and damage tests share one recording."""
    workspace = make_workspace(tmp_path_factory)
    workspace.write("train.py", train_source())
    run = workspace.memtui("run", "--headless", "-o", "rec.memtui", "train.py", "--steps", "3")
    return Recorded(ws=workspace, run=run, path=workspace.cwd / "rec.memtui")


def stderr_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def assert_one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """A user error is one line on stderr, no traceback, nothing on stdout, non-zero exit."""
    lines = stderr_lines(result)
    assert result.returncode != 0, result
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == "", result.stdout
    assert lines[0].startswith("memtui: "), lines[0]
    return lines[0]


def check_contract(report: dict[str, Any]) -> None:
    """Every key and type of the `memtui report --json` contract (docs/report-format.md)."""
    assert report["format"] == "memtui-report"
    assert report["version"] == 2
    job = report["job"]
    assert isinstance(job["argv"], list) and all(isinstance(a, str) for a in job["argv"])
    assert isinstance(job["pid"], int)
    assert isinstance(job["torch"], str) and job["torch"]
    assert isinstance(job["device"], str) and job["device"]
    assert isinstance(job["started"], str)
    _dt.datetime.fromisoformat(job["started"])
    assert isinstance(report["steps"], list)
    for step in report["steps"]:
        assert isinstance(step["step"], int) and step["step"] >= 1
        assert isinstance(step["skipped"], bool)
        assert isinstance(step["microbatches"], int)
        for key in ("end", "max"):
            assert set(PILES) <= set(step[key]), step[key]
            assert all(isinstance(step[key][pile], int) for pile in PILES)
        assert isinstance(step["peak"]["total"], int)
        assert set(PILES) <= set(step["peak"]["piles"])
        assert isinstance(step["dtypes"], dict)
        for by_dtype in step["dtypes"].values():
            assert all(isinstance(v, int) for v in by_dtype.values()), by_dtype
        assert set(ALLOCATOR_KEYS) <= set(step["allocator"])
        for key in ALLOCATOR_KEYS:
            assert step["allocator"][key] is None or isinstance(step["allocator"][key], int)
        assert isinstance(step["host"]["rss"], int)
        assert step["loss"] is None or isinstance(step["loss"], float)
        for alert in step["alerts"]:
            assert isinstance(alert["kind"], str) and isinstance(alert["message"], str)
            assert alert["where"] is None or isinstance(alert["where"], str)
    for alert in report["alerts"]:
        assert set(alert) >= {"step", "kind", "message", "where"}, alert
    ending = report["exit"]
    assert set(ending) >= {"status", "code", "error", "step", "phase"}, ending
    assert ending["status"] in ("ok", "error", "killed", "running")


# ----- 1, 2: a clean run -------------------------------------------------------------------------


def test_run_passes_job_stdout_through_unchanged(recorded: Recorded) -> None:
    """Headless mode must not add to or reorder the job's stdout: users pipe it to files."""
    assert recorded.run.returncode == 0, recorded.run.stderr
    assert recorded.run.stdout == expected_stdout(3)
    assert recorded.path.is_file()


def test_report_json_follows_contract(recorded: Recorded) -> None:
    """The JSON is a public contract; other tools parse it."""
    result, report = recorded.ws.report(recorded.path)
    assert result.returncode == 0, result.stderr
    check_contract(report)
    assert report["job"]["argv"] == ["python", "train.py", "--steps", "3"]
    assert [step["step"] for step in report["steps"]] == [1, 2, 3]
    ending = report["exit"]
    assert ending["status"] == "ok"
    assert ending["code"] == 0
    assert ending["error"] is None
    # Momentum buffers appear at step 1 (first_step_growth); nothing else is alarming here.
    assert {(a["step"], a["kind"]) for a in report["alerts"]} <= {
        (1, "first_step_forecast"),
        (1, "first_step_growth"),
    }
    flattened = [{"step": s["step"], **a} for s in report["steps"] for a in s["alerts"]]
    assert report["alerts"] == flattened


def test_report_json_pile_values_are_exact(recorded: Recorded) -> None:
    """The ledger must count the model's bytes exactly, and peaks must add up."""
    _, report = recorded.ws.report(recorded.path)
    for step in report["steps"]:
        end, high, peak = step["end"], step["max"], step["peak"]
        assert end["weights"] == PARAM_BYTES
        assert high["weights"] == PARAM_BYTES
        assert step["dtypes"]["weights"] == {"float32": PARAM_BYTES}
        # `end` is taken after optimizer.step(), before zero_grad: grads are still there.
        assert end["gradients"] == PARAM_BYTES
        assert end["optimizer_state"] == PARAM_BYTES  # one momentum buffer per parameter
        assert end["activations"] == 0  # the graph is freed by backward
        assert high["activations"] > 0
        assert peak["total"] == sum(peak["piles"].values())
        for pile in PILES:
            assert high[pile] >= end[pile], (pile, step)
            assert high[pile] >= peak["piles"][pile], (pile, step)
        assert step["microbatches"] == 1
        assert step["skipped"] is False
        assert isinstance(step["loss"], float) and math.isfinite(step["loss"])
        assert step["host"]["rss"] > 0
        if report["job"]["device"] == "cpu":
            assert all(step["allocator"][key] is None for key in ALLOCATOR_KEYS)


def test_run_cleans_up_runtime_dir(recorded: Recorded) -> None:
    """A finished job must not leave a socket or sidecar that `memtui attach` would list."""
    leftovers = [p.name for p in recorded.ws.runtime.iterdir()]
    assert leftovers == []


def test_text_report_says_job_ok(recorded: Recorded) -> None:
    result = recorded.ws.memtui("report", str(recorded.path))
    assert result.returncode == 0, result.stderr
    assert "job ok" in result.stdout
    assert "steps: 3" in result.stdout


# ----- 3, 4, 5: how a job ends -------------------------------------------------------------------


def test_exit_code_passes_through(ws: Workspace) -> None:
    """`memtui run` is used in scripts and CI: it must exit with the job's own code."""
    ws.write("train.py", train_source(exit_after=1))
    run = ws.memtui("run", "--headless", "-o", "rec.memtui", "train.py", "--steps", "5")
    assert run.returncode == 3, run.stderr
    assert run.stdout == "step 1 done\n"
    _, report = ws.report("rec.memtui")
    assert report["exit"]["code"] == 3
    assert report["exit"]["status"] == "error"
    assert len(report["steps"]) == 1


@pytest.mark.parametrize(
    ("kwargs", "step", "phase", "message"),
    [
        ({"fail_forward": 3}, 3, "forward", "boom"),
        ({"fail_backward": 2}, 2, "backward", "boom in backward"),
        ({"fail_after": 2}, 3, "between steps", "boom between steps"),
    ],
    ids=["forward", "backward", "between-steps"],
)
def test_exception_in_job_is_located(
    ws: Workspace, kwargs: dict[str, int], step: int, phase: str, message: str
) -> None:
    """The report must say in which step and phase the job died, and the user's traceback must
    look like plain `python train.py` (no runner or runpy frames)."""
    ws.write("train.py", train_source(**kwargs))
    run = ws.memtui("run", "--headless", "-o", "rec.memtui", "train.py", "--steps", "5")
    assert run.returncode == 1, run.stderr
    assert run.stdout == expected_stdout(step - 1).replace("TRAIN-END\n", "")
    assert "Traceback (most recent call last)" in run.stderr
    assert f"ValueError: {message}" in run.stderr
    assert 'train.py", line' in run.stderr
    assert "runpy" not in run.stderr
    assert str(AGENT_DIR / "startup" / "runner.py") not in run.stderr
    assert "memtui_agent/startup/runner.py" not in run.stderr
    # No agent frame at all (e.g. the wrapper around torch.autograd.backward).
    assert f'File "{AGENT_DIR}{os.sep}' not in run.stderr
    _, report = ws.report("rec.memtui")
    check_contract(report)
    ending = report["exit"]
    assert ending["status"] == "error"
    assert ending["code"] == 1
    assert ending["step"] == step
    assert ending["phase"] == phase
    assert "ValueError" in ending["error"] and message in ending["error"]
    assert [s["step"] for s in report["steps"]] == list(range(1, step))
    assert not any(alert["kind"] == "oom" for alert in report["alerts"])


def test_cpu_out_of_memory_is_reported_as_oom(ws: Workspace) -> None:
    """torch 2.13 CPU says "DefaultCPUAllocator: can't allocate memory: ..." (a RuntimeError);
    that must become an `oom` alert and lead the text report."""
    ws.write("train.py", train_source(oom_at=2))
    run = ws.memtui("run", "--headless", "-o", "rec.memtui", "train.py", "--steps", "3")
    assert run.returncode == 1, run.stderr
    _, report = ws.report("rec.memtui")
    ending = report["exit"]
    assert ending["status"] == "error"
    assert ending["step"] == 2
    assert ending["phase"] == "forward"
    assert "RuntimeError" in ending["error"]
    oom = [alert for alert in report["alerts"] if alert["kind"] == "oom"]
    assert len(oom) == 1, report["alerts"]
    assert oom[0]["step"] == 2
    text = ws.memtui("report", "rec.memtui")
    assert text.returncode == 0, text.stderr
    assert text.stdout.splitlines()[0].startswith("OUT OF MEMORY"), text.stdout


# ----- 6: SIGKILL --------------------------------------------------------------------------------


def test_sigkilled_job_leaves_readable_recording(ws: Workspace) -> None:
    """A job killed by the OOM killer (SIGKILL) writes no final frame; every step it finished
    must still be in the recording, and memtui must exit the shell way (128 + 9)."""
    ws.write("train.py", train_source())
    command = [*MEMTUI, "run", "--headless", "-o", "rec.memtui", "train.py"]
    command += ["--steps", "100000", "--sleep", "0.05"]
    proc = subprocess.Popen(
        command,
        cwd=ws.cwd,
        env=ws.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)
    watchdog.start()
    try:
        assert proc.stdout is not None
        printed = 0
        while printed < 5:
            line = proc.stdout.readline()
            if not line:
                break
            printed += line.startswith("step ")
        assert printed >= 5, "the job stopped printing before step 5"
        jobs = [
            child
            for child in psutil.Process(proc.pid).children(recursive=True)
            if "memtui_agent.startup.runner" in " ".join(child.cmdline())
        ]
        assert len(jobs) == 1, jobs
        jobs[0].send_signal(signal.SIGKILL)
        rest, err = proc.communicate(timeout=TIMEOUT_S)
        printed += sum(line.startswith("step ") for line in rest.splitlines())
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGKILL, err
    result, report = ws.report("rec.memtui")
    assert result.returncode == 0, result.stderr
    check_contract(report)
    numbers = [step["step"] for step in report["steps"]]
    assert numbers == list(range(1, len(numbers) + 1))
    assert len(numbers) >= printed - 1, (len(numbers), printed)
    assert report["exit"]["status"] == "killed"
    assert report["exit"]["code"] is None
    text = ws.memtui("report", "rec.memtui")
    assert "job killed" in text.stdout


# ----- 7, 8: other ways to name the job ----------------------------------------------------------


def test_module_mode(ws: Workspace) -> None:
    """`-m module` must find a module in the working directory, like `python -m`."""
    ws.write("mymod.py", train_source())
    run = ws.memtui("run", "--headless", "-o", "r.memtui", "-m", "mymod", "--steps", "2")
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected_stdout(2)
    _, report = ws.report("r.memtui")
    assert report["job"]["argv"] == ["python", "-m", "mymod", "--steps", "2"]
    assert [step["step"] for step in report["steps"]] == [1, 2]
    assert report["exit"]["status"] == "ok"


def test_command_mode(ws: Workspace) -> None:
    """`-- COMMAND` injects the agent through sitecustomize into an arbitrary command."""
    ws.write("train.py", train_source())
    run = ws.memtui(
        "run", "--headless", "-o", "r.memtui", "--", sys.executable, "train.py", "--steps", "2"
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected_stdout(2)
    # A command may start several Python processes: r.memtui is their session folder.
    assert sorted(p.name for p in (ws.cwd / "r.memtui").glob("*.memtui")) == ["proc-0.memtui"]
    _, session = ws.report("r.memtui")
    report = session["ranks"]["proc-0"]
    check_contract(report)
    assert [step["step"] for step in report["steps"]] == [1, 2]
    assert report["exit"]["status"] == "ok"
    assert report["steps"][-1]["end"]["weights"] == PARAM_BYTES


def test_command_mode_records_nonzero_exit(ws: Workspace) -> None:
    """A job that exits 3 must not be reported as ok, whichever way it was started (the
    bootstrap's atexit handler cannot see the code, but must not claim success)."""
    ws.write("train.py", train_source(exit_after=1))
    run = ws.memtui(
        "run", "--headless", "-o", "r.memtui", "--", sys.executable, "train.py", "--steps", "3"
    )
    assert run.returncode == 3, run.stderr
    _, session = ws.report("r.memtui")
    assert session["ranks"]["proc-0"]["exit"]["status"] != "ok", session


@pytest.mark.parametrize(
    ("shell", "steps"),
    [
        ('"{python}" train.py --steps 2; "{python}" -c "import torch"', {"proc-0": 2, "proc-1": 0}),
        ('"{python}" train.py --steps 2 & "{python}" train.py --steps 3; wait', None),
    ],
    ids=["in-turn", "side-by-side"],
)
def test_command_mode_keeps_every_python_process(
    ws: Workspace, shell: str, steps: dict[str, int] | None
) -> None:
    """Sibling interpreters of one command each keep their own recording (issue 14, D2): the
    second one no longer truncates the first's, and report and the summary show them all."""
    ws.write("train.py", train_source())
    script = shell.format(python=sys.executable)
    run = ws.memtui("run", "--headless", "-o", "r.memtui", "--", "bash", "-c", script)
    assert run.returncode == 0, run.stderr
    result, session = ws.report("r.memtui")
    assert result.returncode == 0, result.stderr
    counts = {label: len(report["steps"]) for label, report in session["ranks"].items()}
    if steps is not None:
        assert counts == steps
        assert "proc-0: ok after 2 steps" in run.stderr, run.stderr
        assert "proc-1: ok after 0 steps" in run.stderr, run.stderr
    else:
        assert sorted(counts) == ["proc-0", "proc-1"] and sorted(counts.values()) == [2, 3]
    for report in session["ranks"].values():
        check_contract(report)
        assert report["exit"]["status"] == "ok"
    text = ws.memtui("report", "r.memtui")
    assert text.returncode == 0 and "proc-1" in text.stdout, text


def test_command_mode_refuses_an_existing_file_as_its_folder(ws: Workspace) -> None:
    (ws.cwd / "r.memtui").write_text("an older recording\n")
    line = assert_one_line_error(ws.memtui("run", "--headless", "-o", "r.memtui", "--", "true"))
    assert "session folder" in line
    assert (ws.cwd / "r.memtui").read_text() == "an older recording\n"


# ----- 9, 10: bad input --------------------------------------------------------------------------


def _bumped_version(cwd: Path, good: Path) -> list[str]:
    data = bytearray(good.read_bytes())
    data[8:10] = (99).to_bytes(2, "little")
    (cwd / "future.memtui").write_bytes(bytes(data))
    return ["report", "future.memtui"]


def _text_file(cwd: Path, good: Path) -> list[str]:
    (cwd / "notes.memtui").write_text("these are my notes, not a recording\n" * 3)
    return ["report", "notes.memtui"]


def _empty_file(cwd: Path, good: Path) -> list[str]:
    (cwd / "empty.memtui").write_bytes(b"")
    return ["report", "empty.memtui"]


def _directory(cwd: Path, good: Path) -> list[str]:
    (cwd / "adir").mkdir()
    return ["report", "adir"]


def _bogus_flag(cwd: Path, good: Path) -> list[str]:
    (cwd / "x.py").write_text("print('never runs')\n")
    return ["run", "--bogus-flag", "x.py"]


def _bad_budget(cwd: Path, good: Path) -> list[str]:
    (cwd / "x.py").write_text("print('never runs')\n")
    return ["run", "--budget", "12XB", "x.py"]


BAD_INPUTS: list[tuple[str, Callable[[Path, Path], list[str]], str]] = [
    ("run-missing-script", lambda cwd, good: ["run", "--headless", "missing.py"], "missing.py"),
    ("report-missing", lambda cwd, good: ["report", "missing.memtui"], "no such file"),
    ("report-directory", _directory, "directory"),
    ("report-text-file", _text_file, "not a memtui recording"),
    ("report-empty-file", _empty_file, "empty"),
    ("report-newer-version", _bumped_version, "newer"),
    ("run-bogus-flag", _bogus_flag, "--bogus-flag"),
    ("run-bad-budget", _bad_budget, "12XB"),
]


@pytest.mark.parametrize(
    ("make_args", "mentions"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_is_one_line(
    ws: Workspace,
    recorded: Recorded,
    make_args: Callable[[Path, Path], list[str]],
    mentions: str,
) -> None:
    """Mistakes get one sentence the user can act on, never a traceback."""
    args = make_args(ws.cwd, recorded.path)
    result = ws.memtui(*args)
    line = assert_one_line_error(result)
    assert mentions in line, line
    if args[0] == "run":
        assert list(ws.cwd.glob("*.memtui")) == [], "a refused run must not create a recording"


def _frames(data: bytes) -> list[tuple[int, int, schema.Message]]:
    """(start, end, message) of every frame after the preamble, found with the real decoder."""
    decoder = wire.FrameDecoder()
    frames = []
    start = wire.PREAMBLE.size
    for message in decoder.feed(data):
        frames.append((start, decoder.bytes_consumed, message))
        start = decoder.bytes_consumed
    assert decoder.pending == 0
    return frames


def _damaged_copy(ws: Workspace, good: Path, how: str) -> Path:
    data = good.read_bytes()
    frames = _frames(data)
    assert isinstance(frames[-1][2], schema.End)
    if how == "torn-last-frame":
        start, end, _ = frames[-1]
        data = data[: (start + end) // 2]
    elif how == "torn-last-step":
        start, end, _ = [f for f in frames if isinstance(f[2], schema.Step)][-1]
        data = data[: (start + end) // 2]
    elif how == "flipped-last-frame":
        start, end, _ = frames[-1]
        flipped = bytearray(data)
        flipped[end - 1] ^= 0xFF
        data = bytes(flipped)
    path = ws.cwd / f"{how}.memtui"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("how", "steps"),
    [("torn-last-frame", 3), ("torn-last-step", 2), ("flipped-last-frame", 3)],
)
def test_damaged_tail_reports_valid_prefix(
    ws: Workspace, recorded: Recorded, how: str, steps: int
) -> None:
    """A job killed mid-write (or a bad disk) must not cost the steps already recorded."""
    path = _damaged_copy(ws, recorded.path, how)
    result, report = ws.report(path)
    assert result.returncode == 3, result.stderr
    lines = stderr_lines(result)
    assert len(lines) == 1 and "warning" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    check_contract(report)
    assert [step["step"] for step in report["steps"]] == list(range(1, steps + 1))
    assert report["exit"]["status"] == "killed"
    text = ws.memtui("report", str(path))
    assert text.returncode == 3
    assert len(stderr_lines(text)) == 1


@pytest.mark.parametrize("keep", [3, 10])
def test_truncated_header_is_an_error(ws: Workspace, recorded: Recorded, keep: int) -> None:
    """Without a complete preamble and hello there is nothing to report."""
    path = ws.cwd / "stub.memtui"
    path.write_bytes(recorded.path.read_bytes()[:keep])
    result = ws.memtui("report", str(path), "--json")
    assert result.returncode == 1
    assert_one_line_error(result)


# ----- 11, 12: where the recording goes ----------------------------------------------------------


def test_no_record_writes_nothing(ws: Workspace) -> None:
    ws.write("train.py", train_source())
    run = ws.memtui("run", "--headless", "--no-record", "train.py", "--steps", "1")
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected_stdout(1)
    assert list(ws.cwd.rglob("*.memtui")) == []
    assert sorted(p.name for p in ws.cwd.iterdir()) == ["train.py"]


def test_no_record_prints_the_same_summary(ws: Workspace) -> None:
    """Without a recording the end of the run says what it says with one (read from the job's
    socket): steps, peak and highest piles, less where the recording is."""
    ws.write("train.py", train_source())
    recorded = ws.memtui("run", "--headless", "-o", "rec.memtui", "train.py", "--steps", "3")
    unrecorded = ws.memtui("run", "--headless", "--no-record", "train.py", "--steps", "3")
    assert recorded.returncode == unrecorded.returncode == 0, unrecorded.stderr
    [with_recording] = [line for line in recorded.stderr.splitlines() if "after 3 steps" in line]
    assert with_recording.startswith("memtui: job ok (exit code 0) after 3 steps; peak ")
    summary = unrecorded.stderr.strip().splitlines()
    assert summary[-1] == with_recording + " (nothing recorded: --no-record)"
    assert not any("memtui report" in line for line in summary)


def test_default_recording_name(ws: Workspace) -> None:
    """Without -o the recording lands in cwd under a findable name, and stderr says where."""
    ws.write("train.py", train_source())
    run = ws.memtui("run", "--headless", "train.py", "--steps", "1")
    assert run.returncode == 0, run.stderr
    found = list(ws.cwd.glob("memtui-train-*.memtui"))
    assert len(found) == 1, list(ws.cwd.iterdir())
    assert list(ws.cwd.glob("*.memtui")) == found
    assert found[0].name in run.stderr
    result, report = ws.report(found[0].name)
    assert result.returncode == 0
    assert len(report["steps"]) == 1
