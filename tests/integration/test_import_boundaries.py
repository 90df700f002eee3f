"""The contracts between the halves, proven in fresh interpreters (docs/design.md#the-shape).

`memtui` (CLI, recording reader, report) must work where torch is not installed, and the agent
runs inside training jobs that must never pay for Textual. A bare `agent` package would shadow
or be shadowed by the many RL codebases that have their own `agent.py`.
"""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

pytestmark = pytest.mark.slow  # every test here starts an interpreter


def _modules_after(code: str) -> set[str]:
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "import memtui.commands.cli",
        "import memtui.reports.report, memtui.model.recording",
        "from memtui.commands.cli import build_parser; build_parser().parse_args(['report', 'x'])",
        "import memtui_agent, memtui_protocol.schema, memtui_protocol.wire",
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
        "from memtui.commands.cli import main\n"
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
    """The installed package is `memtui_agent` only. A PYTHONPATH holding the repository root
    (common in a development shell) would find the source folder `agent/` itself, which says
    nothing about the install, so the probe runs without it."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", "import agent"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
        env=env,
    )
    assert result.returncode != 0
    assert "No module named 'agent'" in result.stderr


VIEWER = REPO / "memtui"
BLOCKER = """
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError(f'{{name}} is not importable here (boundary test)')
        return None
sys.meta_path.insert(0, _Refuse())
"""


def _viewer_modules(headless_only: bool) -> list[str]:
    names = []
    for path in sorted(VIEWER.rglob("*.py")):
        parts = path.relative_to(VIEWER.parent).with_suffix("").parts
        if headless_only and parts[:2] == ("memtui", "tui"):
            continue
        if parts[-1] == "__main__":
            continue  # importing it runs the command line
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _run_blocked(blocked: set[str], body: str, cwd: Path | None = None) -> str:
    code = BLOCKER.format(blocked=sorted(blocked)) + body
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_viewer_module_imports_without_torch_and_headless_ones_without_textual() -> None:
    """Over every module, not a chosen few: torch, numpy and the agent nowhere in memtui/,
    Textual only in tui/."""
    headless = _viewer_modules(headless_only=True)
    assert "memtui.commands.tui_commands" in headless and "memtui.reports.report" in headless
    body = "".join(f"import {name}\n" for name in headless)
    _run_blocked({"torch", "numpy", "textual", "memtui_agent"}, body)
    every = _viewer_modules(headless_only=False)
    _run_blocked({"torch", "numpy", "memtui_agent"}, "".join(f"import {name}\n" for name in every))


def test_the_pytest_plugin_loads_nothing_of_memtui_torch_or_textual() -> None:
    """The plugin is loaded by every pytest run where memtui is installed (its `pytest11`
    entry point): importing it, and pytest's configuring it, must cost a test run that never
    asks for it nothing of torch, the agent or the viewer."""
    body = (
        "import memtui_pytest.plugin, sys\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in "
        "('memtui', 'memtui_agent', 'memtui_protocol', 'torch', 'textual')))\n"
    )
    out = _run_blocked({"torch", "textual", "memtui", "memtui_agent", "numpy"}, body)
    assert out.strip() == "[]"


def test_the_protocol_loads_only_the_standard_library_and_msgspec() -> None:
    """Every module of `memtui_protocol`, imported in a fresh interpreter, brings in nothing
    but the standard library and msgspec: both halves, and the attach bootstrap inside a job
    that cannot import memtui, rely on it."""
    protocol = REPO / "protocol" / "memtui_protocol"
    names = ["memtui_protocol"] + [
        f"memtui_protocol.{path.stem}"
        for path in sorted(protocol.glob("*.py"))
        if path.stem != "__init__"
    ]
    assert "memtui_protocol.schema" in names and "memtui_protocol.attach" in names
    loaded = _modules_after("".join(f"import {name}\n" for name in names))
    # What a bare interpreter with msgspec already holds (site's .pth hooks, msgspec's own
    # imports) is not the protocol's doing.
    baseline = _modules_after("import msgspec, msgspec.json, msgspec.structs")
    tops = {name.split(".")[0] for name in loaded - baseline}
    foreign = tops - set(sys.stdlib_module_names) - {"memtui_protocol"}
    assert not foreign, f"memtui_protocol brought in {sorted(foreign)}"


def test_the_attach_reply_goes_through_the_opener_where_msgspec_is_missing(
    tmp_path: Path,
) -> None:
    """The attach bootstrap answers through `attach.write_reply`, inside a job that may lack
    msgspec: `safe_open`, which creates the reply, loads nothing but the standard library
    (`written`, which needs msgspec, only when an existing file is to be replaced)."""
    reply = tmp_path / "reply.json"
    body = (
        "from memtui_protocol.attach import Answer, write_reply\n"
        f"write_reply({str(reply)!r}, Answer.REFUSED, 'the job has not imported torch')\n"
        "import sys\n"
        "print(sorted(n for n in sys.modules if n.startswith(('msgspec', 'memtui_protocol.'))))\n"
    )
    out = _run_blocked({"msgspec"}, body)
    assert out.strip() == "['memtui_protocol.attach', 'memtui_protocol.safe_open']"
    assert json.loads(reply.read_text())["state"] == "refused"
    assert stat.S_IMODE(reply.stat().st_mode) == 0o600


def test_headless_commands_run_with_textual_and_torch_unimportable(
    tmp_path: Path, builder: Any
) -> None:
    """report, export, estimate, attach --list and check, end to end, in an interpreter where
    importing Textual or torch fails."""
    recording = tmp_path / "run.memtui"
    recording.write_bytes(builder.encode_recording(builder.demo_messages()))
    body = f"""
import os
os.environ['XDG_RUNTIME_DIR'] = {str(tmp_path)!r}
from memtui.commands.cli import main
codes = [
    main(['report', {str(recording)!r}]),
    main(['report', {str(recording)!r}, '--json']),
    main(['export', {str(recording)!r}, '--format', 'csv', '-o', {str(tmp_path / "o.csv")!r}]),
    main(['estimate', '--params', '7e9', '--json']),
    main(['attach', '--list']),
    main(['check', {str(recording)!r}, '--max-peak', '1TiB', '--no-leak', '--no-nan']),
]
from memtui.commands.tui_commands import list_jobs_text
print(list_jobs_text([dict(pid=1, started_unix=0, argv=['train.py'])]))
print('codes', codes)
"""
    out = _run_blocked({"torch", "textual"}, body, cwd=tmp_path)
    # attach --list with no live job says so, as an answer (exit 0); check finds the fixture's
    # NaN loss at step 17 (exit 1); the others succeed.
    assert out.strip().splitlines()[-1] == "codes [0, 0, 0, 0, 0, 1]"
    assert "NaN/Inf loss at step 17" in out
    assert "no live memtui jobs" in out


TYPED_WITHOUT_TORCH = [
    "memtui_agent.startup.api",
    "memtui_agent.startup.agent",
    "memtui_agent.startup.agent_state",
    "memtui_agent.job.modules",
]
"""Agent modules whose annotations name torch's types (under `if TYPE_CHECKING:`) while the
modules themselves must load before the job imports torch: the public API, and what `start()`
builds before torch is needed."""


def _type_checking_imports(path: Path) -> set[str]:
    """Modules a file imports inside a top-level `if TYPE_CHECKING:` block."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    found |= {alias.name for alias in inner.names}
                elif isinstance(inner, ast.ImportFrom) and inner.module:
                    found.add(inner.module)
    return found


def test_torch_types_in_annotations_never_import_torch() -> None:
    """Typing the agent with torch's classes costs the job no import: these modules name torch
    in their annotations only, and load in an interpreter where torch cannot be imported."""
    agent = REPO / "agent"
    for name in TYPED_WITHOUT_TORCH:
        path = agent / (name.replace(".", "/") + ".py")
        assert "torch" in _type_checking_imports(path), name
    body = "import memtui_agent\n" + "".join(f"import {name}\n" for name in TYPED_WITHOUT_TORCH)
    _run_blocked({"torch"}, body + "print('loaded')\n")
