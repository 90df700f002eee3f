"""The `-- COMMAND` bootstrap `sitecustomize` leaves each interpreter as it would be without it.

Each check runs a fresh interpreter twice, with and without the bootstrap folder first on
PYTHONPATH, and compares what the user can observe: their own sitecustomize's errors, what
`import sitecustomize` gives, and stderr. No torch is imported, so these are quick.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import scrubbed_env

from memtui.commands.run_command import bootstrap_dir

pytestmark = pytest.mark.slow  # every test here starts an interpreter

TIMEOUT_S = 60
_CONSOLE = Path(sys.executable).with_name("memtui")
MEMTUI = [str(_CONSOLE)] if _CONSOLE.exists() else [sys.executable, "-m", "memtui"]

PROBE = """\
import sys
print("loaded:", sys.modules.get("sitecustomize") and sys.modules["sitecustomize"].__name__,
      getattr(sys.modules.get("sitecustomize"), "MARK", None))
try:
    import sitecustomize
    print("import:", getattr(sitecustomize, "MARK", None))
except ImportError as exc:
    print("import failed:", type(exc).__name__, exc.name)
"""


def _env(*path: Path, **extra: str) -> dict[str, str]:
    """The scrubbed environment with `path` as the whole PYTHONPATH (none when empty)."""
    env = scrubbed_env()
    env.pop("PYTHONPATH", None)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(str(entry) for entry in path)
    env.update(extra)
    return env


def _python(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _compare(tmp_path: Path, user_dir: Path | None) -> None:
    """Same stdout and stderr with and without the bootstrap in front of the user's folder."""
    folders = [user_dir] if user_dir is not None else []
    plain = _python(PROBE, _env(*folders), tmp_path)
    ours = _python(PROBE, _env(bootstrap_dir(), *folders), tmp_path)
    assert (ours.stdout, ours.stderr) == (plain.stdout, plain.stderr)
    assert ours.returncode == plain.returncode


def test_import_error_inside_the_users_sitecustomize_surfaces_as_without_memtui(
    tmp_path: Path,
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import memtui_no_such_module_here\n")
    plain = _python("pass", _env(user), tmp_path)
    assert "No module named 'memtui_no_such_module_here'" in plain.stderr  # the baseline
    _compare(tmp_path, user)


def test_other_errors_in_the_users_sitecustomize_surface_as_without_memtui(
    tmp_path: Path,
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("MARK = 1\nraise ValueError('user boom')\n")
    _compare(tmp_path, user)


def test_import_sitecustomize_gives_the_users_module(tmp_path: Path) -> None:
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("MARK = 'users'\n")
    ours = _python(PROBE, _env(bootstrap_dir(), user), tmp_path)
    assert ours.stdout.splitlines() == ["loaded: sitecustomize users", "import: users"]
    _compare(tmp_path, user)


def test_without_a_user_sitecustomize_none_is_loaded(tmp_path: Path) -> None:
    """The interpreter's own site-packages may hold one: then the same one, as without us."""
    _compare(tmp_path, None)


def _shadow_agent(tmp_path: Path) -> Path:
    """A folder whose `memtui_agent` cannot be imported, as in a Python without memtui."""
    shadow = tmp_path / "shadow"
    (shadow / "memtui_agent").mkdir(parents=True)
    (shadow / "memtui_agent" / "__init__.py").write_text("raise ImportError('not installed')\n")
    return shadow


def test_python_without_memtui_writes_nothing_on_its_own_stderr(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("")
    env = _env(bootstrap_dir(), _shadow_agent(tmp_path), MEMTUI_NOTES=str(notes))
    result = _python("print('hi')", env, tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (0, "hi\n", "")
    assert "agent unavailable" in notes.read_text()


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="needs a POSIX shell")
def test_memtui_run_says_agent_unavailable_once_not_in_the_commands_output(
    tmp_path: Path,
) -> None:
    """`$(python -c ... 2>&1)` inside the command captures only what the job prints."""
    script = (
        f'export PYTHONPATH="$PYTHONPATH:{_shadow_agent(tmp_path)}"; '
        f'out=$("{sys.executable}" -c "print(1)" 2>&1); echo "[$out]"; '
        f'"{sys.executable}" -c "pass"'
    )
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = _env(MEMTUI_RUNTIME_DIR=str(tmp_path / "rt"), TMPDIR=str(scratch))
    result = subprocess.run(
        [*MEMTUI, "run", "--headless", "--no-record", "--", "/bin/sh", "-c", script],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[1]\n"
    assert result.stderr.count("agent unavailable") == 1, result.stderr
    assert "(2 processes)" in result.stderr
    assert list(scratch.iterdir()) == []  # the notes file is gone
