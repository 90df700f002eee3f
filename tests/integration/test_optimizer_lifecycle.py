"""docs/design.md#steps over the optimizer's life cycle: every top-level step() of any optimizer
closes a frame that names it, nested steps belong to the outer one, a job without an optimizer
steps at each backward, and nothing the job drops is kept alive by the agent.

Each job computes its own truth (losses, state bytes from unique storages, whether a dropped
object was freed) without the agent's code, and prints it; the test compares the recording.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memtui.model.recording import read_recording
from memtui.reports.report import build_report

pytestmark = pytest.mark.slow  # torch jobs, in the session's shared interpreter (`shared_python`)

TRUTH = """
import json, sys, weakref, torch, memtui_agent

def state_bytes(*optimizers):
    storages = {}
    for opt in optimizers:
        for state in opt.state.values():
            for value in state.values():
                items = value if isinstance(value, (list, tuple)) else [value]
                for item in items:
                    if isinstance(item, torch.Tensor):
                        storage = item.untyped_storage()
                        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())

def truth(**fields):
    print("TRUTH " + json.dumps(fields), flush=True)

def maybe_monitor():
    if sys.argv[1] == "agent":
        return memtui_agent.monitor(record="rec.memtui", socket=False)
    import contextlib
    return contextlib.nullcontext()
"""

SWAP = (
    TRUTH
    + """
torch.manual_seed(0)
with maybe_monitor():
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    for i in range(5):
        if i == 3:  # a second stage: the optimizer is rebuilt, the old one dropped
            old = weakref.ref(opt)
            old_state = weakref.ref(next(iter(opt.state.values()))["exp_avg"])
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            truth(old_freed=old() is None, old_state_freed=old_state() is None)
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        truth(loss=loss.item(), state=state_bytes(opt))
    ref = weakref.ref(model)
    weight = weakref.ref(model.weight)
    del model, opt, loss
    truth(model_freed=ref() is None and weight() is None)
"""
)


def _truths(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in stdout.splitlines() if line.startswith("TRUTH ")]


def _job(shared_python: Any, tmp_path: Path, source: str, *args: str) -> list[dict[str, Any]]:
    result = shared_python(source, *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return _truths(result.stdout)


def _report(tmp_path: Path) -> dict[str, Any]:
    return build_report(read_recording(tmp_path / "rec.memtui"))


def test_a_replaced_optimizer_keeps_closing_steps_and_is_freed(
    tmp_path: Path, shared_python: Any
) -> None:
    plain = _job(shared_python, tmp_path, SWAP, "plain")
    truths = _job(shared_python, tmp_path, SWAP, "agent")
    report = _report(tmp_path)
    steps = report["steps"]
    losses = [t["loss"] for t in truths if "loss" in t]
    assert [s["optimizer"] for s in steps] == ["Adam#1"] * 3 + ["SGD#2"] * 2
    assert [s["optimizer_step"] for s in steps] == [1, 2, 3, 1, 2]
    assert [s["loss"] for s in steps] == losses
    assert report["optimizers"] == {"Adam#1": 3, "SGD#2": 2}
    # The optimizer state pile is exactly the live optimizer's: the dropped Adam's moments left.
    assert [s["end"]["optimizer_state"] for s in steps] == [
        t["state"] for t in truths if "state" in t
    ]
    weights = (64 * 32 + 32) * 4
    assert steps[-1]["end"]["optimizer_state"] == weights  # SGD momentum, nothing of Adam's
    # Freed under the agent exactly as without it, without a garbage collection.
    freed = [t for t in truths if "old_freed" in t or "model_freed" in t]
    assert freed == [t for t in plain if "old_freed" in t or "model_freed" in t]
    assert all(all(t.values()) for t in freed)
    growth = [a for a in report["alerts"] if a["kind"] == "first_step_growth"]
    assert [(a["step"], a["message"].split(".step()")[0]) for a in growth] == [
        (1, "the first Adam#1"),
        (4, "the first SGD#2"),
    ]
    assert all("as forecast" in a["message"] for a in growth)
    assert report["exit"]["piles"]["optimizer_state"] == 0  # the job dropped everything
    assert report["exit"]["piles"]["weights"] == 0


GAN = (
    TRUTH
    + """
torch.manual_seed(0)
scaled = sys.argv[2] == "scaler"
with maybe_monitor():
    G = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    D = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=scaled)
    for i in range(4):
        real, noise = torch.randn(16, 4), torch.randn(16, 8)
        opt_d.zero_grad()
        loss_d = (D(real) - 1).pow(2).mean() + D(G(noise).detach()).pow(2).mean()
        scaler.scale(loss_d).backward()
        if scaled and i == 1:
            D[0].weight.grad[0, 0] = float("inf")  # D's update is skipped, G's is not
        scaler.step(opt_d)
        truth(name="D", loss=loss_d.item(), state=state_bytes(opt_d, opt_g))
        opt_g.zero_grad()
        loss_g = (D(G(noise)) - 1).pow(2).mean()
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)
        scaler.update()
        truth(name="G", loss=loss_g.item(), state=state_bytes(opt_d, opt_g))
"""
)


def test_two_optimizers_each_close_their_own_step(tmp_path: Path, shared_python: Any) -> None:
    truths = _job(shared_python, tmp_path, GAN, "agent", "plain")
    report = _report(tmp_path)
    steps = report["steps"]
    assert len(steps) == 8
    assert [s["optimizer"] for s in steps] == ["Adam#1", "Adam#2"] * 4
    assert [s["optimizer_step"] for s in steps] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert [s["loss"] for s in steps] == [t["loss"] for t in truths]
    assert [s["microbatches"] for s in steps] == [1] * 8
    assert [s["end"]["optimizer_state"] for s in steps] == [t["state"] for t in truths]
    growth = [a for a in report["alerts"] if a["kind"] == "first_step_growth"]
    assert [a["step"] for a in growth] == [1, 2]  # G's first step is checked too
    assert all("as forecast" in a["message"] for a in growth)
    forecasts = [a for a in report["alerts"] if a["kind"] == "first_step_forecast"]
    assert [a["step"] for a in forecasts] == [1, 2]
    assert report["optimizers"] == {"Adam#1": 4, "Adam#2": 4}


def test_a_grad_scaler_skip_closes_that_optimizers_step_only(
    tmp_path: Path, shared_python: Any
) -> None:
    truths = _job(shared_python, tmp_path, GAN, "agent", "scaler")
    steps = _report(tmp_path)["steps"]
    assert [s["optimizer"] for s in steps] == ["Adam#1", "Adam#2"] * 4
    assert [s["skipped"] for s in steps] == [False, False, True, False, False, False, False, False]
    assert [s["loss"] for s in steps] == [t["loss"] for t in truths]
    skip = [a for a in steps[2]["alerts"] if a["kind"] == "skipped_step"]
    # G's step closed before scaler.update() ran: the scale after is not known yet there.
    assert len(skip) == 1 and skip[0]["message"].endswith("at scale 256")
    assert [s["scale"] for s in steps] == [256.0] * 4 + [128.0] * 4


NO_OPTIMIZER = (
    TRUTH
    + """
torch.manual_seed(0)
with maybe_monitor():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    for i in range(5):
        model.zero_grad(set_to_none=True)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
        truth(loss=loss.item())
"""
)


def test_without_an_optimizer_each_backward_is_a_step(tmp_path: Path, shared_python: Any) -> None:
    truths = _job(shared_python, tmp_path, NO_OPTIMIZER, "agent")
    report = _report(tmp_path)
    steps = report["steps"]
    weights = (32 * 64 + 64 + 64 + 1) * 4
    assert len(steps) == 5
    assert {s["closed_by"] for s in steps} == {"backward"}
    assert {s["optimizer"] for s in steps} == {None}
    assert [s["loss"] for s in steps] == [t["loss"] for t in truths]
    assert all(s["end"]["weights"] == weights and s["end"]["gradients"] == weights for s in steps)
    assert report["optimizers"] == {}
    assert "each step is one top-level backward()" in report["step_rule"]
    assert report["exit"]["status"] == "ok"


LBFGS_AND_NESTING = (
    TRUTH
    + """
torch.manual_seed(0)

class Wrapper(torch.optim.Optimizer):
    # Like accelerate's or ZeRO's wrappers: its step() runs the inner optimizer's step().
    def __init__(self, inner):
        self.inner = inner
        super().__init__([p for g in inner.param_groups for p in g["params"]], {})

    def step(self, closure=None):
        return self.inner.step(closure)

class Flaky(torch.optim.SGD):
    def step(self, closure=None):
        if getattr(self, "fail", False):
            self.fail = False
            raise RuntimeError("a step that raises")
        return super().step(closure)

with maybe_monitor():
    model = torch.nn.Linear(300, 300)
    x = torch.randn(16, 300)
    lbfgs = torch.optim.LBFGS(model.parameters(), history_size=10, max_iter=5)
    def closure():
        lbfgs.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss
    lbfgs.step(closure)
    truth(state=state_bytes(lbfgs))
    lbfgs.step(closure)
    del lbfgs, closure
    small = torch.nn.Linear(4, 4)
    wrapper = Wrapper(torch.optim.AdamW(small.parameters()))
    flaky = Flaky(small.parameters(), lr=0.1)
    for i in range(3):
        small(torch.randn(2, 4)).sum().backward()
        wrapper.step()
        wrapper.zero_grad()
    flaky.fail = True
    small(torch.randn(2, 4)).sum().backward()
    try:
        wrapper.inner.step = flaky.step  # the outer step raises from inside
        wrapper.step()
    except RuntimeError:
        del wrapper.inner.step
    small(torch.randn(2, 4)).sum().backward()
    flaky.step()
    # Lightning's way: forward and backward run in a closure inside step(), so no parameter
    # has a gradient when the step begins; the forecast still counts the ones it will have.
    head = torch.nn.Linear(6, 3)
    by_closure = torch.optim.Adam(head.parameters())
    by_closure.step(lambda: head(torch.randn(2, 6)).sum().backward())
    truth(done=True)
"""
)


def test_lbfgs_bound_nested_steps_and_a_step_that_raised(
    tmp_path: Path, shared_python: Any
) -> None:
    truths = _job(shared_python, tmp_path, LBFGS_AND_NESTING, "agent")
    report = _report(tmp_path)
    steps = report["steps"]
    # 2 LBFGS steps (their closure's backwards are microbatches), 3 wrapper steps whose inner
    # AdamW step is nested, the raising step closes nothing, then Flaky's own step.
    assert [s["optimizer"] for s in steps] == (
        ["LBFGS#1"] * 2 + ["Wrapper#2"] * 3 + ["Flaky#3", "Adam#4"]
    )
    assert steps[0]["microbatches"] >= 2
    grown = truths[0]["state"]
    growth = [a for a in report["alerts"] if a["kind"] == "first_step_growth"]
    lbfgs = growth[0]
    assert lbfgs["step"] == 1
    assert f"({grown:,} bytes)" in lbfgs["message"]
    bound = (300 * 300 + 300) * 4 * (2 + 2 * 4) + 4 * (1 + 2 * 4)
    assert "within the forecast, at most" in lbfgs["message"]
    assert f"({bound:,} bytes)" in lbfgs["message"]
    adamw = [a for a in growth if "AdamW" in a["message"]]
    assert len(adamw) == 1 and adamw[0]["step"] == 3 and "as forecast" in adamw[0]["message"]
    assert steps[2]["end"]["optimizer_state"] == 2 * (4 * 4 + 4) * 4 + 2 * 4
    closure = [a for a in growth if a["step"] == 7]
    assert len(closure) == 1 and "as forecast" in closure[0]["message"]
    assert f"({2 * (6 * 3 + 3) * 4 + 2 * 4:,} bytes)" in closure[0]["message"]


CHECKPOINTS = """
import torch, memtui_agent
with memtui_agent.monitor(record="rec.memtui", socket=False):
    from torch.utils.checkpoint import checkpoint  # imported after the agent started, as under
    # `memtui run`: a name bound before then is torch's own function, which nothing reports
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for reentrant in (True, False, True):
        x = torch.randn(2, 8, requires_grad=True)
        checkpoint(model, x, use_reentrant=reentrant).sum().backward()
        opt.step()
"""


def test_each_checkpoint_variant_gets_its_own_explanation(
    tmp_path: Path, shared_python: Any
) -> None:
    _job(shared_python, tmp_path, CHECKPOINTS)
    notes = [a for a in _report(tmp_path)["alerts"] if a["kind"] == "checkpoint_limit"]
    assert [a["step"] for a in notes] == [1, 2]
    assert "use_reentrant=True" in notes[0]["message"]
    assert "recomputes them" in notes[0]["message"]
    assert "use_reentrant=False" in notes[1]["message"]
    assert "not counted" in notes[1]["message"]


def test_the_viewer_names_the_optimizer_only_where_several_step(
    make_step: Any, demo_messages: list[Any]
) -> None:
    import msgspec

    from memtui.model.session import Session
    from memtui_protocol import schema

    def owners(steps: list[schema.Step]) -> list[str | None]:
        session = Session(live=False)
        session.ingest([demo_messages[0], *steps])
        found = []
        for index in range(len(steps)):
            session.cursor = index
            found.append(session.view_state().piles.step_owner)
        return found

    def step(number: int, **fields: Any) -> schema.Step:
        replaced: schema.Step = msgspec.structs.replace(make_step(number), **fields)
        return replaced

    one = [step(n, optimizer="AdamW#1", optimizer_step=n) for n in (1, 2)]
    assert owners(one) == [None, None]
    gan = [
        step(1, optimizer="Adam#1", optimizer_step=1),
        step(2, optimizer="Adam#2", optimizer_step=1),
        step(3, optimizer="Adam#1", optimizer_step=2),
    ]
    assert owners(gan) == ["Adam#1 step 1", "Adam#2 step 1", "Adam#1 step 2"]
    manual = [step(1, closed_by=schema.StepTrigger.BACKWARD)]
    assert owners(manual) == ["step = one backward() (no optimizer stepped)"]


SCAN_QUIETLY = """
import warnings, torch, torch.distributed, memtui_agent
warnings.simplefilter("always")  # any warning the agent causes is printed
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = torch.nn.Linear(4, 1)
    model(torch.randn(2, 4)).sum().backward()  # before any optimizer: the heap is searched
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.step()
print("done")
"""


def test_searching_the_heap_for_optimizers_prints_nothing(
    tmp_path: Path, shared_python: Any
) -> None:
    """The search reads each object's exact type: `isinstance` reads `__class__`, which
    torch.distributed's deprecated `reduce_op` answers with a FutureWarning in the job."""
    result = shared_python(SCAN_QUIETLY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "done"
    assert "Warning" not in result.stderr and "memtui:" not in result.stderr, result.stderr
