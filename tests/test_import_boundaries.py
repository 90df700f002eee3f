"""The contracts between the halves, proven in fresh interpreters (DESIGN.md, "The shape").

`memtui` (CLI, recording reader, report) must work where torch is not installed, and the agent
runs inside training jobs that must never pay for Textual. A bare `agent` package would shadow
or be shadowed by the many RL codebases that have their own `agent.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _modules_after(code: str) -> set[str]:
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "import memtui.cli",
        "import memtui.report, memtui.recording",
        "from memtui.cli import build_parser; build_parser().parse_args(['report', 'x'])",
        "import memtui_agent, memtui_agent.schema, memtui_agent.wire",
    ],
)
def test_viewer_side_never_imports_torch(code: str) -> None:
    modules = _modules_after(code)
    assert "torch" not in modules
    assert not any(name.startswith("torch.") for name in modules)


def test_report_command_runs_without_torch(tmp_path: object) -> None:
    """`memtui report` on a missing file must fail cleanly without importing torch."""
    code = (
        "import sys\n"
        "from memtui.cli import main\n"
        "code = main(['report', '/nonexistent.memtui'])\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('exit', code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "exit 1" in result.stdout


def test_agent_never_imports_textual() -> None:
    code = (
        "import memtui_agent\n"
        "agent = memtui_agent.start(record=None, socket=False)\n"
        "assert agent is not None\n"
        "import torch\n"
        "model = torch.nn.Linear(4, 2)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model(torch.randn(3, 4)).sum().backward(); opt.step()\n"
        "memtui_agent.stop()\n"
    )
    modules = _modules_after(code)
    assert "torch" in modules  # the probe really ran the agent
    assert not any(name == "textual" or name.startswith("textual.") for name in modules)
    assert not any(name == "memtui" or name.startswith("memtui.") for name in modules)


def test_bare_agent_package_is_not_importable() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import agent"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert result.returncode != 0
    assert "No module named 'agent'" in result.stderr
