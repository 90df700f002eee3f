"""Reliability, round three (issue 27), the job unharmed: J1-J4 with real jobs.

Each test compares what the job does under memtui with what it does without it, measured in the
same test: its losses bit for bit (J1), its own files (J3), how fast it dies of SIGTERM (J4). J2
runs a two-thread job many times in one interpreter (the crash it guards against came in most
runs of this job before issue 27). J5 and the planted links are in test_reliability_planted.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI, scrubbed_env
from repo_paths import FIXTURES

from memtui.commands.run_command import build_job
from memtui.commands.stop_record import record_stop
from memtui.input.job_process import JobProcess
from memtui.model.recording import read_recording
from memtui.model.step_rows import activations_known
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig

pytestmark = pytest.mark.slow  # every test here starts torch jobs

HOOKED = FIXTURES / "hooked_train.py"
TIMEOUT_S = 240


def _start(command: list[str], folder: Path) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        command,
        cwd=folder,
        env=scrubbed_env(folder / "rt"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str], what: str) -> tuple[str, str]:
    stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 0, f"{what}: exit {process.returncode}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, f"{what}:\n{stderr[-3000:]}"
    return stdout, stderr


# ----- J1: saved-tensor hooks of the job's own -------------------------------------------------


def test_jobs_with_their_own_saved_tensor_hooks_train_exactly_as_plain(tmp_path: Path) -> None:
    """Under the default `--activations auto`: checkpoint over the whole model (died at step 4),
    the job's own lossy pack hooks (37 of 40 losses differed), and an attach and detach into a
    job mixing its hooks, checkpoints and plain steps (200 of 300 differed): every loss is the
    plain run's, bit for bit. The steps whose forward ran under the job's hooks say their
    activations are not known, never a number."""
    cases = {"checkpoint": ("12",), "lossy": ("40",), "mixed": ("300",)}
    runs = {}
    for variant, args in cases.items():
        runs[f"{variant} plain"] = _start([sys.executable, str(HOOKED), variant, *args],
                                          tmp_path / variant / "plain")  # fmt: skip
        folder = tmp_path / variant / "memtui"
        if variant == "mixed":  # attach and detach delivered by the job to itself
            folder.mkdir(parents=True)
            command = [sys.executable, str(HOOKED), variant, *args, str(folder)]
        else:
            command = [*MEMTUI, "run", "--headless", "-o", "rec.memtui", str(HOOKED), variant]
            command += args
        runs[f"{variant} memtui"] = _start(command, folder)
    outputs = {name: _finish(process, name) for name, process in runs.items()}
    for variant, args in cases.items():
        plain, _ = outputs[f"{variant} plain"]
        under, stderr = outputs[f"{variant} memtui"]
        assert len(plain.splitlines()) == int(args[0])
        assert under == plain, f"{variant}: the losses differ from the plain run's"
        recording = read_recording(tmp_path / variant / "memtui" / "rec.memtui")
        assert recording.warning is None
        if variant == "mixed":
            assert "STATE attach started" in stderr and "STATE detach detached" in stderr
            assert recording.end is not None
            assert recording.end.status == schema.ExitStatus.DETACHED
        else:
            assert recording.end is not None and recording.end.status == schema.ExitStatus.OK
            assert len(recording.steps) == int(args[0])
            # Every forward ran under the job's hooks: no step may state a figure.
            assert not any(activations_known(step) for step in recording.steps), variant
        said = [a for a in recording.alerts if "job's own saved-tensor hooks" in a.alert.message]
        assert len(said) == 1, variant


# ----- J2: two models trained on two threads ---------------------------------------------------

TWO_THREADS = (FIXTURES / "two_threads.py").read_text()
RUNS = 24
"""Runs in one interpreter, each with an agent of its own: 6 of each arrangement."""
STEPS = 30


def _weights(width: int) -> int:
    """The fp32 bytes of one thread's model (16 -> width -> 1, with biases)."""
    return 4 * (16 * width + width + width + 1)


MODELS = (_weights(64), _weights(128))
"""The main thread's model (or the first worker's) and the second worker's."""
FOLLOWED = {1: 1, 3: 0}
"""Arrangement -> the thread the agent must follow: the one that steps first."""


def _one_threads_training(recording: Any, results: list[list[str]], arrangement: int) -> None:
    """The recording is one thread's whole training loop: its steps, its model's weights and
    gradients, its optimizer, its losses; nothing of the other thread's. Where the agent moved
    to a worker (it follows the main thread, which installed the hooks, until an optimizer
    steps), step 1 says so and has neither a loss nor activations of another thread's."""
    what = f"arrangement {arrangement}"
    assert recording.end is not None and recording.end.status == schema.ExitStatus.OK, what
    steps = recording.steps
    assert [step.step for step in steps] == list(range(1, STEPS + 1)), what
    followed = {step.end.weights for step in steps}
    assert len(followed) == 1 and followed <= set(MODELS), f"{what}: {followed}"
    thread = MODELS.index(followed.pop())
    assert thread == FOLLOWED.get(arrangement, thread), f"{what}: not the thread that stepped"
    assert {step.end.gradients for step in steps[1:]} == {MODELS[thread]}, what
    assert {step.optimizer for step in steps} == {"SGD#1"}, what
    own = [float.fromhex(loss) for loss in results[thread]]
    if arrangement == 3:  # the main thread, followed from the start
        assert [step.loss for step in steps] == own, f"{what}: another thread's loss"
        return
    assert [step.loss for step in steps] == [None, *own[1:]], f"{what}: another thread's loss"
    assert steps[0].microbatches == 0 and not activations_known(steps[0]), what
    said = [alert for alert in steps[0].alerts if alert.kind == schema.AlertKind.ACTIVATIONS_VARY]
    assert len(said) == 1 and "followed another thread" in said[0].message, what


def test_two_models_on_two_threads_follow_one_thread_and_never_crash(tmp_path: Path) -> None:
    """24 runs of two threads training their own models at once, in one interpreter, under an
    agent each, with a thread switch every 10 us (the threads interleave inside the hooks as
    on a loaded machine): two workers, two workers with GradScaler, the main thread (followed
    until an optimizer steps) beside a worker that steps first, so the agent moves while the
    main thread's model is registered and its gradients hooked (SIGSEGV in 3 of 6 such
    processes before issue 32: the moved agent read the main thread's gradients while its
    backward wrote them), and the main thread stepping first beside a worker, both optimizers
    built before the agent (its search of the heap registered the worker's). The move also
    runs under `memtui run`. No crash, every loss as without the agent, each recording one
    thread's training only."""
    job = tmp_path / "two_threads.py"
    job.write_text(TWO_THREADS)
    plain = _start([sys.executable, str(job), str(STEPS), "4", "plain"], tmp_path / "plain")
    under = _start([sys.executable, str(job), str(STEPS), str(RUNS), "agent"], tmp_path)
    command = [*MEMTUI, "run", "--headless", "-o", "moved.memtui", str(job)]
    run = _start([*command, str(STEPS), "1", "memtui", "1"], tmp_path / "run")
    expected = [json.loads(line) for line in _finish(plain, "plain")[0].splitlines()]
    assert len(expected) == 4
    lines = _finish(under, "under the agent")[0].splitlines()
    assert len(lines) == RUNS
    for index, line in enumerate(lines):
        results = json.loads(line)
        arrangement = index % 4
        assert results == expected[arrangement], f"run {index}: a thread's losses changed"
        _one_threads_training(read_recording(tmp_path / f"run{index}.memtui"), results, arrangement)
    results = json.loads(_finish(run, "under memtui run")[0])
    assert results == expected[1], "memtui run: a thread's losses changed"
    _one_threads_training(read_recording(tmp_path / "run" / "moved.memtui"), results, 1)


def test_a_move_that_fails_turns_the_agent_off_and_never_reaches_the_job(tmp_path: Path) -> None:
    """The move runs inside the job's `optimizer.step()` (the first one, on the thread that
    takes over): an error there turns every hook off, is said once, and the job trains on with
    the losses of a plain run."""
    job = tmp_path / "two_threads.py"
    job.write_text(
        TWO_THREADS.replace(
            "import memtui_agent\n",
            "import memtui_agent\n"
            "from memtui_agent.job.modules import ModuleRegistry\n"
            "def boom(self):\n"
            "    raise RuntimeError('planted')\n"
            "ModuleRegistry.forget_objects = boom\n",
            1,
        )
    )
    plain = _start([sys.executable, str(job), str(STEPS), "2", "plain"], tmp_path / "plain")
    under = _start([sys.executable, str(job), str(STEPS), "1", "agent", "1"], tmp_path)
    expected = _finish(plain, "plain")[0].splitlines()[1]
    stdout, stderr = _finish(under, "under the agent")
    assert stdout.strip() == expected
    said = [line for line in stderr.splitlines() if "hook:thread" in line]
    assert len(said) == 1 and "RuntimeError: planted" in said[0], stderr
    recording = read_recording(tmp_path / "run1.memtui")
    assert recording.end is not None and recording.end.status == schema.ExitStatus.OK
    assert recording.steps == []  # nothing of either thread recorded after the failed move


UNJOINED = textwrap.dedent("""
    import json, sys, threading
    import torch
    torch.set_num_threads(1)

    def train(losses):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 8)
        for step in range(int(sys.argv[1])):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item().hex())
        print(json.dumps(losses), flush=True)

    threading.Thread(target=train, args=([],)).start()
    # The script ends here, its training thread still at work: Python waits for it at exit.
""")


def test_a_script_that_returns_while_its_training_thread_trains_is_recorded_whole(
    tmp_path: Path,
) -> None:
    """`memtui run` stops the agent where Python ends the job, after the threads it waits for:
    every step of a training thread the script never joined is recorded, and the recording
    ends `ok` after the last. Before issue 32 the agent stopped as the script returned (0 of
    40 steps recorded, `End` at once, the hooks gone), reading the piles on the main thread
    while the training thread wrote its gradients."""
    job = tmp_path / "unjoined.py"
    job.write_text(UNJOINED)
    run = _start([*MEMTUI, "run", "--headless", "-o", "rec.memtui", str(job), "40"], tmp_path)
    losses = [float.fromhex(loss) for loss in json.loads(_finish(run, "memtui run")[0])]
    recording = read_recording(tmp_path / "rec.memtui")
    assert [step.step for step in recording.steps] == list(range(1, 41))
    assert recording.end is not None and recording.end.status == schema.ExitStatus.OK
    assert recording.end.time >= recording.steps[-1].t_end
    # Step 1 began while the agent followed the main thread, which installed it.
    assert [step.loss for step in recording.steps] == [None, *losses[1:]]


# ----- J3: a job that closes descriptors it does not know --------------------------------------

CLOSES_FDS = textwrap.dedent("""
    import importlib.util, json, os, socket, sys, time
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    def step():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss.item().hex()

    def package_dir(name):
        return os.path.dirname(importlib.util.find_spec(name).origin)

    def detach():
        # What `memtui detach PID` delivers, run by the job's own main thread.
        reply = os.path.abspath("reply.json")
        deps = sorted({os.path.dirname(package_dir(n)) for n in ("msgspec", "psutil")})
        request = {"action": "detach", "pid": os.getpid(), "python": list(sys.version_info[:2]),
                   "agent_dir": package_dir("memtui_agent"),
                   "protocol_dir": package_dir("memtui_protocol"), "dependency_paths": deps,
                   "reply": reply, "deadline": time.time() + 120, "options": {}}
        with open("request.json", "w") as handle:
            json.dump(request, handle)
        boot = os.path.join(package_dir("memtui_agent"), "attach", "boot.py")
        with open(boot, "rb") as handle:
            code = compile(handle.read(), boot, "exec")
        exec(code, {"__name__": "__memtui_attach__", "REQUEST": os.path.abspath("request.json")})
        return reply

    losses = [step() for _ in range(3)]
    os.closerange(3, 1024)  # a daemon's tidy-up: every descriptor it did not open itself
    files = [open(f"mine-{i}.txt", "w+b", buffering=0) for i in range(20)]
    ours, theirs = socket.socketpair()
    for handle in files:
        handle.write(b"job data\\n")
    losses += [step() for _ in range(5)]
    reply = detach()
    for _ in range(400):
        losses.append(step())
        try:
            with open(reply) as handle:
                if json.load(handle)["state"] == "detached":
                    break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    losses += [step() for _ in range(3)]
    for handle in files:  # EBADF here if the agent closed one of them
        handle.write(b"more\\n")
        handle.seek(0)
        assert handle.read() == b"job data\\nmore\\n", handle.name
    theirs.setblocking(False)
    try:
        leaked = theirs.recv(1 << 16)
    except BlockingIOError:
        leaked = b""
    with open(reply) as handle:
        state = json.load(handle)["state"]
    print(json.dumps({"losses": losses, "leaked": len(leaked), "state": state}))
""")


def test_a_job_closing_unknown_descriptors_gets_no_frame_and_keeps_its_files(
    tmp_path: Path,
) -> None:
    """The job closes descriptors 3..1023 (the agent's recording, /proc reader and socket among
    them), opens 20 files and a socket pair that reuse those numbers, trains, then is detached
    (`memtui detach`'s bootstrap): its files hold only what it wrote and stay open (the detach
    closed none of them: 20 frames went into them and detach closed one before issue 27), no
    byte reached its socket, and the recording goes on by its own path, whole, to `detached`."""
    (tmp_path / "job.py").write_text(CLOSES_FDS)
    process = _start([*MEMTUI, "run", "--headless", "-o", "rec.memtui", "job.py"], tmp_path)
    stdout, _ = _finish(process, "the job")
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["state"] == "detached" and result["leaked"] == 0
    recording = read_recording(tmp_path / "rec.memtui")
    assert recording.warning is None
    assert recording.end is not None and recording.end.status == schema.ExitStatus.DETACHED
    numbers = [step.step for step in recording.steps]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 8
    losses = [step.loss for step in recording.steps]
    assert [float.fromhex(value) for value in result["losses"][: len(losses)]] == losses


# ----- J4: SIGTERM while the job is in a long C call -------------------------------------------

LONG_CALL = textwrap.dedent("""
    import time
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    big = torch.randn(3000, 3000)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1000):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        print("calling", flush=True)
        started = time.perf_counter()
        big @ big  # one C call of about a second: no bytecode runs meanwhile
        print("call", time.perf_counter() - started, flush=True)
""")


def _seconds_to_die(job: JobProcess) -> tuple[float, float]:
    """(seconds from SIGTERM to the job's end, the job's longest C call before it).

    The signal is sent a quarter of a call's time after the job said it begins one (after two
    whole calls, whose durations the job measured itself), so it lands inside that call."""
    deadline = time.monotonic() + TIMEOUT_S
    seen: list[str] = []
    while True:
        assert job.poll() is None and time.monotonic() < deadline, seen
        seen += job.take_lines()
        calls = [float(line.split()[1]) for line in seen if line.startswith("call ")]
        if len(calls) >= 2 and seen[-1] == "calling":
            break
        time.sleep(0.005)
    time.sleep(max(calls) / 4)
    sent = time.monotonic()
    job.terminate(grace=60.0)
    job.wait()
    return time.monotonic() - sent, max(calls)


def test_sigterm_in_a_long_c_call_ends_the_job_as_fast_as_without_memtui(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (quit from the TUI) reaches a job whose main thread is in a one-second matmul:
    under memtui it dies in about the time the plain job does (before issue 27, memtui's Python
    handler waited for the call to return), compared relatively: the difference is under half
    the job's own call. The recording still ends properly: stopped, at its last closed step."""
    (tmp_path / "job.py").write_text(LONG_CALL)
    monkeypatch.chdir(tmp_path)
    plain = JobProcess([sys.executable, "job.py"], scrubbed_env(tmp_path / "rt"), None)
    plain_seconds, _ = _seconds_to_die(plain)
    assert plain.poll() == 128 + signal.SIGTERM
    monkeypatch.setenv("MEMTUI_RUNTIME_DIR", str(tmp_path / "rt"))
    spec = build_job(["job.py"], None, "rec.memtui", False, AgentConfig(socket=False))
    under = JobProcess(spec.command, spec.env, None)
    under_seconds, call = _seconds_to_die(under)
    code = under.poll()
    assert code == 128 + signal.SIGTERM
    assert under_seconds < plain_seconds + call / 2, (under_seconds, plain_seconds, call)
    assert record_stop(spec.recording, code) == 1
    recording = read_recording(tmp_path / "rec.memtui")
    assert recording.warning is None
    end: Any = recording.end
    assert end is not None and end.status == schema.ExitStatus.STOPPED and end.code == 143
    assert end.step == recording.steps[-1].step >= 3


CTRL_C_IN_TRAINING = textwrap.dedent("""
    import os, signal, sys, threading, time, torch
    import memtui_agent
    torch.set_num_threads(1)
    # What Python installs in a terminal: a suite started in the background hands its children
    # SIGINT ignored, where no Ctrl-C reaches any job, with or without the agent.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if len(sys.argv) > 3:  # the job's own handler
        def own(signum, frame):
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, own)
    if sys.argv[1] == "agent":
        memtui_agent.start(record=None, socket=False)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    lost = 0
    for trial in range(int(sys.argv[2])):
        fired = threading.Event()
        def later():
            # Into the middle of a step: forward, backward (where the agent's finalizers run
            # as saved activations are freed) or the update.
            time.sleep(0.003 + (trial % 7) * 0.0011)
            os.kill(os.getpid(), signal.SIGINT)
            fired.set()
        try:  # the signal may come while the thread starts: inside the try too
            threading.Thread(target=later).start()
            for _ in range(400):
                model(torch.randn(4, 16)).square().mean().backward()
                opt.step()
                opt.zero_grad()
            fired.wait()
            lost += 1  # the job trained on: its Ctrl-C was dropped
        except KeyboardInterrupt:
            fired.wait()
            # torch's own optimizer step can leave grad mode off when the signal lands in the
            # `finally` of its `_use_grad` (a Python call before it restores the mode): a job
            # that trains on after a Ctrl-C sets it back, with or without the agent.
            torch.set_grad_enabled(True)
    handler = signal.getsignal(signal.SIGINT)
    if sys.argv[1] == "agent":
        memtui_agent.stop()
    print(lost, handler is signal.default_int_handler,
          signal.getsignal(signal.SIGINT) is signal.default_int_handler)
""")


def test_every_ctrl_c_reaches_the_job_even_inside_the_agents_finalizers(tmp_path: Path) -> None:
    """200 SIGINTs, each at a different point of a training step. Python raises a signal's
    exception at the next check point the main thread reaches; when that was in one of the
    agent's finalizers (a saved activation's `__del__`, the ledger's weakref callback), Python
    printed "Exception ignored" and the job trained on: 33 of 200 lost before, 0 without the
    agent. Every one must reach the job, with Python's handler and with the job's own; after
    `stop()` the job's handler is back. The job turns grad mode back on after each Ctrl-C:
    torch's optimizer step leaves it off when the signal lands in its `finally` (a CI run's job
    without the agent failed so); that the agent's gradient norm restores the mode whatever its
    ops raise is tests/unit/test_grad_mode_restored.py."""
    job = tmp_path / "ctrl_c.py"
    job.write_text(CTRL_C_IN_TRAINING)
    plain = _start([sys.executable, str(job), "plain", "200"], tmp_path / "plain")
    under = _start([sys.executable, str(job), "agent", "200"], tmp_path / "agent")
    own = _start([sys.executable, str(job), "agent", "200", "own"], tmp_path / "own")
    assert _finish(plain, "plain")[0].split() == ["0", "True", "True"]
    stdout, stderr = _finish(under, "under the agent")
    lost, during, after = stdout.split()
    assert lost == "0", f"{lost} of 200 Ctrl-Cs lost under the agent\n{stderr[-2000:]}"
    assert "Exception ignored" not in stderr
    assert (during, after) == ("False", "True")  # the deferring handler while it ran, then Python's
    stdout, stderr = _finish(own, "under the agent, the job's own handler")
    assert stdout.split()[0] == "0", f"{stdout.split()[0]} of 200 lost with the job's own handler"
    assert "Exception ignored" not in stderr
