"""A job that trains a TorchScript module is recorded: torch refuses hooks on a `ScriptModule`,
and the agent's attempt to put its root hooks there turned its module and step hooks off for the
run (0 steps recorded). In-process: the agent's built parts around a scripted model."""

from __future__ import annotations

import pytest
import torch

from memtui_agent.startup.parts import build_parts
from memtui_protocol.config import AgentConfig


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_scripted_model_is_trained_and_recorded_without_a_failure() -> None:
    said: list[tuple[object, ...]] = []
    parts = build_parts(AgentConfig(), lambda item: None, lambda *failure: said.append(failure))
    parts.install()
    try:
        scripted = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()))
        optimizer = torch.optim.SGD(scripted.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            scripted(torch.randn(2, 4)).sum().backward()
            optimizer.step()
    finally:
        parts.remove()
    assert said == []
    assert parts.steps_recorded() == (3, 3)
