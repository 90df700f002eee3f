"""Smoke test of the benchmark command: `benchmarks/run.py --quick` runs and prints every section.

The benchmark is run on demand, not in CI, so nothing else exercises it; without this test a
change to the agent or the viewer could break it unnoticed. Only the exit status and the section
headers are checked: timings on a shared machine mean nothing, and asserting on them would make
the suite flaky.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

pytestmark = pytest.mark.slow  # every test here starts a torch job in a fresh interpreter

RUN = REPO / "benchmarks" / "run.py"
SECTIONS = (
    "== 1. Training overhead ==",
    "== 2. Agent memory ==",
    "== 3. Viewer ==",
    "== 4. Recording size ==",
)


def test_quick_benchmark_prints_every_section(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for section in SECTIONS:
        assert section in done.stdout, f"missing {section!r} in:\n{done.stdout}"


WITHOUT_JOB = """
import torch, memtui_agent
agent = memtui_agent.start(record=None, socket=False, activations="every")  # always armed
parts = agent.parts
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def step():
    opt.zero_grad()
    out = model(torch.randn(2, 4))
    live = dict(parts.ledger._module_live)
    acts = parts.ledger.piles[3]
    out.sum().backward()
    opt.step()
    attributed = sum(size for module, size in live.items() if module >= 0)
    return acts, attributed, len(parts.tracker.arming.grad_hooked)

step()
print("agent", *step())
for kind in ("pack", "modules", "grads", "all"):
    with parts.tracker.without(kind):
        print(kind, *step())
    print("back", *step())
"""


def test_tracker_without_takes_one_kind_of_hook_out_and_puts_it_back(run_python: Any) -> None:
    # benchmarks/ablation.py splits the overhead with this; each kind must really go and return.
    done = run_python(WITHOUT_JOB)
    assert done.returncode == 0, done.stderr
    rows = {}
    backs = []
    for line in done.stdout.splitlines():
        name, *values = line.split()
        numbers = tuple(int(value) for value in values)
        if name == "back":
            backs.append(numbers)
        else:
            rows[name] = numbers
    acts, attributed, hooked = rows["agent"]
    assert acts > 0 and attributed == acts and hooked == 2
    assert rows["pack"][0] == 0  # no saved tensor counted
    assert rows["modules"][0] == acts and rows["modules"][1] == 0  # counted, not attributed
    assert rows["grads"][2] == 0
    assert rows["all"][0] == 0 and rows["all"][2] == 0
    assert backs == [rows["agent"]] * 4
