"""The agent leaves no reference cycles behind in the job, step after step.

Cyclic garbage is work for the job's garbage collector (and, promoted to older generations,
full collections that walk every object of the process): a step under the agent must leave none
that the job without the agent would not leave.
"""

from __future__ import annotations

from typing import Any

import pytest

JOB = """
import gc, sys, torch, memtui_agent
from torch import nn

with memtui_agent.monitor(record=None, socket=False, activations=sys.argv[1]):
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    def step(batch):
        opt.zero_grad()
        model(torch.randn(batch, 8)).square().mean().backward()
        opt.step()
    for _ in range(5):
        step(4)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for batch in (4, 4, 6, 4, 6):  # measured (new shapes) and carried steps
            step(batch)
        gc.collect()
        kinds = sorted({type(obj).__name__ for obj in gc.garbage})
        print("GARBAGE", len(gc.garbage), kinds)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "every"])
def test_steps_under_the_agent_leave_no_cyclic_garbage(mode: str, shared_python: Any) -> None:
    result = shared_python(JOB, mode)
    assert result.returncode == 0, result.stderr
    assert "GARBAGE 0 []" in result.stdout, result.stdout
