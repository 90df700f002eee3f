"""The agent imports nothing while it measures (issue 32).

What a module's import allocates stays allocated. A close that imported something (psutil, at
the first close, after the step's heap reading) put those bytes into the next step's forward,
and the step after that, a repeat of it, could not confirm the repeat: an attached job's third
recorded step said its activations were not known whenever nothing had imported psutil before
(`tests/integration/test_attach.py` on a loaded machine: `assert 0 == 6272`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import json, os, sys, torch
import memtui_agent

AGENT = os.path.dirname(memtui_agent.__file__)
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 1)

def step():
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

for _ in range(2):
    step()  # torch's own first-use imports, before the agent
recording = False
imported = []

def audit(event, args):
    # Every import the agent's code makes while the job steps under it.
    if event != "import" or not recording:
        return
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(AGENT):
            imported.append([args[0], os.path.basename(frame.f_code.co_filename)])
            return
        frame = frame.f_back

sys.addaudithook(audit)
memtui_agent.start(record="rec.memtui")
recording = True
for _ in range(6):
    step()
recording = False
memtui_agent.stop()
print(json.dumps(imported))
"""


@pytest.mark.slow  # a torch job in a fresh interpreter
def test_the_agent_imports_nothing_while_the_job_steps_under_it(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []
