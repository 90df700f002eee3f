"""A saved tensor modified in place stops the job under the agent exactly as without it.

Under saved-tensor hooks autograd checks no version counter: without the agent's own check, a
job that writes into a tensor backward still needs (an activation, its input, or a weight
updated between forward and backward) would train on wrong gradients instead of raising.
"""

from __future__ import annotations

from typing import Any

import pytest

JOB = """
import sys, torch
from torch import nn
if sys.argv[1] != "none":
    import memtui_agent
    memtui_agent.start(record=None, socket=False, activations=sys.argv[1])

def outcome(name, body):
    try:
        body()
        print(name, "ok")
    except RuntimeError as exc:
        ok = "modified by an inplace operation" in str(exc)
        print(name, "inplace-error" if ok else "other-error: " + str(exc)[:100])

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)

def healthy():
    opt.zero_grad()
    net(torch.randn(3, 4)).square().mean().backward()
    opt.step()

def activation_modified():
    hidden = net[1](net[0](torch.randn(3, 4)))  # tanh saves its output
    loss = net[2](hidden).sum()
    hidden.mul_(2)
    loss.backward()

def input_modified():
    x = torch.randn(3, 4)
    w = torch.randn(4, requires_grad=True)
    loss = (w * x).sum()  # saves x for w's gradient
    x.add_(1)
    loss.backward()

def weight_updated_before_backward():
    loss = net(torch.randn(3, 4)).square().mean()  # net[2].weight saved for the hidden grad
    with torch.no_grad():
        net[2].weight.add_(0.1)
    loss.backward()

for step in range(4):
    outcome(f"healthy{step}", healthy)
for name, body in [
    ("activation", activation_modified),
    ("input", input_modified),
    ("weight", weight_updated_before_backward),
]:
    outcome(name, body)
for step in range(2):
    outcome(f"after{step}", healthy)
if sys.argv[1] != "none":
    memtui_agent.stop()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["every", "auto"])
def test_an_in_place_change_to_a_saved_tensor_fails_as_without_the_agent(
    mode: str, shared_python: Any
) -> None:
    without = shared_python(JOB, "none")
    assert without.returncode == 0, without.stderr
    expected = without.stdout.splitlines()
    assert "activation inplace-error" in expected and "weight inplace-error" in expected
    monitored = shared_python(JOB, mode)
    assert monitored.returncode == 0, monitored.stderr
    assert monitored.stdout.splitlines() == expected
