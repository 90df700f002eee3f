"""The agent is invisible in the job's output (issue 26): a job prints under `memtui run` exactly
what it prints under plain `python`, memtui's own `memtui:` lines aside.

`torch.compile(module)` warns at each call site when global module hooks exist (they fire an
extra time for the OptimizedModule); the agent's own global hooks must not make a job print it,
and a job with global hooks of its own must still get it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import MEMTUI

pytestmark = pytest.mark.slow  # each test runs torch jobs in fresh interpreters

COMPILED = """\
import sys
import torch

if "--own-hook" in sys.argv:
    torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
compiled = torch.compile(model, backend="eager")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = compiled(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
with torch.no_grad():
    compiled(torch.randn(2, 8))  # a second call site, as an evaluation loop has
print("done")
"""
WARNING = "Using `torch.compile(module)` when there are global hooks on modules"


def _both(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], ...]:
    """The job under plain python, then under `memtui run --headless`."""
    (tmp_path / "train.py").write_text(COMPILED)
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEMTUI_")}
    env.update(MEMTUI_RUNTIME_DIR=str(tmp_path / "rt"), OMP_NUM_THREADS="1")
    runs = []
    for command in (
        [sys.executable, "train.py", *args],
        [*MEMTUI, "run", "--headless", "--no-record", "train.py", *args],
    ):
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        runs.append(result)
    return tuple(runs)


def _jobs_own(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("memtui: ")]


def test_a_compiled_job_prints_what_a_plain_run_prints(tmp_path: Path) -> None:
    plain, monitored = _both(tmp_path)
    assert WARNING not in plain.stderr
    assert _jobs_own(monitored.stderr) == _jobs_own(plain.stderr)
    assert monitored.stdout == plain.stdout == "done\n"


def test_a_jobs_own_global_hooks_still_get_torchs_warning(tmp_path: Path) -> None:
    plain, monitored = _both(tmp_path, "--own-hook")
    assert WARNING in plain.stderr
    assert _jobs_own(monitored.stderr) == _jobs_own(plain.stderr)
