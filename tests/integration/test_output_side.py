"""The agent's output side (issue 14): steps on disk before the job goes on, frames under the
reader's cap, a socket no viewer can use to hurt the job, recordings created safely, and agent
failures in the recording."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from cli_harness import MEMTUI, scrubbed_env

from memtui.input.sources import LiveSource
from memtui.model.recording import read_recording
from memtui_agent.output.emitter import Emitter
from memtui_agent.output.socket_server import (
    ACCEPTS_PER_POLL,
    BACKLOG_BYTES,
    MAX_VIEWERS,
    SocketServer,
)
from memtui_protocol import schema, wire
from memtui_protocol.safe_open import RefusedPath, Replace, create_private
from memtui_protocol.schema import ExitStatus

TRAIN = """
import os, signal, sys
import torch
from torch import nn
import memtui_agent

KILL_AFTER = int(sys.argv[1])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
memtui_agent.start(record="rec.memtui", socket=False)
for step in range(1, 100):
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    if step == KILL_AFTER:
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _hello() -> schema.Hello:
    return schema.Hello(
        format_version=schema.FORMAT_VERSION, agent_version="t", pid=1, argv=[], started="",
        started_unix=0.0,
    )  # fmt: skip


def _step(number: int) -> schema.Step:
    zero = schema.Piles()
    return schema.Step(number, 0.0, 0.0, zero, zero, zero)


# ----- D1: a completed step is in the file before control returns to the job -----------------


@pytest.mark.slow
def test_sigkill_right_after_a_step_never_loses_that_step(tmp_path: Path) -> None:
    """The job kills itself right after step N's `optimizer.step()`: N steps, every run."""
    runs = {}
    for index, kill_after in enumerate((1, 5, 7, 12, 20)):
        folder = tmp_path / f"run{index}"
        folder.mkdir()
        command = [sys.executable, "-c", TRAIN, str(kill_after)]
        process = subprocess.Popen(
            command, cwd=folder, env=scrubbed_env(folder / "rt"), stderr=subprocess.PIPE
        )
        runs[kill_after] = (folder, process)
    for kill_after, (folder, process) in runs.items():
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == -9, stderr
        recording = read_recording(folder / "rec.memtui")
        assert [step.step for step in recording.steps] == list(range(1, kill_after + 1))
        assert recording.steps[-1].loss is not None  # a CPU loss is read at close
        assert recording.how_it_ended() is ExitStatus.KILLED


def test_late_device_values_fold_into_their_step() -> None:
    """A CUDA loss reaches the host after its step's frame: readers fold it into that step."""
    steps = [_step(1), _step(2)]
    alert = schema.Alert(kind="skipped_step", message="skipped")
    added = schema.apply_late(steps, [schema.StepLate(step=1, loss=2.5, alerts=[alert])])
    assert steps[0].loss == 2.5 and steps[0].alerts == [alert] and steps[1].loss is None
    assert added == [(1, alert)]


# ----- D3: the writer never exceeds the reader's cap --------------------------------------------


def test_a_huge_names_table_is_split_and_reads_back_whole(tmp_path: Path) -> None:
    """20,000 modules with 1,000-character names (20 MB of names) and ten steps: all readable."""
    names = [f"{index:05d}" + "x" * 995 for index in range(20_000)]
    path = tmp_path / "rec.memtui"
    emitter = Emitter(path, None, _hello(), lambda component, exc: pytest.fail(str(exc)))
    emitter.put(schema.Names(kind="module", first_id=7, names=names))
    for number in range(1, 11):
        emitter.put(_step(number))
    emitter.close()
    recording = read_recording(path)
    assert recording.warning is None
    assert len(recording.steps) == 10
    assert [recording.module_names[7 + index] for index in range(20_000)] == names


def test_no_frame_over_the_cap_is_ever_encoded() -> None:
    too_big = schema.AgentError(time=0.0, component="x", message="y" * (wire.MAX_FRAME_BYTES + 1))
    with pytest.raises(wire.FrameTooLarge):
        wire.encode(too_big)
    frames = wire.encode_frames(schema.Names(kind="module", first_id=0, names=["z" * 10**7]))
    assert all(len(frame) <= wire.MAX_FRAME_BYTES + wire.FRAME_HEADER.size for frame in frames)


# ----- D4 and D5: viewers cannot stall the job, grow its memory or use up its descriptors -----


def _connect(path: Path) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(path))
    return client


def _server(tmp_path: Path) -> SocketServer:
    server = SocketServer(tmp_path / "job.sock")
    server.set_opening(wire.preamble() + wire.encode(_hello()))
    return server


def test_viewers_share_one_backlog_and_accepts_are_bounded(tmp_path: Path) -> None:
    """16 viewers that never read cost no copy of the backlog each; a poll accepts a few."""
    server = _server(tmp_path)
    frame = wire.encode(schema.AgentError(time=0.0, component="pad", message="p" * 4000))
    for _ in range(3000):
        server.publish(frame)
    clients = [_connect(server.path) for _ in range(MAX_VIEWERS)]
    tracemalloc.start()
    try:
        server.poll()
        assert server.viewers == ACCEPTS_PER_POLL
        while server.viewers < MAX_VIEWERS:
            server.poll()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The old server copied the whole backlog (here 8 MiB) into every viewer's buffer.
    assert peak < BACKLOG_BYTES // 4
    server.close()
    for client in clients:
        client.close()


def test_a_viewer_left_behind_is_dropped_and_the_log_stays_bounded(tmp_path: Path) -> None:
    server = _server(tmp_path)
    client = _connect(server.path)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    server.poll()
    frame = wire.encode(schema.AgentError(time=0.0, component="pad", message="p" * 4000))
    for _ in range(10):
        for _ in range(1000):
            server.publish(frame)
        server.poll()
    assert server.viewers == 0 and server.disconnected_slow == 1
    assert server._log_bytes <= BACKLOG_BYTES
    server.close()
    client.close()


def test_a_reading_viewer_gets_the_stream_in_order(tmp_path: Path) -> None:
    """Names published before and after it connected, each once, then every frame in order."""
    server = _server(tmp_path)
    server.publish(wire.encode(schema.Names(kind="module", first_id=0, names=["a"])), is_names=True)
    server.publish(wire.encode(_step(1)))
    client = _connect(server.path)
    client.setblocking(False)
    decoder = wire.FrameDecoder()
    received: list[schema.Message] = []
    for number in range(2, 400):
        if number == 200:
            names = schema.Names(kind="module", first_id=1, names=["b"])
            server.publish(wire.encode(names), is_names=True)
        server.publish(wire.encode(_step(number)))
        server.poll()
        try:
            received.extend(decoder.feed(client.recv(1 << 16)))
        except BlockingIOError:
            pass
    deadline = time.monotonic() + 10
    while len(received) < 402 and time.monotonic() < deadline:
        server.poll()
        try:
            received.extend(decoder.feed(client.recv(1 << 16)))
        except BlockingIOError:
            time.sleep(0.01)
    kinds = [type(message).__name__ for message in received]
    assert kinds.count("Names") == 2 and kinds[0] == "Hello" and kinds[1] == "Names"
    steps = [message.step for message in received if isinstance(message, schema.Step)]
    assert steps == list(range(1, 400))
    server.close()
    client.close()


def test_the_viewer_over_the_cap_is_told_in_one_line(tmp_path: Path) -> None:
    server = _server(tmp_path)
    clients = [_connect(server.path) for _ in range(MAX_VIEWERS)]
    while server.viewers < MAX_VIEWERS:
        server.poll()
    source = LiveSource(server.path)
    source.check()
    server.poll()
    assert server.refused == 1 and server.viewers == MAX_VIEWERS
    reason = source.run(lambda batch: None, threading.Event())
    assert reason is not None and "\n" not in reason
    assert f"already serves {MAX_VIEWERS} viewers" in reason
    server.close()
    for client in clients:
        client.close()


# ----- D7: never write through a planted link ---------------------------------------------------


def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    link = tmp_path / "rec.memtui"
    link.symlink_to(target)
    with pytest.raises(RefusedPath, match="symbolic link"):
        create_private(link)
    assert target.read_bytes() == b"keep me"
    own = tmp_path / "own.memtui"
    own.write_bytes(wire.preamble() + wire.encode(_hello()))  # an earlier run's recording
    # a rerun with the same -o replaces our own earlier recording
    os.close(create_private(own, replaces=Replace.RECORDING))
    assert own.read_bytes() == b"" and (own.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("planted", ["rec.memtui", "rec.memtui.log"])
@pytest.mark.slow  # starts an interpreter
def test_memtui_run_refuses_a_symlinked_recording_before_the_job_starts(
    tmp_path: Path, planted: str
) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    (tmp_path / planted).symlink_to(target)
    script = tmp_path / "job.py"
    script.write_text("open('started', 'w').close()\n")
    result = subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", "rec.memtui", "job.py"],
        cwd=tmp_path, env=scrubbed_env(tmp_path / "rt"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "symbolic link" in lines[0], result.stderr
    assert not (tmp_path / "started").exists()
    assert target.read_bytes() == b"keep me"


# ----- D14: failures are recorded, and said as what they are -----------------------------------

FAULTS = """
import sys
import torch
from torch import nn
import memtui_agent
from memtui_agent.output import emitter

def broken(*args, **kwargs):
    raise RuntimeError("psutil exploded")

emitter.build_step = broken  # a fault while the step frame is built
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with memtui_agent.monitor(record="rec.memtui"):
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
"""


@pytest.mark.slow
def test_agent_faults_reach_the_recording_once(tmp_path: Path) -> None:
    """A fault building a step frame, and a refused runtime folder (reported before the
    recording existed), are in the recording's agent errors, each once."""
    (tmp_path / "rt").mkdir(mode=0o777)
    os.chmod(tmp_path / "rt", 0o777)  # group/other access: the agent refuses it
    result = subprocess.run(
        [sys.executable, "-c", FAULTS],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    recording = read_recording(tmp_path / "rec.memtui")
    components = [error.component for error in recording.agent_errors]
    assert components.count("socket") == 1, components
    assert components.count("frame") == 1, components
    assert any("psutil exploded" in error.message for error in recording.agent_errors)
    assert recording.end is not None and recording.end.status == "ok"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare to mount a tmpfs")
def test_a_full_disk_is_reported_as_such_not_as_killed(tmp_path: Path) -> None:
    """A job that exits 0 on a full tmpfs: `memtui run` says the recording is incomplete
    because the disk is full, not that the job was killed."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        from torch import nn
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(60):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        """)
    )
    inner = (
        f"mount -t tmpfs -o size=8k tmpfs {mount} || exit 77; "
        f"exec {sys.executable} -m memtui run --headless -o {mount}/rec.memtui {script}"
    )
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", inner], cwd=tmp_path, env=scrubbed_env(tmp_path / "rt"),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if result.returncode == 77 or "unshare failed" in result.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()[:200]}")
    assert result.returncode == 0, result.stderr
    summary = [line for line in result.stderr.splitlines() if line.startswith("memtui: job")]
    assert len(summary) == 1, result.stderr
    # The recording's last frame says so where it fitted, else the folder's free space does.
    assert "disk full" in summary[0] and "killed" not in summary[0]
    assert "recording stopped: disk full (ENOSPC)" in summary[0] or (
        "recording incomplete: disk full" in summary[0]
    )
