"""`memtui attach PID` into a job started without memtui, `detach`, and every refusal.

The job is `fixtures/plain_train.py`, started with plain `python`: it prints each step's loss
bits and its own count of weights, gradients and optimizer state, and whether any hook is
installed. The attach happens at whatever step the job has reached (the tests never guess a
time): the job runs 8 more steps once the test drops its stop file.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui, scrubbed_env
from repo_paths import FIXTURES, REPO

from memtui.commands.attach_inject import XSTATE_FAULT, gdb_literal, gdb_script, runner_lines
from memtui.commands.attach_target import (
    AttachRefused,
    check_target,
    has_capability,
    ptrace_refusal,
    ptrace_scope,
    python_version,
)
from memtui.model.recording import read_recording

pytestmark = pytest.mark.slow  # each test starts a torch job or two

TRAIN = FIXTURES / "plain_train.py"
BOOT = REPO / "agent" / "memtui_agent" / "attach" / "boot.py"


def _gdb_can_call_functions() -> bool:
    """Whether gdb here can call a function inside a traced process. gdb 13 cannot on CPUs with
    AMX state (it fails to write the registers back): attaching is then refused in one line
    (`test_gdb_xstate_fault_is_explained`), and nothing can be injected on this machine."""
    if shutil.which("gdb") is None:
        return False
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        probe = subprocess.run(
            ["gdb", "-batch", "-nx", "-p", str(sleeper.pid), "-ex", "call (int) getpid()"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return False
    finally:
        sleeper.kill()
        sleeper.wait()
    return XSTATE_FAULT not in probe.stdout + probe.stderr


needs_gdb = pytest.mark.skipif(
    sys.version_info >= (3, 14) or not _gdb_can_call_functions(),
    reason="gdb delivery (3.10-3.13) with a gdb that can call functions in a process here",
)


class Job:
    """A plain training job and the JSON lines it prints, read on a thread."""

    def __init__(self, args: list[str], env: dict[str, str], **popen: Any) -> None:
        self.lines: list[dict[str, Any]] = []
        self.process = subprocess.Popen(
            [sys.executable, str(TRAIN), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            **popen,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(json.loads(line))

    def wait_for_step(self, step: int, seconds: float = 60.0) -> None:
        deadline = time.monotonic() + seconds
        while not self.lines or self.lines[-1]["step"] < step:
            assert self.process.poll() is None, self.process.stderr.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the job did not reach its step"
            time.sleep(0.02)

    def finish(self) -> tuple[int, str]:
        code = self.process.wait(timeout=120)
        self._reader.join(timeout=120)  # the pipe ends with the process: a safety net only
        assert self.process.stderr is not None
        return code, self.process.stderr.read()

    def kill(self) -> None:
        """End the job and close its pipes now, never at some later garbage collection (the
        frames of a failed test keep this object: its pipes then closed inside another test,
        whose descriptor count changed, test_job_host.py's `open fds: 19 -> 17`)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=120)
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


UNTIL_STOPPED = "1000000"
"""The jobs' step cap: far past any test (they end on the stop file), since 3,000 steps of 20 ms
ran out under load before a gdb attach and detach were done ("pid N ended while memtui waited
for it" in a CI beside other work): no test may depend on how fast the machine is."""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The job and memtui share one private runtime folder (the agent runs in the job)."""
    return scrubbed_env(tmp_path / "rt")


def memtui(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return run_memtui(*args, env=env)


def plain_losses(steps: int, env: dict[str, str], flags: tuple[str, ...] = ()) -> list[str]:
    job = Job([str(steps), *flags], env)
    try:
        code, stderr = job.finish()
    finally:
        job.kill()
    assert code == 0, stderr
    return [line["loss"] for line in job.lines]


def expected_activations() -> int:
    """The fixture's saved activations per step, counted with torch's own saved-tensor hooks
    (unique storages, parameters excluded), in this process, independently of the agent."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = torch.nn.functional.mse_loss(model(torch.randn(16, 32)), torch.randn(16, 1))
    loss.backward()
    return sum(seen.values())


@needs_gdb
def test_attach_records_later_steps_exactly_and_detach_leaves_job_unchanged(
    tmp_path: Path, env: dict[str, str]
) -> None:
    stop = tmp_path / "stop"
    out = tmp_path / "attached.memtui"
    job = Job([UNTIL_STOPPED, str(stop)], env)
    try:
        job.wait_for_step(3)
        attached = memtui("attach", str(job.process.pid), "--headless", "-o", str(out), env=env)
        assert attached.returncode == 0, attached.stderr
        assert attached.stdout.strip() == str(out)
        assert f"attached to pid {job.process.pid}" in attached.stderr
        job.wait_for_step(job.lines[-1]["step"] + 3)
        detached = memtui("detach", str(job.process.pid), env=env)
        assert detached.returncode == 0, detached.stderr
        assert "the job carries on" in detached.stderr
        stop.touch()
        code, stderr = job.finish()
    finally:
        job.kill()
    assert code == 0, stderr
    assert "memtui" not in stderr  # nothing on the job's own stderr

    recording = read_recording(out)
    assert recording.end is not None and recording.end.status == "detached"
    steps = recording.steps
    assert len(steps) >= 2
    first_alerts = [alert for alert in steps[0].alerts if alert.kind == "attached"]
    assert len(first_alerts) == 1
    job_step = int(first_alerts[0].message.split()[3].rstrip(":"))  # "attached at step N: ..."
    assert first_alerts[0].message.endswith(f"steps 1-{job_step - 1} were not recorded")
    assert job_step > 1
    assert not any(
        a.kind in {"first_step_forecast", "first_step_growth"} for s in steps for a in s.alerts
    )
    by_step = {line["step"]: line for line in job.lines}
    activations = expected_activations()
    for offset, step in enumerate(steps):
        own = by_step[job_step + offset]
        assert step.step == job_step + offset  # the job's own step numbers
        assert step.optimizer == "AdamW#1" and step.optimizer_step == step.step
        assert step.microbatches == 1
        assert step.end.weights == own["weights"] == 2177 * 4
        assert step.end.gradients == own["gradients"]
        assert step.end.optimizer_state == own["optimizer_state"]
        assert step.max.activations == activations
        assert step.loss == float.fromhex(own["loss"])
        assert own["hooks"] > 0  # the agent's hooks were in place for every recorded step
    # After the detach: no hook of any kind left in the job.
    last_recorded = job_step + len(steps) - 1
    after = [line for line in job.lines if line["step"] > last_recorded + 1]
    assert after and all(line["hooks"] == 0 for line in after)
    # Same losses as the job run alone, bit for bit.
    assert [line["loss"] for line in job.lines] == plain_losses(len(job.lines), env)
    report = memtui("report", str(out), "--json", env=env)
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    assert summary["exit"]["status"] == "detached"
    assert summary["peaks"]["first_step"] is None  # the job's first update was before the attach
    text = memtui("report", str(out), env=env).stdout
    assert "job detached" in text and "peak after the attach" in text


@needs_gdb
def test_attach_job_without_optimizer_closes_steps_at_backward(
    tmp_path: Path, env: dict[str, str]
) -> None:
    stop = tmp_path / "stop"
    out = tmp_path / "backward.memtui"
    job = Job([UNTIL_STOPPED, str(stop), "--no-optimizer"], env)
    try:
        job.wait_for_step(2)
        attached = memtui("attach", str(job.process.pid), "--headless", "-o", str(out), env=env)
        assert attached.returncode == 0, attached.stderr
        stop.touch()
        code, stderr = job.finish()
    finally:
        job.kill()
    assert code == 0, stderr
    recording = read_recording(out)
    assert recording.end is not None and recording.end.status == "ok"
    assert recording.steps and recording.steps[0].alerts[0].kind == "attached"
    assert "unknown step" in recording.steps[0].alerts[0].message
    activations = expected_activations()
    losses = {float.fromhex(line["loss"]) for line in job.lines}
    for step in recording.steps:
        assert step.end.weights == 2177 * 4
        assert step.max.activations == activations
        assert step.loss in losses
    # The job's last steps are the recording's last steps.
    assert recording.steps[-1].loss == float.fromhex(job.lines[-1]["loss"])
    assert [line["loss"] for line in job.lines] == plain_losses(
        len(job.lines), env, ("--no-optimizer",)
    )


# ----- refusals: one line each, exit 1, the job untouched ----------------------------------------


@pytest.fixture(scope="module")
def torch_job() -> Any:
    """A Python process that imported torch and idles (module-wide: refusals never touch it)."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import torch, time\nwhile True: time.sleep(0.05)"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while "libtorch_python" not in Path(f"/proc/{process.pid}/maps").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield process
    process.kill()
    process.wait()


def _refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("memtui: cannot attach: ")
    for word in words:
        assert word in lines[0]


def _untouched(process: subprocess.Popen[Any]) -> None:
    assert process.poll() is None
    status = Path(f"/proc/{process.pid}/status").read_text()
    assert "TracerPid:\t0" in status


def test_refuses_dead_pid(env: dict[str, str]) -> None:
    process = subprocess.Popen(["true"])
    process.wait()
    _refused(memtui("attach", str(process.pid), "--headless", env=env), "no process")


def test_refuses_non_python_process(env: dict[str, str]) -> None:
    process = subprocess.Popen(["sleep", "30"])
    try:
        _refused(memtui("attach", str(process.pid), "--headless", env=env), "not a Python")
        _untouched(process)
    finally:
        process.kill()
        process.wait()


def test_refuses_python_without_torch(env: dict[str, str]) -> None:
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        _refused(memtui("attach", str(process.pid), "--headless", env=env), "not imported torch")
        _untouched(process)
    finally:
        process.kill()
        process.wait()


@pytest.mark.skipif(os.getuid() != 0, reason="starting another user's process needs root")
def test_refuses_another_users_process(env: dict[str, str]) -> None:
    process = subprocess.Popen(["sleep", "30"], user=65534)
    try:
        result = memtui("attach", str(process.pid), "--headless", env=env)
        _refused(result, f"process {process.pid} belongs to ", "attaches to your own processes")
        assert "sysctl" not in result.stderr
        _untouched(process)
    finally:
        process.kill()
        process.wait()


def test_refuses_when_remote_debugging_is_disabled(env: dict[str, str]) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", "import torch, time; time.sleep(60)"],
        env=dict(env, PYTHON_DISABLE_REMOTE_DEBUG="1"),
    )
    try:
        deadline = time.monotonic() + 60
        while "libtorch_python" not in Path(f"/proc/{process.pid}/maps").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _refused(
            memtui("attach", str(process.pid), "--headless", env=env),
            "PYTHON_DISABLE_REMOTE_DEBUG",
        )
        _untouched(process)
    finally:
        process.kill()
        process.wait()


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14+ delivers without gdb")
def test_refuses_without_gdb_and_says_how_to_install_it(
    tmp_path: Path, env: dict[str, str], torch_job: Any
) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    result = memtui("attach", str(torch_job.pid), "--headless", env=dict(env, PATH=str(empty)))
    _refused(result, "gdb is needed", "apt-get install gdb")
    _untouched(torch_job)


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14+ delivers without gdb")
def test_refuses_when_ptrace_is_not_permitted(
    tmp_path: Path, env: dict[str, str], torch_job: Any
) -> None:
    """gdb answering as it does under Yama or Docker without SYS_PTRACE."""
    fake = tmp_path / "bin" / "gdb"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\necho 'ptrace: Operation not permitted.'\necho 'No symbol table is loaded.'\n"
        "exit 1\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    path = f"{fake.parent}{os.pathsep}{env['PATH']}"
    result = memtui("attach", str(torch_job.pid), "--headless", env=dict(env, PATH=path))
    _refused(result, f"gdb could not trace pid {torch_job.pid}: ")
    # The sysctl is named only where Yama exists and forbids the trace, with its value.
    scope = ptrace_scope()
    if scope in (1, 2) and not has_capability(19, Path("/proc/self/status")):
        assert f"kernel.yama.ptrace_scope={scope}" in result.stderr
    else:
        assert "sysctl" not in result.stderr and "although it is yours" in result.stderr
    _untouched(torch_job)


def test_ptrace_policy_is_read_before_tracing(tmp_path: Path) -> None:
    scope = tmp_path / "ptrace_scope"
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000000000\n")
    scope.write_text("0\n")
    assert ptrace_refusal(scope, status) is None
    scope.write_text("1\n")
    problem = ptrace_refusal(scope, status)
    assert problem is not None and "kernel.yama.ptrace_scope=1: a process may trace" in problem
    assert "CAP_SYS_PTRACE" in problem and "--cap-add=SYS_PTRACE" in problem
    assert "sysctl kernel.yama.ptrace_scope=0" in problem
    status.write_text(f"CapEff:\t{1 << 19:016x}\n")
    assert has_capability(19, status)
    assert ptrace_refusal(scope, status) is None
    scope.write_text("3\n")
    assert "until reboot" in (ptrace_refusal(scope, status) or "")
    assert ptrace_refusal(tmp_path / "absent", status) is None  # no Yama


def test_refuses_another_python_version(monkeypatch: pytest.MonkeyPatch, torch_job: Any) -> None:
    import memtui.commands.attach_target as attach_target

    assert python_version("7f.. /usr/lib/libpython3.12.so.1.0\n", "/usr/bin/python3") == (3, 12)
    assert python_version("", "/usr/bin/python3.10") == (3, 10)
    assert python_version("", "/usr/bin/sleep") is None
    monkeypatch.setattr(attach_target, "python_version", lambda maps, exe: (3, 99))
    with pytest.raises(AttachRefused, match=r"runs Python 3\.99 and this memtui runs on"):
        check_target(torch_job.pid)
    _untouched(torch_job)


def test_attach_with_the_tui_needs_a_terminal_before_touching_the_job(
    env: dict[str, str], torch_job: Any
) -> None:
    result = memtui("attach", str(torch_job.pid), env=env)
    assert result.returncode == 2
    assert "needs a terminal" in result.stderr and "--headless" in result.stderr
    _untouched(torch_job)


def test_detach_refuses_a_job_without_agent(env: dict[str, str], torch_job: Any) -> None:
    result = memtui("detach", str(torch_job.pid), env=env)
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"memtui: cannot detach: no memtui agent runs in pid {torch_job.pid}"
    )
    _untouched(torch_job)


# ----- the bootstrap on its own ------------------------------------------------------------------


def _request(tmp_path: Path, **fields: Any) -> Path:
    import msgspec
    import psutil

    import memtui_agent
    import memtui_protocol

    request = {
        "action": "attach",
        "pid": 0,
        "python": list(sys.version_info[:2]),
        "agent_dir": str(Path(memtui_agent.__file__).parent),
        "protocol_dir": str(Path(memtui_protocol.__file__).parent),
        "dependency_paths": sorted(
            {str(Path(m.__file__).parent.parent) for m in (msgspec, psutil)}  # type: ignore[arg-type]
        ),
        "reply": str(tmp_path / "reply.json"),
        "deadline": time.time() + 60,
    }
    request.update(fields)
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request))
    return path


def test_runner_lines_bind_nothing_and_swallow_every_error(tmp_path: Path) -> None:
    """What the pending call runs: a missing bootstrap raises nothing, binds no name."""
    namespace: dict[str, Any] = {"__builtins__": __builtins__}
    exec(runner_lines(tmp_path / "missing.py", tmp_path / "request.json"), namespace)
    assert set(namespace) == {"__builtins__"}
    script = gdb_script(runner_lines(Path("/tmp/a b'c/boot.py"), Path("/tmp/r.json")))
    assert "Py_AddPendingCall((void *) PyRun_SimpleString" in script
    assert gdb_literal('a"b\\c\n') == '"a\\"b\\\\c\\n"'


def test_bootstrap_refuses_a_process_without_torch(tmp_path: Path) -> None:
    request = _request(tmp_path)
    code = (
        "import json, os, time\n"
        f"r = json.load(open({str(request)!r})); r['pid'] = os.getpid()\n"
        f"json.dump(r, open({str(request)!r}, 'w'))\n"
        f"exec(open({str(BOOT)!r}).read(), {{'__name__': '__memtui_attach__', "
        f"'REQUEST': {str(request)!r}}})\n"
        f"while not os.path.exists({str(tmp_path / 'reply.json')!r}): time.sleep(0.01)\n"
        "import sys; print('torch' in sys.modules, 'memtui_agent' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
    reply = json.loads((tmp_path / "reply.json").read_text())
    assert reply == {"state": "refused", "message": "the job has not imported torch"}


def test_bootstrap_loads_memtuis_agent_into_a_python_without_it(tmp_path: Path) -> None:
    """A job whose environment lacks memtui_agent and msgspec: memtui's copy is loaded, memtui's
    environment is on sys.path for that import only; another Python version is refused."""
    bare = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
    if not Path(bare).exists():
        pytest.skip("needs a bare system Python of this version, without memtui")
    probe = subprocess.run([bare, "-c", "import msgspec"], capture_output=True, check=False)
    if probe.returncode == 0:
        pytest.skip("the system Python has msgspec")
    request = _request(tmp_path)
    code = (
        "import json, sys\n"
        f"ns = {{'__name__': 'boot'}}; exec(open({str(BOOT)!r}).read(), ns)\n"
        f"text = open({str(request)!r}).read()\n"
        "protocol_dir = json.loads(text)['protocol_dir']\n"
        "protocol = ns['load_package']('memtui_protocol', protocol_dir)\n"
        "import dataclasses, memtui_protocol.attach as attach\n"
        "request = attach.AttachRequest.from_json(text)\n"
        "before = list(sys.path)\n"
        "agent = ns['load_agent'](request)\n"
        "print(agent.__name__, sys.path == before, 'msgspec' in sys.modules)\n"
        "request = dataclasses.replace(request, python=(3, 10)); del sys.modules['memtui_agent']\n"
        "try:\n    ns['load_agent'](request)\nexcept RuntimeError as exc:\n    print(exc)\n"
    )
    result = subprocess.run([bare, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first == "memtui_agent True True"
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert f"runs Python {ours} and cannot import memtui_agent; memtui runs on 3.10" in second


def test_gdb_xstate_fault_is_explained() -> None:
    """gdb 13 on a CPU with AMX state (captured on this project's machines, 2026-12-01): any
    call into the process fails, which is said in one line, not as gdb's last line."""
    from memtui.commands.attach_inject import explain_gdb

    captured = (
        "MEMTUI_ATTACHED\n$1 = (void *) 0x7fd7c1e4ff20 <Py_AddPendingCall>\n"
        "$2 = (void *) 0x7fd7c1e9aec0 <PyRun_SimpleString>\nMEMTUI_PYTHON\n"
        'Thread 1 "python" hit Breakpoint 5, PyMem_Malloc (size=56) at Objects/obmalloc.c:617\n'
        "/tmp/attach.gdb:25: Error in sourced command file:\n"
        "Couldn't write extended state status: Bad address.\n"
        "[Inferior 1 (process 5387) detached]\n"
    )
    with pytest.raises(AttachRefused) as refused:
        explain_gdb(5387, captured, timed_out=False, seconds=20.0)
    message = str(refused.value)
    assert message.startswith("gdb could not call into pid 5387")
    assert "AMX" in message and "nothing was changed" in message
