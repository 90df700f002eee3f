"""The viewer trusts nothing in a runtime directory that is not ours alone (issue 14, D6).

Another user who pre-creates `memtui-<uid>` or plants a sidecar must not make `attach --list`
print escape sequences, make `attach` connect to a socket of their choosing, or cause a
traceback. Another owner is simulated with `os.chown` (these tests need root, as the reliability
tests do), and `MEMTUI_RUNTIME_DIR` points the viewer at the tmp dir.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_harness import MEMTUI

from memtui_protocol import runtime_dir

TIMEOUT_S = 60
STRANGER = 12345
ESCAPE = "\x1b]0;owned\x07\x1b[2J"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _viewer(runtime: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEMTUI_")}
    env["MEMTUI_RUNTIME_DIR"] = str(runtime)
    return subprocess.run(
        [*MEMTUI, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


def _plant(runtime: Path, name: str, content: object, mode: int = 0o600) -> Path:
    """A sidecar for a live pid (this test process), written as an attacker would."""
    path = runtime / f"{name}.json"
    path.write_text(json.dumps(content))
    os.chmod(path, mode)
    return path


def _job(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "pid": os.getpid(),
        "argv": ["python", f"train.py{ESCAPE}"],
        "started_unix": time.time(),
        "recording": f"rec{ESCAPE}.memtui",
    }
    base.update(overrides)
    return base


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[socket.socket]:
    """The socket an attacker would like `attach` to connect to."""
    path = tmp_path / "evil.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def _nobody_connected(sock: socket.socket) -> bool:
    try:
        sock.accept()[0].close()
    except BlockingIOError:
        return True
    return False


def assert_one_line_refusal(result: subprocess.CompletedProcess[str], mentions: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result
    assert len(lines) == 1, result.stderr
    assert mentions in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    assert "\x1b" not in result.stdout + result.stderr


@needs_root
@pytest.mark.parametrize("command", [["attach", "--list"], ["attach"]], ids=["list", "attach"])
@pytest.mark.slow  # starts an interpreter
def test_runtime_dir_owned_by_another_user_is_refused(
    tmp_path: Path, listener: socket.socket, command: list[str]
) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    _plant(runtime, str(os.getpid()), _job(socket=listener.getsockname()))
    (runtime / "12.sock").symlink_to(listener.getsockname())
    os.chown(runtime, STRANGER, STRANGER)
    result = _viewer(runtime, *command)
    assert_one_line_refusal(result, f"owned by uid {STRANGER}")
    assert result.stdout == ""
    assert _nobody_connected(listener)
    assert (runtime / f"{os.getpid()}.json").exists()  # nothing in it touched either


@pytest.mark.slow  # starts an interpreter
def test_runtime_dir_open_to_others_is_refused(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir()
    os.chmod(runtime, 0o777)
    _plant(runtime, str(os.getpid()), _job(socket=str(runtime / "1.sock")))
    assert_one_line_refusal(_viewer(runtime, "attach", "--list"), "accessible to other users")


@needs_root
@pytest.mark.slow  # starts an interpreter
def test_sidecar_owned_by_another_user_is_skipped(tmp_path: Path, listener: socket.socket) -> None:
    runtime = runtime_dir.ensure_private_dir(tmp_path / "rt")
    planted = _plant(runtime, str(os.getpid()), _job(socket=str(runtime / "1.sock")))
    os.chown(planted, STRANGER, STRANGER)
    problems: list[str] = []
    assert runtime_dir.live_sidecars(runtime, problems) == []
    assert len(problems) == 1 and f"owned by uid {STRANGER}" in problems[0]
    result = _viewer(runtime, "attach")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "\x1b" not in result.stderr
    assert "no live memtui jobs" in result.stderr


@pytest.mark.parametrize(
    ("name", "content", "mentions"),
    [
        ("rank", _job(rank="zero"), "not a memtui sidecar"),
        ("pid", _job(pid="1; rm -rf"), "not a memtui sidecar"),
        ("negative-pid", _job(pid=-1), "not a memtui sidecar"),
        ("argv", _job(argv="not a list"), "not a memtui sidecar"),
        ("not-json", None, "not a memtui sidecar"),
        ("outside", _job(socket="/tmp/evil.sock"), "outside"),
    ],
)
@pytest.mark.slow  # starts an interpreter
def test_malformed_sidecar_is_skipped_in_one_line(
    tmp_path: Path, name: str, content: object, mentions: str
) -> None:
    runtime = runtime_dir.ensure_private_dir(tmp_path / "rt")
    if content is None:
        (runtime / "9.json").write_text("{not json\x1b[2J")
        os.chmod(runtime / "9.json", 0o600)
    else:
        assert isinstance(content, dict)
        content.setdefault("socket", str(runtime / "9.sock"))
        _plant(runtime, "9", content)
    result = _viewer(runtime, "attach", "--list")
    assert result.returncode == 0, result  # no job to list is an answer, not an error
    assert result.stdout.startswith("no live memtui jobs")
    assert "Traceback" not in result.stderr
    assert "\x1b" not in result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and mentions in warnings[0], result.stderr


def test_loose_or_linked_sidecar_is_skipped(tmp_path: Path) -> None:
    runtime = runtime_dir.ensure_private_dir(tmp_path / "rt")
    _plant(runtime, "1", _job(socket=str(runtime / "1.sock")), mode=0o666)
    real = _plant(tmp_path, "real", _job(socket=str(runtime / "2.sock")))
    (runtime / "2.json").symlink_to(real)
    fifo = runtime / "3.json"
    os.mkfifo(fifo, 0o600)
    problems: list[str] = []
    assert runtime_dir.live_sidecars(runtime, problems) == []
    assert len(problems) == 3, problems
    assert any("accessible to other users" in line for line in problems)
    assert any("not a regular file" in line for line in problems)


@pytest.mark.slow  # starts an interpreter
def test_attach_list_escapes_control_characters_of_our_own_jobs(tmp_path: Path) -> None:
    """Even a sidecar we wrote carries the job's argv: it is shown, never obeyed."""
    runtime = runtime_dir.ensure_private_dir(tmp_path / "rt")
    _plant(runtime, str(os.getpid()), _job(socket=str(runtime / f"{os.getpid()}.sock")))
    result = _viewer(runtime, "attach", "--list")
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout + result.stderr
    assert "train.py\\x1b]0;owned\\x07" in result.stdout
