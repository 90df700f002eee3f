"""Reliability scenarios with real jobs: what must hold when the world misbehaves around the agent.

Each test starts real training processes (the agent installs process-global hooks, so every job
gets a fresh interpreter) with `MEMTUI_RUNTIME_DIR` pointing into the test's tmp dir. Numbers
asserted about piles are derived in the test from shapes and dtypes, or measured by the job
itself without the agent (its own saved-tensor hooks), never copied from the agent's output.
Jobs that only need to run to completion start together in one module fixture, so the file
stays fast on a two-core machine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from cli_harness import MEMTUI, scrubbed_env

from memtui.input.sources import LiveSource, SourceError
from memtui.model.recording import Recording, read_recording
from memtui_protocol import runtime_dir, schema, wire
from memtui_protocol.schema import ExitStatus

pytestmark = pytest.mark.slow  # every test here starts a torch job in a fresh interpreter

TIMEOUT_S = 120
NOBODY = 65534
FP32 = 4

PRELUDE = """\
import json, os, sys, threading, time
import torch
from torch import nn
import memtui_agent
torch.set_num_threads(1)

def result(**values):
    print("RESULT", json.dumps(values), flush=True)

def storage_key(t):
    return (str(t.device), t.untyped_storage().data_ptr())

class SavedCounter:
    # Independent activation count: unique non-parameter storages packed by autograd.
    def __init__(self, params):
        self.param_keys = {storage_key(p) for p in params}
        self.saved = {}

    def pack(self, t):
        key = storage_key(t)
        if key not in self.param_keys:
            self.saved[key] = t.untyped_storage()
        return t

    def total(self):
        return sum(s.nbytes() for s in self.saved.values())

def activations_of(model, run):
    # Bytes autograd saves for one forward of `run()`, counted without the agent.
    counter = SavedCounter(list(model.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = run()
    total = counter.total()
    del out
    return total

def wait_for(name, timeout=60.0):
    deadline = time.time() + timeout
    while not os.path.exists(name) and time.time() < deadline:
        time.sleep(0.01)
"""


def _source(body: str) -> str:
    return PRELUDE + textwrap.dedent(body)


def _popen(
    folder: Path, body: str, *args: str, runtime: Path | None = None, stdin: bool = False
) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-c", _source(body), *args],
        cwd=folder,
        env=scrubbed_env(runtime or folder / "rt", PYTHONUNBUFFERED="1"),
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _expect_line(process: subprocess.Popen[str], expected: str) -> str:
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith(expected):
        process.kill()
        _, stderr = process.communicate(timeout=TIMEOUT_S)
        pytest.fail(f"expected {expected!r} from the job, got {line!r}; stderr:\n{stderr}")
    return line


@dataclass
class Finished:
    """A job that ran to its end: exit code, output, and its recording when it made one."""

    code: int
    stdout: str
    stderr: str
    folder: Path

    @property
    def results(self) -> dict[str, Any]:
        """The values the job printed with `result(...)`."""
        merged: dict[str, Any] = {}
        for line in self.stdout.splitlines():
            if line.startswith("RESULT "):
                merged.update(json.loads(line.removeprefix("RESULT ")))
        return merged

    def recording(self) -> Recording:
        """The job's recording, which must be whole (no torn tail)."""
        recording = read_recording(self.folder / "rec.memtui")
        assert recording.warning is None, recording.warning
        return recording

    def memtui_lines(self) -> list[str]:
        """What the agent said on stderr."""
        return [line for line in self.stderr.splitlines() if line.startswith("memtui")]


def _finish(process: subprocess.Popen[str], folder: Path) -> Finished:
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        pytest.fail(f"job in {folder} did not finish in {TIMEOUT_S}s:\n{stderr}")
    return Finished(process.returncode, stdout, stderr, folder)


def _read_until_end(sock: socket.socket, timeout: float = 60.0) -> list[schema.Message]:
    """Read a live stream until the job's `End` (or its socket closes)."""
    decoder = wire.FrameDecoder()
    messages: list[schema.Message] = []
    sock.settimeout(timeout)
    while not messages or not isinstance(messages[-1], schema.End):
        data = sock.recv(1 << 16)
        if not data:
            break
        messages.extend(decoder.feed(data))
    return messages


def _steps(messages: list[schema.Message]) -> list[int]:
    return [message.step for message in messages if isinstance(message, schema.Step)]


# ----- jobs that only have to run to their end, started together ------------------------------

DISK_FULL = """
torch.manual_seed(0)

def train():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(5):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        print("step", step, repr(loss.item()), flush=True)
    print("final", repr(sum(float(p.detach().double().sum()) for p in model.parameters())))

if sys.argv[1] == "agent":
    # Writes past 1 KiB fail (EFBIG) as they would on a full disk; the job writes no files.
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    with memtui_agent.monitor(record="rec.memtui"):
        train()
else:
    train()
"""

TWO_THREADS = """
class SideNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))

torch.manual_seed(0)
main = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
side = SideNet()
x = torch.randn(8, 16)
expected = activations_of(main, lambda: main(x).pow(2).mean())
with memtui_agent.monitor(record="rec.memtui"):
    opt = torch.optim.SGD(main.parameters(), lr=0.1, momentum=0.9)
    started, stop, calls = threading.Event(), threading.Event(), [0]

    def side_forwards():
        with torch.no_grad():
            while not stop.is_set():
                side(torch.randn(32, 64))
                calls[0] += 1
                started.set()

    thread = threading.Thread(target=side_forwards)
    thread.start()
    started.wait(30)
    for _ in range(6):
        opt.zero_grad()
        main(x).pow(2).mean().backward()
        opt.step()
        time.sleep(0.005)
    calls_during = calls[0]
    stop.set()
    thread.join()
result(activations=expected, side_calls=calls_during)
"""

COMPILED = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
x = torch.randn(8, 16)
expected = activations_of(model, lambda: model(x).pow(2).mean())
with memtui_agent.monitor(record="rec.memtui"):
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(4):
        opt.zero_grad()
        compiled(x).pow(2).mean().backward()
        opt.step()
import torch._dynamo.utils as dynamo_utils
result(
    activations=expected,
    compiled=type(compiled).__name__,
    graphs=dynamo_utils.counters["stats"]["unique_graphs"],
    breaks=sorted(why.splitlines()[1].strip() for why in dynamo_utils.counters["graph_break"]),
)
"""

CHECKPOINTED = """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)

torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui"):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()
result(tensors=len(list(model.parameters())))
"""

BATCH: dict[str, tuple[str, tuple[str, ...]]] = {
    "disk_full": (DISK_FULL, ("agent",)),
    "disk_full_plain": (DISK_FULL, ("plain",)),
    "two_threads": (TWO_THREADS, ()),
    "compiled": (COMPILED, ()),
    "checkpointed": (CHECKPOINTED, ()),
}


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Finished]:
    """Run every job of `BATCH` concurrently (each in its own folder) and collect them."""
    root = tmp_path_factory.mktemp("batch")
    running = {
        name: _popen(root / name, body, *args, runtime=root / "rt")
        for name, (body, args) in BATCH.items()
    }
    return {name: _finish(process, root / name) for name, process in running.items()}


def _weights(*shapes: tuple[int, ...]) -> int:
    total = 0
    for shape in shapes:
        count = 1
        for size in shape:
            count *= size
        total += count
    return total * FP32


def _linear(inputs: int, outputs: int) -> tuple[tuple[int, int], tuple[int]]:
    return (outputs, inputs), (outputs,)


def test_disk_full_turns_recording_off_and_leaves_the_job_alone(batch: dict[str, Finished]) -> None:
    """A failing recording (writes past a 1 KiB size limit, as on a full disk) must not change or
    stop the job: exit 0, the job's own output identical to a run without memtui, one memtui
    line on stderr."""
    job, plain = batch["disk_full"], batch["disk_full_plain"]
    assert plain.code == 0, plain.stderr
    assert job.code == 0, job.stderr
    assert job.stdout == plain.stdout
    assert "final" in job.stdout
    lines = job.memtui_lines()
    assert len(lines) == 1, job.stderr
    assert "recording failed" in lines[0] and "File too large" in lines[0]
    assert "the job continues" in lines[0]


def test_forward_on_a_second_thread_is_ignored_and_the_main_model_is_exact(
    batch: dict[str, Finished],
) -> None:
    """The agent follows only the thread that started it (tracker `_module_pre` gating): a
    concurrent no-grad forward of another model on a second thread neither registers that
    model nor disturbs the main thread's counts or module stack."""
    job = batch["two_threads"]
    assert job.code == 0, job.stderr
    assert job.results["side_calls"] > 0, "the side thread never ran during training"
    recording = job.recording()
    weights = _weights(*_linear(16, 32), *_linear(32, 4))
    assert [step.step for step in recording.steps] == [1, 2, 3, 4, 5, 6]
    for step in recording.steps:
        assert step.end == schema.Piles(weights, weights, weights, 0), step.step
        assert step.max.activations == job.results["activations"], step.step
    assert not any("fc1" in name or "SideNet" in name for name in recording.module_names.values())
    assert recording.agent_errors == []
    assert recording.end is not None and recording.end.status == "ok"
    assert job.memtui_lines() == []


def test_compiled_model_is_counted_like_eager(batch: dict[str, Finished]) -> None:
    """`torch.compile` (eager backend) wraps the model in an OptimizedModule that shares its
    parameters: weights, gradients and momentum count once, activations as in eager."""
    job = batch["compiled"]
    assert job.code == 0, job.stderr
    assert job.results["compiled"] == "OptimizedModule"
    recording = job.recording()
    weights = _weights(*_linear(16, 32), *_linear(32, 4))
    assert [step.step for step in recording.steps] == [1, 2, 3, 4]
    unknown = []
    for step in recording.steps:
        assert step.end.weights == step.end.gradients == step.end.optimizer_state == weights
        if not step.activations_measured and step.activations_from is None:
            unknown.append(step.step)  # said "not known": no figure stated
            continue
        assert step.end.activations == 0, step.step
        assert step.max.activations == job.results["activations"], step.step
    # Arming the hooks again makes dynamo recompile, which moves the heap a repeat is checked
    # against: the first repeat after the measured steps may say "not known", never a wrong
    # figure.
    assert len(unknown) <= 1, unknown
    assert recording.agent_errors == []
    assert recording.end is not None and recording.end.status == "ok"


def test_checkpointed_blocks_raise_the_limit_alert_and_count_state_exactly(
    batch: dict[str, Finished],
) -> None:
    """Inside `checkpoint(use_reentrant=False)` the checkpoint's hooks shadow the agent's
    (docs/design.md#measured-facts-to-build-on): the user is told once (`checkpoint_limit`), the
    persistent piles stay exact and no activation is left counted after a step."""
    job = batch["checkpointed"]
    assert job.code == 0, job.stderr
    recording = job.recording()
    block = (*_linear(32, 64), *_linear(64, 32))
    weights = _weights(*block, *block, *block, *_linear(32, 1))
    tensors = 3 * 4 + 2
    assert job.results["tensors"] == tensors
    # AdamW: two fp32 moments per value and a 4-byte step tensor per parameter tensor.
    optimizer_state = 2 * weights + 4 * tensors
    checkpoint = [item for item in recording.alerts if item.alert.kind == "checkpoint_limit"]
    assert len(checkpoint) == 1 and checkpoint[0].step == 1
    assert [step.step for step in recording.steps] == [1, 2, 3]
    for step in recording.steps:
        assert step.end == schema.Piles(weights, weights, optimizer_state, 0), step.step
        # The head's input is saved outside any checkpointed region: still counted.
        assert step.max.counted()[3] > 0
    assert recording.agent_errors == []
    assert recording.end is not None and recording.end.status == "ok"


def test_compiled_model_still_compiles_under_the_agent(batch: dict[str, Finished]) -> None:
    """Monitoring must not change what the job runs: the model still becomes a graph."""
    job = batch["compiled"]
    assert job.code == 0, job.stderr
    assert job.results["breaks"] == []
    assert job.results["graphs"] >= 1


# ----- socket security -------------------------------------------------------------------------

WAITING = """
with memtui_agent.monitor(record="rec.memtui"):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    print("READY", os.getpid(), flush=True)
    sys.stdin.readline()
print("DONE", flush=True)
"""


@pytest.fixture
def waiting_job(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A monitored job that has closed 3 steps and waits for a line on stdin."""
    job = _popen(tmp_path / "job", WAITING, runtime=tmp_path / "rt", stdin=True)
    try:
        _expect_line(job, "READY")
        yield job, tmp_path / "rt"
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate(timeout=TIMEOUT_S)


def test_runtime_files_are_private_and_no_network_listener(
    waiting_job: tuple[subprocess.Popen[str], Path],
) -> None:
    """Only this user may reach a job: dir 0700, socket and sidecar 0600, and the agent opens
    no TCP/UDP socket at all (its only endpoint is the Unix socket)."""
    job, runtime = waiting_job
    socket_path = runtime / f"{job.pid}.sock"
    sidecar = runtime / f"{job.pid}.json"
    assert stat.S_IMODE(os.lstat(runtime).st_mode) == 0o700
    assert stat.S_ISSOCK(os.lstat(socket_path).st_mode)
    assert stat.S_IMODE(os.lstat(socket_path).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(sidecar).st_mode) == 0o600
    process = psutil.Process(job.pid)
    assert process.net_connections(kind="inet") == []
    unix = [connection.laddr for connection in process.net_connections(kind="unix")]
    assert str(socket_path) in unix
    assert job.stdin is not None
    job.stdin.write("go\n")
    job.stdin.flush()
    assert job.wait(timeout=TIMEOUT_S) == 0


def test_socket_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """A socket someone else owns could be an impostor feeding fake frames: the viewer refuses
    it before connecting, and `memtui attach --socket` says so in one line, exit 1."""
    folder = tmp_path / "foreign"
    folder.mkdir(mode=0o700)
    path = folder / "4242.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        listener.listen(4)
        listener.setblocking(False)
        os.chown(path, NOBODY, NOBODY)
        with pytest.raises(SourceError, match="another user"):
            LiveSource(path).check()
        result = subprocess.run(
            [*MEMTUI, "attach", "--socket", str(path)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=scrubbed_env(tmp_path / "rt", PYTHONUNBUFFERED="1"),
        )
        assert result.returncode == 1, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and "another user" in lines[0], result.stderr
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected to the foreign socket
    finally:
        listener.close()


def test_runtime_dir_owned_by_another_user_disables_only_the_socket(tmp_path: Path) -> None:
    """A runtime dir someone else owns is never used: the socket is off (one line), the job
    and its recording go on."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    os.chown(runtime, NOBODY, NOBODY)
    body = WAITING.replace("sys.stdin.readline()", "pass")
    job = _finish(_popen(tmp_path / "job", body, runtime=runtime), tmp_path / "job")
    assert job.code == 0, job.stderr
    lines = job.memtui_lines()
    assert len(lines) == 1 and "socket failed" in lines[0] and "owned by uid" in lines[0]
    assert list(runtime.iterdir()) == []
    recording = job.recording()
    assert len(recording.steps) == 3 and recording.end is not None


# ----- many viewers, slow viewers --------------------------------------------------------------

VIEWERS = """
with memtui_agent.monitor(record="rec.memtui"):
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 501):
        opt.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        if step == 2:
            print("READY", flush=True)
        if step == 400:
            wait_for("viewers-done")
        if step == 450:
            print("LATE", flush=True)
            wait_for("late-connected")
        time.sleep(0.001)
print("DONE", flush=True)
"""


def _viewer_cycles(
    path: str, cycles: int, seed: int, got: list[list[schema.Message]], errors: list[str]
) -> None:
    """Connect, read a random amount, drop the connection (sometimes with a reset)."""
    rng = random.Random(seed)
    for _ in range(cycles):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(20)
                sock.connect(path)
                want = rng.choice([1, 7, 100, 1000, 4096])
                data = b""
                while len(data) < want:
                    chunk = sock.recv(want - len(data))
                    if not chunk:
                        break
                    data += chunk
                got.append(list(wire.FrameDecoder().feed(data)))
                if rng.random() < 0.5:
                    linger = (1).to_bytes(4, "little") + (0).to_bytes(4, "little")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        except Exception as exc:
            errors.append(repr(exc))


def test_five_viewers_attaching_and_detaching_in_a_loop(tmp_path: Path) -> None:
    """Viewers come and go (some mid-frame, some with a reset) while the job steps: the job
    never notices, records every step, and a late viewer still starts with hello and names."""
    folder = tmp_path / "job"
    job = _popen(folder, VIEWERS, runtime=tmp_path / "rt")
    _expect_line(job, "READY")
    path = str(tmp_path / "rt" / f"{job.pid}.sock")
    got: list[list[schema.Message]] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=_viewer_cycles, args=(path, 10, seed, got, errors))
        for seed in range(5)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    (folder / "viewers-done").touch()
    assert errors == []
    assert len(got) == 50
    for messages in got:
        if messages:
            assert isinstance(messages[0], schema.Hello) and messages[0].pid == job.pid
        if len(messages) > 1:
            assert isinstance(messages[1], schema.Names)
    _expect_line(job, "LATE")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as late:
        late.connect(path)
        (folder / "late-connected").touch()
        messages = _read_until_end(late)
    started = time.monotonic()
    finished = _finish(job, folder)
    assert finished.code == 0, finished.stderr
    assert time.monotonic() - started < 30
    assert isinstance(messages[0], schema.Hello) and messages[0].pid == job.pid
    assert isinstance(messages[1], schema.Names)
    assert _steps(messages) == list(range(1, 501))
    assert isinstance(messages[-1], schema.End) and messages[-1].status == "ok"
    recording = finished.recording()
    assert [step.step for step in recording.steps] == list(range(1, 501))
    assert recording.end is not None and recording.end.status == "ok"
    assert finished.memtui_lines() == []


IDLE_VIEWER = """
with memtui_agent.monitor(record="rec.memtui"):
    w = nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([w], lr=0.01, foreach=False)
    (w * torch.ones(2)).sum().backward()
    for step in range(1, 10_001):
        opt.step()  # the gradient stays: each call is one closed step
        if step == 2:
            print("READY", flush=True)
            wait_for("viewer-connected")
print("DONE", flush=True)
"""


def test_viewer_that_never_reads_for_10000_steps(tmp_path: Path) -> None:
    """A viewer that connects and never reads (a frozen terminal, a suspended ssh) must cost
    the job nothing: 10,000 steps complete and are recorded; what that viewer does get is a
    clean prefix of the stream. (The step is just `opt.step()` on a 2-value parameter: the
    frame volume is the point, and it keeps the test to seconds.)"""
    folder = tmp_path / "job"
    job = _popen(folder, IDLE_VIEWER, runtime=tmp_path / "rt")
    _expect_line(job, "READY")
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    idle.connect(str(tmp_path / "rt" / f"{job.pid}.sock"))
    try:
        (folder / "viewer-connected").touch()
        finished = _finish(job, folder)
        idle.settimeout(10)
        data = bytearray()
        while chunk := idle.recv(1 << 16):
            data += chunk
    finally:
        idle.close()
    assert finished.code == 0, finished.stderr
    assert "DONE" in finished.stdout
    recording = finished.recording()
    assert [step.step for step in recording.steps] == list(range(1, 10_001))
    assert all(step.dropped == 0 for step in recording.steps)
    assert recording.end is not None and recording.end.status == "ok"
    assert finished.memtui_lines() == []
    decoder = wire.FrameDecoder()
    seen = list(decoder.feed(bytes(data)))  # a WireError here would fail the test
    assert isinstance(seen[0], schema.Hello)
    steps = _steps(seen)
    assert steps == list(range(1, len(steps) + 1))


# ----- crashes ---------------------------------------------------------------------------------

ZYGOTE = """
# Imports torch once; every job is a fork of this process, so 15 jobs cost one import. The
# first optimizer step imports torch._dynamo (over a second): do that here too, and load the
# agent's modules, without starting the agent.
import torch._dynamo
import memtui_agent.startup.agent, memtui_agent.output.emitter, memtui_agent.hooks.tracker

warm = nn.Parameter(torch.zeros(2))
warm.grad = torch.ones(2)
torch.optim.SGD([warm], lr=0.1).step()

def job(folder):
    os.chdir(folder)
    with memtui_agent.monitor(record="rec.memtui"):
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(2, 4)
        step = 0
        while True:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            step += 1
            if step == 3:
                print("READY", os.getpid(), flush=True)

for line in sys.stdin:
    command, argument = line.split()
    if command == "run":
        if os.fork() == 0:
            try:
                job(argument)
            finally:
                os._exit(1)
    elif command == "reap":
        _, status = os.waitpid(int(argument), 0)
        print("REAPED", status, flush=True)
"""

KILLS = 15


def test_sigkill_at_random_moments_leaves_a_consistent_recording(tmp_path: Path) -> None:
    """SIGKILL gives the agent no chance to finish: whatever is on disk must still read, as
    'killed', with steps 1..n and no gap, and at most a torn last frame."""
    rng = random.Random(20260101)
    zygote = _popen(tmp_path / "zygote", ZYGOTE, runtime=tmp_path / "rt", stdin=True)
    assert zygote.stdin is not None
    try:
        for attempt in range(KILLS):
            folder = tmp_path / f"kill{attempt}"
            folder.mkdir()
            zygote.stdin.write(f"run {folder}\n")
            zygote.stdin.flush()
            pid = int(_expect_line(zygote, "READY").split()[1])
            delay = rng.uniform(0.3, 1.5)
            time.sleep(delay)
            os.kill(pid, signal.SIGKILL)
            zygote.stdin.write(f"reap {pid}\n")
            zygote.stdin.flush()
            status = int(_expect_line(zygote, "REAPED").split()[1])
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            where = f"kill {attempt} after {delay:.2f}s"
            recording = read_recording(folder / "rec.memtui")
            assert recording.hello.pid == pid, where
            assert recording.end is None, where
            assert recording.how_it_ended() is ExitStatus.KILLED, where
            steps = [step.step for step in recording.steps]
            assert len(steps) >= 3, where
            assert steps == list(range(1, len(steps) + 1)), where
            assert recording.warning is None or "partial frame" in recording.warning, (
                where,
                recording.warning,
            )
    finally:
        zygote.kill()
        zygote.communicate(timeout=TIMEOUT_S)


def test_stale_socket_and_sidecar_of_a_killed_job_are_cleaned_up(
    waiting_job: tuple[subprocess.Popen[str], Path],
) -> None:
    """A SIGKILLed job leaves its socket and sidecar behind; the next listing removes both and
    shows no job, so `memtui attach` never offers a dead one."""
    job, runtime = waiting_job
    job.kill()
    job.communicate(timeout=TIMEOUT_S)
    socket_path = runtime / f"{job.pid}.sock"
    sidecar = runtime / f"{job.pid}.json"
    assert socket_path.exists() and sidecar.exists()
    assert runtime_dir.live_sidecars(runtime) == []
    assert not socket_path.exists()
    assert not sidecar.exists()
    result = subprocess.run(
        [*MEMTUI, "attach"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=scrubbed_env(runtime, PYTHONUNBUFFERED="1"),
    )
    assert result.returncode == 1
    assert "no live memtui jobs" in result.stderr
