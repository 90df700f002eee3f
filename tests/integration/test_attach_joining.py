"""`memtui attach` joins the thread that steps, a `save_on_cpu` job, and can be cancelled or
replaced while it waits (issue 27, L2).

gdb cannot call into processes on this machine, so these run the injected side in the job
itself: the job calls `inject.handle(request)` on a thread of its own, exactly as the bootstrap
does after gdb (or `sys.remote_exec`) ran it, and the reply file says how far the attach got.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import scrubbed_env

from memtui.commands import attach_command
from memtui.model.recording import read_recording

pytestmark = pytest.mark.slow  # every test here starts an interpreter

PRELUDE = """
import json, os, sys, threading, time
import torch
from torch import nn
import memtui_agent, memtui_protocol
from memtui_agent.attach import inject
from memtui_protocol.attach import Action, AttachRequest, read_reply

torch.manual_seed(0)
HERE = sys.argv[1]
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
MAIN = threading.get_ident()

def request(action, reply, **options):
    return AttachRequest(
        action=action, pid=os.getpid(), python=tuple(sys.version_info[:2]),
        agent_dir=os.path.dirname(memtui_agent.__file__),
        protocol_dir=os.path.dirname(memtui_protocol.__file__), dependency_paths=(),
        reply=os.path.join(HERE, reply), deadline=time.time() + 60, options=options)

def bootstrap(action, reply, **options):
    # What the bootstrap does: handle() on a thread of its own.
    thread = threading.Thread(target=inject.handle, args=(request(action, reply, **options),))
    thread.start()
    thread.join()
    return read_reply(os.path.join(HERE, reply))

def step():
    opt.zero_grad()
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()

def state(reply):
    answer = read_reply(os.path.join(HERE, reply))
    return answer["state"].value if answer else None

def report(**values):
    print(json.dumps(values), flush=True)
"""


def _job(tmp_path: Path, body: str) -> dict[str, Any]:
    env = scrubbed_env(tmp_path / "rt")
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + body, str(tmp_path)],
        capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    reported: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return reported


HELPER_THREAD = """
helper = nn.Linear(8, 8)
stop = threading.Event()
def helper_loop():
    while not stop.is_set():
        with torch.no_grad():
            helper(torch.randn(2, 8))
        time.sleep(0.001)
threading.Thread(target=helper_loop, daemon=True).start()
for _ in range(3):
    step()
armed = bootstrap(Action.ATTACH, "reply.json", record=os.path.join(HERE, "rec.memtui"))
for number in range(40):
    step()
    time.sleep(0.002)  # the helper runs modules between the steps
stop.set()
agent = memtui_agent.startup.api.current()
owner = agent.parts.owner_thread() if agent is not None else None
memtui_agent.startup.api.stop(exit_code=0)
report(armed=armed["state"].value, state=state("reply.json"), owner_is_main=owner == MAIN)
"""


@pytest.mark.slow  # a torch job in a fresh interpreter
def test_attach_follows_the_thread_that_steps_not_a_helper_running_modules(
    tmp_path: Path,
) -> None:
    """A helper thread ran the first module after the attach: the attach latched onto it,
    never saw a step end there, and never started (while saying recording would start)."""
    result = _job(tmp_path, HELPER_THREAD)
    assert result == {"armed": "armed", "state": "started", "owner_is_main": True}
    recording = read_recording(tmp_path / "rec.memtui")
    assert len(recording.steps) >= 30
    first = recording.steps[0]
    assert first.step == 5 and first.alerts[0].kind == "attached"  # the job's own numbers
    assert first.alerts[0].message.endswith("steps 1-4 were not recorded")


SECOND_MODEL_ON_A_THREAD = """
sys.setswitchinterval(1e-5)  # the threads interleave inside the hooks as on a loaded machine
other = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
other_opt = torch.optim.SGD(other.parameters(), lr=0.01)
stop = threading.Event()
other_steps = [0]
def other_loop():
    while not stop.is_set():
        other_opt.zero_grad()
        other(torch.randn(4, 8)).pow(2).mean().backward()
        other_opt.step()
        other_steps[0] += 1
worker = threading.Thread(target=other_loop)
worker.start()
for _ in range(3):
    step()
bootstrap(Action.ATTACH, "reply.json", record=os.path.join(HERE, "rec.memtui"))
attached_at = other_steps[0]
for _ in range(40):
    step()
# Whichever thread the agent follows trains on for several steps after the attach: the
# worker may be starved meanwhile (it once did 1 step in the main thread's 40, and the
# recording had 1 step). A count, with a generous net against a hang.
# And until the agent has closed 3 steps of the thread it follows: its start (a heap
# calibration of a few tenths of a second) can outlast the worker's 10 steps on a loaded
# machine (CI recorded 2 steps once).
def closes_seen(seen):
    current = memtui_agent.startup.api.current()
    try:
        seen.add(current.parts.context.window.closed)
    except Exception:
        pass
    return len(seen) - 1
seen = set()
deadline = time.monotonic() + 120
while (other_steps[0] < attached_at + 10 or closes_seen(seen) < 3) and time.monotonic() < deadline:
    step()
agent = memtui_agent.startup.api.current()
owner = agent.parts.owner_thread() if agent is not None else None
stop.set()
worker.join()
memtui_agent.startup.api.stop(exit_code=0)
report(state=state("reply.json"), owner_is_main=owner == MAIN)
"""
MAIN_MODEL = 4 * (8 * 16 + 16 + 16 + 1)
OTHER_MODEL = 4 * (8 * 32 + 32 + 32 + 1)


@pytest.mark.slow  # a torch job in a fresh interpreter
def test_attach_hands_the_agent_only_what_the_stepping_thread_trains(tmp_path: Path) -> None:
    """Two threads train their own models when the attach comes: the agent joins the thread
    that steps first and is handed that thread's optimizer and model only. It was handed every
    optimizer and model of the heap, and read the other thread's gradients at every close
    while that thread's backward wrote them (issue 32)."""
    result = _job(tmp_path, SECOND_MODEL_ON_A_THREAD)
    assert result["state"] == "started"
    recording = read_recording(tmp_path / "rec.memtui")
    assert len(recording.steps) >= 3
    weights = {step.end.weights for step in recording.steps}
    assert weights == {MAIN_MODEL if result["owner_is_main"] else OTHER_MODEL}
    assert {step.optimizer for step in recording.steps} == {
        "AdamW#1" if result["owner_is_main"] else "SGD#1"
    }


SAVE_ON_CPU = """
for _ in range(2):
    with torch.autograd.graph.save_on_cpu():
        step()
bootstrap(Action.ATTACH, "reply.json", record=os.path.join(HERE, "rec.memtui"))
for _ in range(6):
    with torch.autograd.graph.save_on_cpu():
        step()
started = state("reply.json")
memtui_agent.startup.api.stop(exit_code=0)
report(state=started)
"""


@pytest.mark.slow  # a torch job in a fresh interpreter
def test_attach_joins_a_job_that_runs_every_forward_inside_save_on_cpu(tmp_path: Path) -> None:
    """Every forward of the job runs inside its own saved-tensor hooks: the attach waited for
    a forward outside them, which never came."""
    assert _job(tmp_path, SAVE_ON_CPU) == {"state": "started"}
    recording = read_recording(tmp_path / "rec.memtui")
    assert [step.step for step in recording.steps][:1] == [5]  # joined at the next step
    assert len(recording.steps) >= 3


CANCEL_AND_REPLACE = """
# A thread runs one forward and ends: a latch onto it waited for it forever.
worker = threading.Thread(target=lambda: model(torch.randn(1, 8)))
step()
first = bootstrap(Action.ATTACH, "first.json", record=os.path.join(HERE, "first.memtui"))
worker.start(); worker.join()
second = bootstrap(Action.ATTACH, "second.json", record=os.path.join(HERE, "second.memtui"))
replaced = state("first.json")
detached = bootstrap(Action.DETACH, "detach.json")
left = (
    torch.optim.Optimizer.__dict__["_optimizer_step_code"].__qualname__,
    len(torch.nn.modules.module._global_forward_pre_hooks),
)
for _ in range(3):
    step()
again = bootstrap(Action.ATTACH, "again.json", record=os.path.join(HERE, "again.memtui"))
for _ in range(3):
    step()
started = state("again.json")
memtui_agent.startup.api.stop(exit_code=0)
report(first=first["state"].value, second=second["state"].value, replaced=replaced,
       detached=detached["state"].value, message=detached["message"], left=list(left),
       again=started, cancelled_recorded=os.path.exists(os.path.join(HERE, "second.memtui")))
"""


@pytest.mark.slow  # a torch job in a fresh interpreter
def test_a_waiting_attach_is_replaced_by_a_newer_one_and_cancelled_by_detach(
    tmp_path: Path,
) -> None:
    """Re-attaching was refused for the job's lifetime while an attach waited; `detach` could
    not cancel it. Now a newer attach replaces it, a detach cancels it at once (every hook
    gone), and the job can be attached again."""
    result = _job(tmp_path, CANCEL_AND_REPLACE)
    assert result["first"] == "armed" and result["second"] == "armed"
    assert result["replaced"] == "refused"  # the first one's reply: replaced
    assert result["detached"] == "detached"
    assert result["message"] == "the attach was cancelled before the agent started"
    assert result["left"] == ["Optimizer._optimizer_step_code", 0]  # nothing of ours left
    assert result["again"] == "started" and not result["cancelled_recorded"]
    assert read_recording(tmp_path / "again.memtui").steps


class _FakeInjection:
    delivered: list[Any] = []

    def __init__(self, target: Any, method: Any, action: Any, **options: Any) -> None:
        self.action = action

    def deliver(self) -> None:
        _FakeInjection.delivered.append(self.action)

    def wait(self, states: Any, seconds: float) -> dict[str, Any]:
        from memtui_protocol.attach import Answer

        return {"state": Answer.DETACHED, "message": "the attach was cancelled"}

    def close(self) -> None:
        pass


def test_memtui_detach_reaches_a_job_whose_attach_still_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No sidecar exists before the agent starts, so `memtui detach` said "no memtui agent
    runs" and never reached the waiting attach. The attach now leaves a private marker (with
    the process's start time) that `detach` finds."""
    monkeypatch.setenv("MEMTUI_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setattr(attach_command, "Injection", _FakeInjection)
    monkeypatch.setattr(attach_command, "check_target", lambda pid, need_torch: object())
    monkeypatch.setattr(attach_command, "check_delivery", lambda target: "gdb")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert attach_command.detach(sleeper.pid) == 1  # nothing waits there: refused
        assert _FakeInjection.delivered == []
        attach_command.mark_pending(sleeper.pid)
        assert attach_command.attach_pending(sleeper.pid)
        assert attach_command.detach(sleeper.pid) == 0
        assert len(_FakeInjection.delivered) == 1
        assert not attach_command.attach_pending(sleeper.pid)  # cleared
    finally:
        sleeper.kill()
        sleeper.wait()
    assert "the job carries on" in capsys.readouterr().err
    assert not attach_command.attach_pending(sleeper.pid)  # another process's pid: not it
