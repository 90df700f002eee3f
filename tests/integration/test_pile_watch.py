"""Weights and optimizer state stay exact when the close walks them only on a change signal.

Each job changes its model and optimizer between steps in every way the step close must
notice (a module attached and deleted, `.half()`, `p.data = ...`, a buffer reassigned, a
parameter group added, state loaded, a direct write to `_parameters`), and prints after each
`opt.step()` its own count of the three persistent piles: unique storages of the parameters,
buffers and optimizer-only parameters, of the optimizer state (lists included) and of the
gradients. Every step's frame must equal that count; for an unannounced change, from the
audit close on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memtui.model.recording import read_recording
from memtui_agent.steps.pile_watch import AUDIT_CLOSES

TRUTH = """
import copy, json, sys, torch, memtui_agent
from torch import nn

def unique_bytes(tensors):
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())

def state_tensors(opt):
    found = []
    for state in opt.state.values():
        for value in state.values():
            items = value if isinstance(value, (list, tuple)) else [value]
            found += [v for v in items if isinstance(v, torch.Tensor)]
    return found

def report(step, model, opts):
    params = list(model.parameters())
    for opt in opts:
        params += [p for group in opt.param_groups for p in group["params"]]
    weights = unique_bytes(params + list(model.buffers()))
    state = unique_bytes([t for opt in opts for t in state_tensors(opt)])
    grads = unique_bytes([p.grad for p in params if p.grad is not None])
    print("TRUTH", json.dumps([step, weights, state, grads]), flush=True)
"""

CHANGES = (
    TRUTH
    + """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)

torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = Model()
    model.frozen = nn.Linear(64, 64).requires_grad_(False)  # a weight that never trains
    model.register_buffer("scale", torch.ones(100))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loose = nn.Parameter(torch.randn(300))  # a parameter no module holds
    kept = []
    for step in range(1, sys.argv[1:] and int(sys.argv[1]) or 12):
        opt.zero_grad()
        x = torch.randn(8, 16)
        loss = model(x).square().mean() + loose.square().sum() * 0
        loss.backward()
        opt.step()
        report(step, model, [opt])
        if step == 3:
            model.extra = nn.Linear(8, 8)  # attached: a registration on a known module
        elif step == 4:
            model.frozen.half()  # `_apply`: `.data` swapped, nothing registered
        elif step == 5:
            model.frozen.weight.data = torch.zeros(128, 64)  # old storage freed
        elif step == 6:
            kept.append(model.extra.bias)  # nothing freed: the registration must say it
            model.extra.bias = nn.Parameter(torch.zeros(500))  # on the module attached since
        elif step == 7:
            model.scale = torch.ones(2000)  # a buffer reassigned
        elif step == 8:
            del model.extra  # its storages are freed
        elif step == 9:
            opt.add_param_group({"params": [loose]})  # optimizer-only: weights and state
        elif step == 10:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # every state tensor new
        elif step == 11:
            # Unannounced: no hook, and the old bias stays alive (nothing is freed).
            kept.append(model.frozen.bias)
            model.frozen._parameters["bias"] = nn.Parameter(torch.zeros(4096))
"""
)


def _frames_against_truth(stdout: str, path: Path) -> list[tuple[int, Any, Any]]:
    truth = {}
    for line in stdout.splitlines():
        if line.startswith("TRUTH "):
            step, *piles = json.loads(line[len("TRUTH ") :])
            truth[step] = tuple(piles)
    steps = {s.step: s for s in read_recording(path).steps}
    assert set(truth) <= set(steps), "every reported step has its frame"
    return [
        (
            step,
            (steps[step].end.weights, steps[step].end.optimizer_state, steps[step].end.gradients),
            truth[step],
        )
        for step in sorted(truth)
    ]


@pytest.mark.slow
def test_every_announced_change_is_counted_at_the_next_close(
    tmp_path: Path, shared_python: Any
) -> None:
    result = shared_python(CHANGES, "12", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    compared = _frames_against_truth(result.stdout, tmp_path / "rec.memtui")
    assert len(compared) == 11
    for step, frame, truth in compared:
        assert frame == truth, f"step {step}: frame {frame} != truth {truth}"


@pytest.mark.slow
def test_an_unannounced_change_is_exact_from_the_audit_on(
    tmp_path: Path, shared_python: Any
) -> None:
    steps = AUDIT_CLOSES + 4
    result = shared_python(CHANGES, str(steps + 1), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    compared = _frames_against_truth(result.stdout, tmp_path / "rec.memtui")
    wrong = [step for step, frame, truth in compared if frame != truth]
    # The direct write after step 11 reaches the frames at the audit close at the latest; from
    # there the pile is walked at every close.
    assert all(11 < step < AUDIT_CLOSES for step in wrong), wrong
    assert compared[-1][1] == compared[-1][2]


HISTORY = (
    TRUTH
    + """
class WithHistory(torch.optim.SGD):
    # Keeps updates in a list in its state, from its fifth step (after the first closes, which
    # walk everything): tensors appended, nothing freed, and the state dicts keep their keys.
    steps = 0
    def step(self, closure=None):
        loss = super().step(closure)
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                history = self.state[p].setdefault("history", [])
                if self.steps >= 5:
                    history.append(p.detach().clone())
        return loss

torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = nn.Linear(10, 1)
    opt = WithHistory(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 10), torch.randn(32, 1)
    for step in range(1, 9):
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
        report(step, model, [opt])
"""
)


@pytest.mark.slow
def test_an_optimizer_whose_state_lists_grow_is_exact_at_every_step(
    tmp_path: Path, shared_python: Any
) -> None:
    result = shared_python(HISTORY, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    compared = _frames_against_truth(result.stdout, tmp_path / "rec.memtui")
    assert len(compared) == 8
    for step, frame, truth in compared:
        assert frame == truth, f"step {step}: frame {frame} != truth {truth}"


AT_EXIT = (
    TRUTH
    + """
torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 8):  # steps 4 to 7 repeat step 1: not measured
        opt.zero_grad()
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
    model.half()  # after the last close: only the end of the job sees it
    report(0, model, [opt])
"""
)


@pytest.mark.slow
def test_the_end_of_the_job_counts_what_is_alive_then(tmp_path: Path, shared_python: Any) -> None:
    """The job ends between measured steps with its gradients alive (counted at each close
    outside the ledger) and its model converted after the last close: `End` holds both."""
    result = shared_python(AT_EXIT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    truth = next(
        json.loads(line[len("TRUTH ") :])[1:]
        for line in result.stdout.splitlines()
        if line.startswith("TRUTH ")
    )
    recording = read_recording(tmp_path / "rec.memtui")
    assert not recording.steps[-1].activations_measured
    assert recording.end is not None and recording.end.piles is not None
    end = recording.end.piles
    assert [end.weights, end.optimizer_state, end.gradients] == truth
