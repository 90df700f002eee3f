"""Nothing a job trained is lost or reported as something else (issue 27: L1, L3, L4).

L1: training in the children of a process that imported torch (a driver starting trainers,
multiprocessing workers by fork or spawn) was silently unrecorded under `memtui run -- COMMAND`.
L3: a rerun with the same `-o` whose job wrote nothing showed the earlier run as this one.
L4: a full disk in a session folder read `killed`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from memtui.commands.run_command import PROCESS_INDEX_FILE
from memtui_protocol import schema, wire

MEMTUI = [sys.executable, "-m", "memtui"]


def _memtui(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MEMTUI_RUNTIME_DIR=str(cwd / "rt"))
    return subprocess.run(
        [*MEMTUI, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def _recording(path: Path, status: str = "ok", code: int = 0) -> Path:
    """A finished run's recording, as an earlier run would have left it."""
    messages: list[schema.Message] = [
        schema.Hello(
            format_version=schema.FORMAT_VERSION,
            agent_version="earlier",
            pid=1,
            argv=["python", "earlier.py"],
            started="2026-01-01T00:00:00+00:00",
            started_unix=1.0,
        ),
        schema.End(time=2.0, status=status, code=code),
    ]
    path.write_bytes(wire.preamble() + b"".join(wire.encode(m) for m in messages))
    return path


# ----- L3: a rerun with the same -o -----------------------------------------------------------


def test_a_rerun_that_records_nothing_does_not_show_the_earlier_run(tmp_path: Path) -> None:
    """The earlier run's file is replaced as the new run starts: its summary used to read
    `job ok (exit code 3)` from the earlier run's recording."""
    out = _recording(tmp_path / "run.memtui")
    (tmp_path / "run.memtui.log").write_text("earlier output\n")
    script = tmp_path / "fails.py"
    script.write_text("raise SystemExit(3)\n")
    result = _memtui("run", "--headless", "-o", str(out), str(script), cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "job ok" not in result.stderr
    assert "no recording was written" in result.stderr
    assert not out.exists() and not (tmp_path / "run.memtui.log").exists()


def test_a_rerun_into_a_session_folder_starts_it_afresh(tmp_path: Path) -> None:
    folder = tmp_path / "session"
    folder.mkdir()
    _recording(folder / "proc-0.memtui")
    _recording(folder / "rank-1.memtui")
    (folder / PROCESS_INDEX_FILE).write_text("7")
    keep = folder / "notes.txt"
    keep.write_text("the user's own file")
    result = _memtui(
        "run", "--headless", "-o", str(folder), "--", sys.executable, "-c", "raise SystemExit(3)",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "0 recording(s)" in result.stderr and "ok after" not in result.stderr
    assert sorted(path.name for path in folder.iterdir()) == ["notes.txt"]


def test_the_process_counter_name_is_the_agents() -> None:
    from memtui_agent.startup import autostart

    assert PROCESS_INDEX_FILE == autostart.PROCESS_INDEX_FILE
