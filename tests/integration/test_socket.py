"""Live viewers on the agent's Unix socket: hello and backlog first, and never a stalled job."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_harness import MEMTUI, scrubbed_env

from memtui_protocol import schema, wire

pytestmark = pytest.mark.slow  # each test starts a torch job or two

JOB = """
import sys, time, torch, memtui_agent
steps = int(sys.argv[1]); pause = float(sys.argv[2])
with memtui_agent.monitor(record="rec.memtui"):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        if step == 2:
            print("READY", flush=True)
        time.sleep(pause)
print("DONE", flush=True)
"""


def _start(tmp_path: Path, steps: int, pause: float) -> tuple[subprocess.Popen[str], Path]:
    runtime = tmp_path / "rt"
    env = scrubbed_env(runtime)
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(steps), str(pause)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert job.stdout is not None
    assert job.stdout.readline().strip() == "READY"
    return job, runtime


def _sidecar(runtime: Path, pid: int) -> dict[str, object]:
    sidecar: dict[str, object] = json.loads((runtime / f"{pid}.json").read_text())
    return sidecar


def _read_until(sock: socket.socket, predicate: object, timeout: float = 20.0) -> list[object]:
    decoder = wire.FrameDecoder()
    messages: list[object] = []
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = sock.recv(65536)
        if not data:
            break
        messages.extend(decoder.feed(data))
        if predicate(messages):  # type: ignore[operator]
            break
    return messages


def test_viewer_gets_hello_names_backlog_then_live_steps(tmp_path: Path) -> None:
    job, runtime = _start(tmp_path, steps=40, pause=0.02)
    info = _sidecar(runtime, job.pid)
    assert stat.S_IMODE(os.stat(runtime).st_mode) == 0o700
    socket_path = Path(str(info["socket"]))
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(socket_path))
        messages = _read_until(sock, lambda got: any(isinstance(m, schema.End) for m in got))
    job.wait(timeout=60)
    assert isinstance(messages[0], schema.Hello)
    assert messages[0].pid == job.pid
    assert isinstance(messages[1], schema.Names)
    steps = [m.step for m in messages if isinstance(m, schema.Step)]
    assert steps[0] <= 3  # the backlog held the steps before we connected
    assert steps == list(range(steps[0], 41))
    assert isinstance(messages[-1], schema.End)
    assert not (runtime / f"{job.pid}.json").exists()  # sidecar removed at exit
    assert not socket_path.exists()


def test_viewer_that_never_reads_does_not_stall_the_job(tmp_path: Path) -> None:
    job, runtime = _start(tmp_path, steps=3000, pause=0.0)
    socket_path = str(_sidecar(runtime, job.pid)["socket"])
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    idle.connect(socket_path)
    try:
        assert job.stdout is not None
        assert job.stdout.readline().strip() == "DONE"
        assert job.wait(timeout=120) == 0
    finally:
        idle.close()
    from memtui.model.recording import read_recording

    recording = read_recording(tmp_path / "rec.memtui")
    assert len(recording.steps) == 3000
    assert recording.end is not None and recording.end.status == "ok"


def test_viewer_killed_mid_stream_does_not_break_the_job(tmp_path: Path) -> None:
    job, runtime = _start(tmp_path, steps=200, pause=0.005)
    socket_path = str(_sidecar(runtime, job.pid)["socket"])
    for _ in range(5):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path)
        sock.recv(10)  # take part of the hello, then vanish mid-frame
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()
    assert job.wait(timeout=120) == 0
    from memtui.model.recording import read_recording

    assert len(read_recording(tmp_path / "rec.memtui").steps) == 200


def _forward_unix_socket(listen: Path, target: Path, chunk: int) -> threading.Thread:
    """What `ssh -L LISTEN.sock:TARGET.sock host` does on the viewer's side: a 0600 socket whose
    connections are relayed byte for byte (here in tiny chunks, to split frames anywhere)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(listen))
    os.chmod(listen, 0o600)
    server.listen(1)

    def pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(chunk):
                sink.sendall(data)
        except OSError:
            pass
        finally:  # pass the end on (a bare close would not wake the other direction's recv)
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        viewer, _ = server.accept()
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(str(target))
        threading.Thread(target=pump, args=(viewer, upstream), daemon=True).start()
        pump(upstream, viewer)
        server.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_attach_socket_through_a_forwarded_unix_socket(tmp_path: Path) -> None:
    """The multi-node recipe: `memtui attach --list` on the node prints the socket, the viewer's
    side gets it through a Unix-socket forward, and `LiveSource` (what `attach --socket` opens)
    reads the job through it with no sidecar and no pid of its own."""
    from memtui.input.sources import LiveSource

    job, runtime = _start(tmp_path, steps=60, pause=0.02)
    listing = subprocess.run(
        [*MEMTUI, "attach", "--list"],
        env=scrubbed_env(runtime),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    remote = Path(str(_sidecar(runtime, job.pid)["socket"]))
    assert listing.returncode == 0 and f"socket: {remote}" in listing.stdout
    forwarded = tmp_path / "forwarded" / "node1.sock"
    forwarded.parent.mkdir()
    _forward_unix_socket(forwarded, remote, chunk=7)
    source = LiveSource(forwarded)
    source.check()
    received: list[object] = []
    stop = threading.Event()
    reason = source.run(lambda batch: received.extend(batch), stop)
    job.wait(timeout=60)
    assert reason == "the job closed its socket"
    assert isinstance(received[0], schema.Hello) and received[0].pid == job.pid
    steps = [m.step for m in received if isinstance(m, schema.Step)]
    assert steps == list(range(1, 61))
    assert isinstance(received[-1], schema.End) and received[-1].status == "ok"
