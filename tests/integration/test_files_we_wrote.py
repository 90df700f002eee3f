"""Reliability, round four (issue 32): memtui removes and overwrites only what it can prove it
wrote; tasks that share a session folder keep each other's recordings; text that is not UTF-8 is
recorded; Prometheus targets are ours and readable by a Prometheus of another user; a runtime
folder at mode 000 is repaired for a user who is not root; a path too long is one line.

Each was measured on main by a tester: `memtui run --headless -o run.memtui train.py >
run.memtui.log` left no log (the rerun cleanup removed the file the shell wrote the job's output
into), `-o essay.txt` and `export -o data.csv` overwrote the user's files, a second task started
into a session folder removed the first task's live recording, a byte that is not UTF-8 in the
arguments gave "agent not started", another user's `prometheus/` folder was written into, a
Prometheus running as its own user could not read the targets of a 0700 session folder, a
runtime folder of mode 000 stayed so for a user who is not root, and a 300-character `-o` was a
traceback.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI, scrubbed_env
from repo_paths import FIXTURES

from memtui.commands.cli import main
from memtui.commands.earlier_run import RerunError, replace_previous
from memtui.commands.run_command import build_job
from memtui.input.job_process import JobProcess, log_first_line
from memtui.model.recording import read_recording
from memtui_agent.output.scrape_target import write_target
from memtui_agent.startup.autostart import record_path_for_rank
from memtui_protocol import schema, wire
from memtui_protocol.config import AgentConfig
from memtui_protocol.launch import launch_identity
from memtui_protocol.os_text import os_text
from memtui_protocol.runtime_dir import (
    Sidecar,
    ensure_private_dir,
    process_create_time,
    read_sidecar,
    write_sidecar,
)
from memtui_protocol.safe_open import RefusedPath, Replace, create_private
from memtui_protocol.written import JOB_LOG_MARKER, hold_as_writer

DEMO = FIXTURES / "demo.memtui"
STRANGER = 65534
PRECIOUS = b"precious notes\n"
SCHEDULER_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_ID", "PMIX_NAMESPACE")


@pytest.fixture(autouse=True)
def _no_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests say which launch they run in; the machine's own scheduler must not."""
    for name in SCHEDULER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _recording(
    path: Path,
    *,
    launch: str | None = None,
    pid: int = 1,
    hostname: str = "",
    create_time: float | None = None,
) -> Path:
    """A finished run's recording, as an earlier run (or a sibling task) left it."""
    hello = schema.Hello(
        format_version=schema.FORMAT_VERSION,
        agent_version="earlier",
        pid=pid,
        argv=["python", "train.py"],
        started="2026-01-01T00:00:00+00:00",
        started_unix=1.0,
        hostname=hostname,
        process_create_time=create_time,
        launch=launch,
    )
    end = schema.End(time=2.0, status="ok", code=0)
    path.write_bytes(wire.preamble() + wire.encode(hello) + wire.encode(end))
    return path


def _held(path: Path) -> int:
    """A descriptor on `path` holding the writer's lock, as a live agent or TUI holds it."""
    descriptor = os.open(path, os.O_RDWR)
    hold_as_writer(descriptor)
    return descriptor


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


# ----- 1. the rerun removes only what it can prove memtui wrote ---------------------------------


def test_a_users_file_at_the_log_name_is_kept_and_memtuis_own_log_removed(tmp_path: Path) -> None:
    """Before: the rerun cleanup removed `<recording>.log` whatever it held ("precious notes"
    gone). Now only a log that begins with memtui's own line goes."""
    recording = _recording(tmp_path / "run.memtui")
    log = tmp_path / "run.memtui.log"
    log.write_bytes(PRECIOUS)
    replace_previous(recording)
    assert not recording.exists()  # the earlier run's recording: proven, nobody writes it
    assert log.read_bytes() == PRECIOUS
    _recording(recording)
    log.write_bytes(log_first_line() + b"earlier output\n")
    replace_previous(recording)
    assert not recording.exists() and not log.exists()


def test_the_tui_refuses_a_log_it_did_not_write_unless_forced(tmp_path: Path) -> None:
    """The TUI writes `<recording>.log`: a file there it cannot prove it wrote is refused in one
    line before anything is removed; `--force` replaces it."""
    recording = _recording(tmp_path / "run.memtui")
    log = tmp_path / "run.memtui.log"
    log.write_bytes(PRECIOUS)
    with pytest.raises(RerunError) as refused:
        replace_previous(recording, writes_log=True)
    assert str(refused.value) == (
        f"{log}: exists and is not a log memtui wrote; refusing to overwrite it "
        "(--force replaces it)"
    )
    assert recording.exists() and log.read_bytes() == PRECIOUS  # a refusal removes nothing
    replace_previous(recording, force=True, writes_log=True)
    assert not recording.exists() and not log.exists()


def test_the_job_log_begins_with_memtuis_line_then_the_jobs_output_unchanged(
    tmp_path: Path,
) -> None:
    log = tmp_path / "run.memtui.log"
    job = JobProcess(["printf", "a\\rb\\n\\377"], dict(os.environ), log)
    assert job.wait() == 0
    first, rest = log.read_bytes().split(b"\n", 1)
    assert first.startswith(JOB_LOG_MARKER) and rest == b"a\rb\n\xff"
    os.close(create_private(log, replaces=Replace.JOB_LOG))  # a rerun may replace that one


def test_a_log_or_recording_still_being_written_is_never_replaced(tmp_path: Path) -> None:
    log = tmp_path / "run.memtui.log"
    log.write_bytes(log_first_line())
    recording = _recording(tmp_path / "run.memtui")
    held = [_held(log), _held(recording)]
    with pytest.raises(RefusedPath, match="a running process still writes it"):
        create_private(log, replaces=Replace.JOB_LOG)
    with pytest.raises(RefusedPath, match="a running process still writes it"):
        create_private(recording, replaces=Replace.RECORDING)
    with pytest.raises(RerunError, match=r"a running job .*still records there"):
        replace_previous(recording)
    assert recording.exists() and log.exists()
    for descriptor in held:
        os.close(descriptor)
    os.close(create_private(recording, replaces=Replace.RECORDING))  # the writer ended: ok


@pytest.mark.slow
def test_a_shell_redirect_beside_the_recording_keeps_the_jobs_output(tmp_path: Path) -> None:
    """The tester's command: `memtui run --headless -o run.memtui train.py > run.memtui.log`
    left no `run.memtui.log` (the cleanup removed the file the shell had just opened, and the
    job's output went into the removed file). Here a rerun: the earlier recording goes, the
    job's output is where the shell sent it."""
    (tmp_path / "job.py").write_text("print('the job says hello')\n")
    _recording(tmp_path / "run.memtui")
    command = [*MEMTUI, "run", "--headless", "-o", "run.memtui", "job.py"]
    result = subprocess.run(
        ["sh", "-c", 'exec "$@" > run.memtui.log', "sh", *command],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run.memtui.log").read_text() == "the job says hello\n"
    assert not (tmp_path / "run.memtui").exists()  # no torch: nothing recorded, nothing stale


# ----- 2. -o onto a file that is not a recording; export onto an existing file -----------------


def test_o_onto_a_file_that_is_not_a_recording_is_refused_unless_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    essay = tmp_path / "essay.txt"
    essay.write_bytes(PRECIOUS)
    (tmp_path / "job.py").write_text("open('started', 'w').close()\n")
    assert main(["run", "--headless", "-o", "essay.txt", "job.py"]) == 2
    assert _one_line(capsys.readouterr().err) == (
        f"memtui: error: -o {essay}: exists and is not a memtui recording; refusing to "
        "overwrite it (--force replaces it)"
    )
    assert essay.read_bytes() == PRECIOUS and not (tmp_path / "started").exists()
    replace_previous(essay, force=True)  # what `memtui run --force` does as the job starts
    assert not essay.exists()


def test_export_onto_an_existing_file_is_refused_unless_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data.csv"
    data.write_bytes(b"a,b\n1,2\n")
    assert main(["export", str(DEMO), "--format", "csv", "-o", str(data)]) == 1
    assert _one_line(capsys.readouterr().err) == (
        f"memtui: error: {data}: exists; refusing to overwrite it (--force replaces it)"
    )
    assert data.read_bytes() == b"a,b\n1,2\n"
    assert main(["export", str(DEMO), "--format", "csv", "-o", str(data), "--force"]) == 0
    assert data.read_text().startswith("step,")
    capsys.readouterr()
    runs = tmp_path / "runs"
    runs.write_bytes(PRECIOUS)  # a file where TensorBoard's folder of runs would go
    for extra in ([], ["--force"]):
        assert main(["export", str(DEMO), "--format", "tensorboard", "-o", str(runs), *extra]) == 1
        assert "is not a folder" in _one_line(capsys.readouterr().err)
    assert runs.read_bytes() == PRECIOUS


# ----- 3. session folders shared by tasks launched one at a time ---------------------------------


def test_a_later_task_keeps_a_live_recording_and_a_rerun_removes_finished_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "session"
    folder.mkdir(mode=0o700)
    live = _recording(folder / "proc-0.memtui")
    finished = _recording(folder / "proc-1.memtui")  # a sibling that already ended
    held = _held(live)
    replace_previous(folder)
    assert live.exists() and finished.exists()
    assert "still being written" in capsys.readouterr().err
    os.close(held)
    replace_previous(folder)  # no writer left, no launch in common: a rerun
    assert not live.exists() and not finished.exists()


def test_a_finished_task_of_the_same_launch_is_kept_and_another_launchs_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """srun starts tasks one at a time: a task that finished before its sibling starts is only
    told from a rerun by the launch both belong to (`Hello.launch`)."""
    folder = tmp_path / "session"
    folder.mkdir(mode=0o700)
    earlier = _recording(folder / "proc-0.memtui", launch="slurm 41.0")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    replace_previous(folder)
    assert earlier.exists()
    monkeypatch.setenv("SLURM_STEP_ID", "1")  # the next srun of the same job: a rerun
    replace_previous(folder)
    assert not earlier.exists()


def test_launch_identities() -> None:
    assert launch_identity({"SLURM_JOB_ID": "41", "SLURM_STEP_ID": "3"}) == "slurm 41.3"
    assert launch_identity({"SLURM_JOB_ID": "41"}) == "slurm 41.batch"
    assert launch_identity({"PMIX_NAMESPACE": "prterun-x-1@1"}) == "pmix prterun-x-1@1"
    assert launch_identity({}) is None


def test_a_recording_whose_process_still_runs_here_is_live_without_its_lock(
    tmp_path: Path,
) -> None:
    """A job that closed the agent's descriptor dropped its lock: its hello still names a
    process that runs on this host."""
    recording = _recording(
        tmp_path / "run.memtui",
        pid=os.getpid(),
        hostname=os_text(os.uname().nodename),
        create_time=process_create_time(os.getpid()),
    )
    with pytest.raises(RerunError, match=f"pid {os.getpid()}"):
        replace_previous(recording)
    with pytest.raises(RefusedPath, match="still writes"):
        create_private(recording, replaces=Replace.RECORDING)
    assert recording.exists()


SIBLING_JOB = textwrap.dedent("""
    import os, sys, torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    name = sys.argv[1]
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 3001):  # bounded: task a ends when the test says so
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        print(step, flush=True)
        if step == 3:
            open(name + ".ready", "w").close()
        if name == "b" and step == 5 or name == "a" and os.path.exists("stop"):
            break
""")


@pytest.mark.slow
def test_tasks_started_one_at_a_time_into_one_folder_keep_every_recording(tmp_path: Path) -> None:
    """The tester's srun-like run: task a trains into DIR, task b starts into DIR while a still
    trains (before: b's `memtui run` removed a's live recording, "300 steps, 0 recorded")."""
    (tmp_path / "job.py").write_text(SIBLING_JOB)
    folder = tmp_path / "DIR"
    env = scrubbed_env(tmp_path / "rt")

    def task(name: str) -> list[str]:
        return [
            *MEMTUI,
            "run",
            "--headless",
            "-o",
            str(folder),
            "--",
            sys.executable,
            "job.py",
            name,
        ]

    first = subprocess.Popen(
        task("a"), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240  # a safety net; the test waits for the event
        while not (tmp_path / "a.ready").exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "task a never reached its third step"
            time.sleep(0.1)
        second = subprocess.run(
            task("b"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
        )
        assert second.returncode == 0, second.stderr
        assert "still being written" in second.stderr
        (tmp_path / "stop").touch()
        stdout, stderr = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr
    trained = len(stdout.splitlines())
    report = subprocess.run(
        [*MEMTUI, "report", str(folder), "--json"], capture_output=True, text=True, timeout=120
    )
    assert report.returncode == 0, report.stderr
    steps = sorted(len(rank["steps"]) for rank in json.loads(report.stdout)["ranks"].values())
    assert steps == sorted([5, trained])


def test_a_task_of_the_same_launch_runs_beside_a_live_file_another_launch_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`srun memtui run -o run.memtui train.py`: every task but the first finds the file live.
    A task of that launch runs and records beside it; a job of another launch is refused."""
    recording = _recording(tmp_path / "run.memtui", launch="slurm 7.0")
    held = _held(recording)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    replace_previous(recording)
    assert "records beside it in run.memtui-ranks/" in capsys.readouterr().err
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    with pytest.raises(RerunError, match="still records there"):
        replace_previous(recording)
    assert recording.exists()
    os.close(held)


def test_a_sibling_tasks_agent_records_beside_the_file_by_its_task_rank(tmp_path: Path) -> None:
    recording = _recording(tmp_path / "run.memtui", launch="slurm 7.0")
    environ = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3"}
    chosen = record_path_for_rank(str(recording), environ)
    assert chosen == str(tmp_path / "run.memtui-ranks" / "rank-3.memtui")
    assert record_path_for_rank(str(tmp_path / "new.memtui"), environ) == str(
        tmp_path / "new.memtui"
    )  # the first task records into the file itself


@pytest.mark.slow
def test_srun_tasks_with_one_file_each_record_their_own(tmp_path: Path) -> None:
    """`srun memtui run --headless -o run.memtui train.py`: task 0 records into the file, task 1
    (started while task 0 trains) runs its job too and records into `run.memtui-ranks/`."""
    (tmp_path / "job.py").write_text(SIBLING_JOB)
    recording = tmp_path / "run.memtui"

    def task(name: str, procid: int) -> subprocess.Popen[str]:
        env = scrubbed_env(
            tmp_path / "rt", SLURM_JOB_ID="7", SLURM_STEP_ID="0", SLURM_PROCID=str(procid)
        )
        return subprocess.Popen(
            [*MEMTUI, "run", "--headless", "-o", str(recording), "job.py", name],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    first = task("a", 0)
    try:
        deadline = time.monotonic() + 240  # a safety net; the test waits for the event
        while not (tmp_path / "a.ready").exists():
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "task a never reached its third step"
            time.sleep(0.1)
        second = task("b", 1)
        _, second_err = second.communicate(timeout=240)
        assert second.returncode == 0, second_err
        assert "records beside it in run.memtui-ranks/" in second_err, second_err
        (tmp_path / "stop").touch()
        stdout, stderr = first.communicate(timeout=240)
    finally:
        for process in (first, second):
            if process.poll() is None:
                process.kill()
    assert first.returncode == 0, stderr
    assert len(read_recording(recording).steps) == len(stdout.splitlines())
    beside = read_recording(tmp_path / "run.memtui-ranks" / "rank-1.memtui")
    assert len(beside.steps) == 5


# ----- 4. text that is not UTF-8 ---------------------------------------------------------------


def test_bytes_that_are_not_utf8_are_carried_as_escapes() -> None:
    assert os_text("train.py") == "train.py"
    assert os_text("tr\udce9in \udcff") == "tr\\xe9in \\xff"  # bytes the OS smuggled in
    assert os_text("a\ud800b") == "a\\ud800b"  # a surrogate no byte made
    hello = schema.Hello(
        format_version=schema.FORMAT_VERSION,
        agent_version="v",
        pid=1,
        argv=["python", "tr\udce9in.py", "\udcff\udcfe"],
        started="",
        started_unix=1.0,
        hostname="node\udce9",
    )
    decoder = wire.FrameDecoder()
    [decoded] = list(decoder.feed(wire.preamble() + wire.encode(hello)))
    assert isinstance(decoded, schema.Hello)
    assert decoded.argv == ["python", "tr\\xe9in.py", "\\xff\\xfe"]
    assert decoded.hostname == "node\\xe9"


def test_a_sidecar_carries_arguments_that_are_not_utf8(tmp_path: Path) -> None:
    folder = ensure_private_dir(tmp_path / "rt")
    socket = str(folder / "7.sock")
    path = write_sidecar(folder, "7", Sidecar(pid=7, socket=socket, argv=["x\udcff"]))
    assert read_sidecar(path, folder).argv == ["x\\xff"]


UNICODE_JOB = textwrap.dedent("""
    import socket
    socket.gethostname = lambda: "node\\udce9"  # a host name that is not UTF-8
    import torch
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
""")


@pytest.mark.slow
def test_a_job_whose_arguments_script_and_host_are_not_utf8_is_recorded(tmp_path: Path) -> None:
    """Before: "agent not started (UnicodeEncodeError: ... surrogates not allowed)", no
    recording, exit 0."""
    script = tmp_path / os.fsdecode(b"tr\xe9in.py")
    script.write_text(UNICODE_JOB)
    result = subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", "rec.memtui", script.name, os.fsdecode(b"\xff\xfe")],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert "agent not started" not in result.stderr
    recording = read_recording(tmp_path / "rec.memtui")
    assert len(recording.steps) == 3
    assert recording.hello.argv == ["python", "tr\\xe9in.py", "\\xff\\xfe"]
    assert recording.hello.hostname == "node\\xe9"
    report = subprocess.run(
        [*MEMTUI, "report", "rec.memtui"], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert "command: python tr\\xe9in.py \\xff\\xfe" in report.stdout, report.stdout


# ----- 5. and 6. Prometheus targets: ours, and readable by a Prometheus of another user --------

LABELS = {"job": "j", "host": "h", "rank": "0", "local_rank": "0", "world_size": "1"}


def test_a_target_folder_another_user_made_first_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a folder of another user")
    folder = tmp_path / "prometheus"
    folder.mkdir(mode=0o755)
    os.chown(folder, STRANGER, STRANGER)
    with pytest.raises(RefusedPath, match=f"belongs to uid {STRANGER}"):
        write_target(folder / "h-rank0.json", "127.0.0.1:9400", LABELS)
    assert list(folder.iterdir()) == []


def test_a_target_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "prometheus"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(RefusedPath, match="writable by other users"):
        write_target(folder / "h-rank0.json", "127.0.0.1:9400", LABELS)
    assert list(folder.iterdir()) == []


def _reader_user() -> str:
    """The user a system Prometheus runs as (Debian's `prometheus`), else `nobody`."""
    import pwd

    for name in ("prometheus", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    pytest.skip("no prometheus or nobody user to read as")


def _as_user(user: str, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


other_user = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="reading as another user needs root and setpriv (util-linux)",
)


@pytest.fixture
def passable_folder() -> Iterator[Path]:
    """A folder any user may pass through (pytest's own temporary folders are 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="memtui-test-", dir="/tmp"))
    os.chmod(folder, 0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@other_user
def test_targets_are_readable_by_another_user_and_recordings_are_not(passable_folder: Path) -> None:
    """Before: the session folder was 0700, so a Prometheus running as its own user could not
    read the targets in it ("permission denied"); now it may pass through (0711), read the
    0644 targets in the 0755 `prometheus/`, and still neither list the folder nor read a
    recording (0600) — whatever the umask."""
    user = _reader_user()
    session = passable_folder / "session"
    target = session / "prometheus" / "h-rank0.json"
    previous = os.umask(0o077)
    try:
        job = build_job(
            [sys.executable, "-c", "pass"], None, str(session), False, AgentConfig(metrics_port=0)
        )
        assert job.notes is not None
        job.notes.unlink()  # nothing runs: the notes file build_job made is not needed
        os.close(create_private(session / "proc-0.memtui", private_folder=True))
        write_target(target, "127.0.0.1:9400", LABELS)
    finally:
        os.umask(previous)
    read = _as_user(user, "cat", str(target))
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout) == [{"targets": ["127.0.0.1:9400"], "labels": LABELS}]
    assert _as_user(user, "cat", str(session / "proc-0.memtui")).returncode != 0
    assert _as_user(user, "ls", str(session)).returncode != 0


PROMETHEUS_JOB = textwrap.dedent("""
    import os, sys, time
    os.umask(0o077)  # what the job's umask takes away must not hide the targets
    import torch
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3000):  # bounded: ended by the test's stop file
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        time.sleep(0.05)
        if os.path.exists(sys.argv[1]):
            break
""")


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _up_targets(url: str) -> int:
    query = urllib.parse.urlencode({"query": "up == 1"})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=5) as answer:
            document: dict[str, Any] = json.load(answer)
    except OSError:
        return 0
    return len(document["data"]["result"])


@pytest.mark.slow
@other_user
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="the prometheus binary is missing")
def test_a_prometheus_running_as_its_own_user_scrapes_every_target(passable_folder: Path) -> None:
    """The real engine, run as the `prometheus` user as Debian runs it: one job records into a
    session folder, one into a single recording (its `prometheus/` beside it); both targets
    must be read and scraped. Before: the 0700 session folder hid its target, and under the
    job's umask 077 the single recording's `prometheus/` was 0700 too."""
    import pwd

    try:
        pwd.getpwnam("prometheus")
    except KeyError:
        pytest.skip("no prometheus user (apt-get install prometheus makes it)")
    session, single = passable_folder / "session", passable_folder / "single"
    single.mkdir()
    os.chmod(single, 0o711)  # the user's own folder, passable: memtui changes nothing of it
    stop = passable_folder / "stop"
    (passable_folder / "job.py").write_text(PROMETHEUS_JOB)
    data = passable_folder / "data"
    data.mkdir()
    shutil.chown(data, "prometheus", "prometheus")
    port = _free_port()
    config = passable_folder / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n"
        "scrape_configs:\n  - job_name: memtui\n    honor_labels: true\n"
        "    file_sd_configs:\n      - refresh_interval: 1s\n        files:\n"
        f"          - {session}/prometheus/*.json\n          - {single}/prometheus/*.json\n"
    )
    os.chmod(config, 0o644)
    env = scrubbed_env(passable_folder / "rt")
    processes: list[subprocess.Popen[str]] = []
    try:
        processes.append(subprocess.Popen(
            ["setpriv", "--reuid=prometheus", "--regid=prometheus", "--clear-groups",
             "prometheus", f"--config.file={config}", f"--storage.tsdb.path={data}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        ))  # fmt: skip
        job = [str(passable_folder / "job.py"), str(stop)]
        for output in ([str(session), "--", sys.executable], [str(single / "run.memtui")]):
            processes.append(subprocess.Popen(
                [*MEMTUI, "run", "--headless", "--metrics-port", "0", "-o", *output, *job],
                cwd=passable_folder, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True, start_new_session=True,
            ))  # fmt: skip
        deadline = time.monotonic() + 240  # a safety net: the wait ends on both targets up
        url = f"http://127.0.0.1:{port}"
        while _up_targets(url) < 2:
            for process in processes:
                assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "Prometheus never scraped both targets"
            time.sleep(0.5)
        assert _up_targets(url) == 2
    finally:
        stop.touch()
        for process in reversed(processes):
            try:
                process.wait(60 if process is not processes[0] else 0.1)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)


# ----- 7. a runtime folder at mode 000, for a user who is not root ------------------------------


def test_a_runtime_folder_left_at_mode_000_is_repaired_for_a_user_who_is_not_root(
    passable_folder: Path,
) -> None:
    """Before: only root could open a mode-000 folder to give it back its mode (the earlier
    test passed because root ignores modes); a user's own jobs lost their socket for good. Run
    here in a forked child that became `nobody` (setresuid), the way any user runs."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    runtime = passable_folder / "rt"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, STRANGER, STRANGER)
    os.chmod(runtime, 0)
    child = os.fork()
    if child == 0:  # pragma: no cover (the child reports by its exit code)
        code = 1
        try:
            os.setgroups([])
            os.setresgid(STRANGER, STRANGER, STRANGER)
            os.setresuid(STRANGER, STRANGER, STRANGER)
            ensure_private_dir(runtime)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.stat(runtime).st_mode & 0o777 == 0o700


# ----- 8. a path too long ----------------------------------------------------------------------


def test_a_300_character_o_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text("open('started', 'w').close()\n")
    name = "x" * 300
    for command in (
        ["run", "--headless", "-o", f"{name}.memtui", "job.py"],
        ["run", "--headless", "-o", name, "--", sys.executable, "job.py"],
    ):
        assert main(command) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith("memtui: error: -o ") and line.endswith("File name too long")
    assert main(["export", str(DEMO), "--format", "csv", "-o", f"{name}.csv"]) == 1
    assert "File name too long" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "started").exists()
