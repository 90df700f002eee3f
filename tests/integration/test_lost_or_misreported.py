"""Nothing a job trained is lost or reported as something else (issue 27: L1, L3, L4).

L1: training in the children of a process that imported torch (a driver starting trainers,
multiprocessing workers by fork or spawn) was silently unrecorded under `memtui run -- COMMAND`.
L3: a rerun with the same `-o` whose job wrote nothing showed the earlier run as this one.
L4: a full disk in a session folder read `killed`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui, scrubbed_env

from memtui.input.job_process import log_first_line
from memtui_agent.startup.autostart import PROCESS_INDEX_FILE
from memtui_protocol import schema, wire


def _memtui(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return run_memtui(*args, cwd=cwd, env=scrubbed_env(cwd / "rt"), timeout=timeout)


def _recording(path: Path, status: str = "ok", code: int = 0) -> Path:
    """A finished run's recording, as an earlier run would have left it."""
    messages: list[schema.Message] = [
        schema.Hello(
            format_version=schema.FORMAT_VERSION,
            agent_version="earlier",
            pid=1,
            argv=["python", "earlier.py"],
            started="2026-01-01T00:00:00+00:00",
            started_unix=1.0,
        ),
        schema.End(time=2.0, status=status, code=code),
    ]
    path.write_bytes(wire.preamble() + b"".join(wire.encode(m) for m in messages))
    return path


# ----- L3: a rerun with the same -o -----------------------------------------------------------


@pytest.mark.slow  # starts an interpreter
def test_a_rerun_that_records_nothing_does_not_show_the_earlier_run(tmp_path: Path) -> None:
    """The earlier run's file is replaced as the new run starts: its summary used to read
    `job ok (exit code 3)` from the earlier run's recording."""
    out = _recording(tmp_path / "run.memtui")
    # The earlier TUI run's log, proven memtui's by its first line (a user's file there stays:
    # tests/integration/test_files_we_wrote.py).
    (tmp_path / "run.memtui.log").write_bytes(log_first_line() + b"earlier output\n")
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(3)\n")
    result = _memtui("run", "--headless", "-o", str(out), str(script), cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "job ok" not in result.stderr
    assert "no recording was written" in result.stderr
    assert not out.exists() and not (tmp_path / "run.memtui.log").exists()


@pytest.mark.slow  # starts an interpreter
def test_a_rerun_into_a_session_folder_starts_it_afresh(tmp_path: Path) -> None:
    """The earlier run's recordings go; the process counter stays (issue 32: a process of this
    run never takes a number an earlier one had, so no sibling's claim can be undone)."""
    folder = tmp_path / "session"
    folder.mkdir()
    _recording(folder / "proc-0.memtui")
    _recording(folder / "rank-1.memtui")
    (folder / PROCESS_INDEX_FILE).write_text("7")
    keep = folder / "notes.txt"
    keep.write_text("the user's own file")
    result = _memtui(
        "run", "--headless", "-o", str(folder), "--", sys.executable, "-c", "raise SystemExit(3)",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "0 recording(s)" in result.stderr and "ok after" not in result.stderr
    assert sorted(path.name for path in folder.iterdir()) == [PROCESS_INDEX_FILE, "notes.txt"]
    assert (folder / PROCESS_INDEX_FILE).read_text() == "7"


# ----- L4: a full disk ------------------------------------------------------------------------

LIMITED_EMITTER = """
import resource, signal, sys, time
from pathlib import Path
from typing import Any

import pytest
from memtui_agent.output.emitter import Emitter
from memtui_protocol import schema, wire

hello = schema.Hello(format_version=schema.FORMAT_VERSION, agent_version="t", pid=1,
                     argv=["python"], started="", started_unix=1.0)
opening = len(wire.preamble() + wire.encode(hello))
step = schema.Step(1, 1.0, 1.5, schema.Piles(), schema.Piles(), schema.Piles())
# The file may grow to the opening, one step and 150 bytes: the big frame after them is torn.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = opening + len(wire.encode(step)) + 150
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
failures = []
emitter = Emitter(Path(sys.argv[1]), None, hello, lambda c, e: failures.append((c, str(e))))
emitter.put(step)
emitter.put(schema.Names(kind="module", first_id=0, names=["x" * 1000]))
emitter.put(schema.Step(2, 2.0, 2.5, schema.Piles(), schema.Piles(), schema.Piles()))
emitter.close()
print(failures)
"""


@pytest.mark.slow  # starts an interpreter
def test_a_recording_that_cannot_grow_says_why_in_its_last_frame(tmp_path: Path) -> None:
    """The torn frame is cut off and one small frame says why the recording stopped: readers
    say `unrecorded` with the reason, never `killed`, and the failure is reported once."""
    out = tmp_path / "limited.memtui"
    result = subprocess.run(
        [sys.executable, "-c", LIMITED_EMITTER, str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("'recording'") == 1  # reported once
    from memtui.model.recording import read_recording
    from memtui.reports.report import report_of

    recording = read_recording(out)
    assert recording.warning is None  # no torn tail: it was cut off
    assert [step.step for step in recording.steps] == [1]
    assert recording.recording_stopped == "file size limit reached (EFBIG)"
    assert recording.how_it_ended() is schema.ExitStatus.UNRECORDED
    ending = report_of(recording).exit
    assert ending.status == "unrecorded"
    assert ending.error is not None and ending.error.startswith("recording stopped: file size")


def _unshare_works() -> bool:
    import shutil

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


FILLS_THE_DISK = """
import torch
from torch import nn
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(200):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
print("trained")
"""


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="needs unshare to mount a small tmpfs")
def test_a_full_disk_in_a_session_folder_is_not_called_killed(tmp_path: Path) -> None:
    """`-- COMMAND` records into a session folder; a process whose recording filled the disk
    read `killed` there (its own exit code is unknown). Its last frame now says `disk full`
    (or, where even that frame did not fit, the full folder does), once, and never killed."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "job.py"
    script.write_text(FILLS_THE_DISK)
    folder = mount / "session"
    inner = (
        f"mount -t tmpfs -o size=16k tmpfs {mount} || exit 77; mkdir {folder}; "
        f"{sys.executable} -m memtui run --headless -o {folder} -- {sys.executable} {script}; "
        f"code=$?; {sys.executable} -m memtui report {folder} --json > {tmp_path}/report.json; "
        "exit $code"
    )
    env = scrubbed_env(tmp_path / "rt")
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", inner], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    if result.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()[:200]}")
    assert result.returncode == 0, result.stderr
    assert "trained" in result.stdout  # the job went on
    assert result.stderr.count("No space left on device") == 1, result.stderr  # said once
    (line,) = [text for text in result.stderr.splitlines() if "proc-0:" in text]
    assert "disk full (ENOSPC)" in line and "killed" not in line, line
    (rank,) = json.loads((tmp_path / "report.json").read_text())["ranks"].values()
    if "recording stopped" in line:  # the last frame fitted: the report says so too
        assert rank["exit"]["status"] == "unrecorded"
        assert rank["exit"]["error"].startswith("recording stopped: disk full (ENOSPC)")


# ----- L1: children of a monitored process that train -----------------------------------------

TRAINER = """
import sys, torch
from torch import nn

def train(steps=12, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
    return steps

if __name__ == "__main__":
    train(int(sys.argv[1]))
"""

DRIVER = """
import os, subprocess, sys, multiprocessing, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trainer

if __name__ == "__main__":
    how = sys.argv[1]
    if how == "blocked":  # the children's folder cannot be made: they are named instead
        open(sys.argv[2], "w").close()
    if how in ("subprocess", "blocked"):
        for _ in range(2):
            subprocess.run([sys.executable, "trainer.py", "12"], check=True)
    else:
        pool = multiprocessing.get_context(how).Pool(2)
        print(pool.map(trainer.train, [12, 12], chunksize=1))
        pool.close()
        pool.join()
"""

LOADER = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
model = torch.nn.Linear(16, 2)
opt = torch.optim.Adam(model.parameters())
data = TensorDataset(torch.randn(64, 16), torch.randn(64, 2))
if __name__ == "__main__":
    for context in ("fork", "spawn"):
        for x, y in DataLoader(data, batch_size=16, num_workers=2, multiprocessing_context=context):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
"""


def _children_job(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "loader.py").write_text(LOADER)
    return _memtui("run", "--headless", *args, cwd=tmp_path)


def _trainers(folder: Path) -> list[Any]:
    from memtui.model.recording import read_recording
    from memtui.reports.rank_report import session_files

    recordings = [read_recording(path) for _label, path in session_files(folder)]
    return [recording for recording in recordings if recording.steps]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["subprocess", "fork", "spawn"])
def test_children_that_train_are_recorded_under_a_command(tmp_path: Path, how: str) -> None:
    """A driver that imported torch started trainers (subprocesses, Pool workers by fork or
    spawn): their training went unrecorded (600 steps in the adversarial round). Each is now
    recorded in the session folder from its second step on, and says so."""
    result = _children_job(tmp_path, "-o", "session", "--", sys.executable, "driver.py", how)
    assert result.returncode == 0, result.stderr
    trainers = _trainers(tmp_path / "session")
    assert len(trainers) == 2, result.stderr
    for recording in trainers:
        assert [step.step for step in recording.steps] == list(range(2, 13))
        first = recording.steps[0].alerts[0]
        assert first.kind == "attached" and "its step 1 was not recorded" in first.message
        origin = "a forked child of pid" if how == "fork" else "started by pid"
        assert origin in first.message
        assert recording.end is not None and recording.end.status == "ok"
    assert "not monitored" not in result.stderr


@pytest.mark.slow
def test_children_of_a_script_are_recorded_beside_its_recording(tmp_path: Path) -> None:
    """`memtui run driver.py`: the children record into `<recording>-ranks/`, and the summary
    points there."""
    result = _children_job(tmp_path, "-o", "run.memtui", "driver.py", "subprocess")
    assert result.returncode == 0, result.stderr
    assert len(_trainers(tmp_path / "run.memtui-ranks")) == 2
    assert "other ranks and processes recorded in" in result.stderr


@pytest.mark.slow
def test_a_child_that_trains_but_cannot_be_recorded_is_named(tmp_path: Path) -> None:
    result = _children_job(
        tmp_path, "-o", "run.memtui", "driver.py", "blocked", str(tmp_path / "run.memtui-ranks")
    )
    assert result.returncode == 0, result.stderr
    named = [line for line in result.stderr.splitlines() if "trained but was not recorded" in line]
    assert len(named) == 2, result.stderr  # each by its pid, once, in memtui's own output
    assert len({line.split(" pid ")[1].split()[0] for line in named}) == 2
    # A file where the folder goes: refused as the folder rule says (issue 32 made the folder
    # with its mode explicit instead of os.makedirs, whose FileExistsError said it before).
    assert all("is not a folder" in line for line in named), named


@pytest.mark.slow
def test_dataloader_workers_that_never_train_record_nothing(tmp_path: Path) -> None:
    result = _children_job(tmp_path, "-o", "session", "--", sys.executable, "loader.py")
    assert result.returncode == 0, result.stderr
    from memtui.reports.rank_report import session_files

    assert [label for label, _path in session_files(tmp_path / "session")] == ["proc-0"]
    assert "not monitored" not in result.stderr and "trained" not in result.stderr
