"""The private runtime directory where live jobs publish their sockets and sidecars.

Both halves use it: the agent creates sockets and sidecars here, `memtui attach` lists them. The
directory is created 0700 and verified (owned by us, not a symlink, no group/other access)
before use, because anyone who could write here could impersonate a job.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

SIDECAR_SUFFIX = ".json"
SOCKET_SUFFIX = ".sock"


class RuntimeDirError(OSError):
    """The runtime directory exists but is not safe to use."""


def runtime_dir() -> Path:
    """`$MEMTUI_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/memtui`, else `/tmp/memtui-<uid>`."""
    override = os.environ.get("MEMTUI_RUNTIME_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "memtui"
    return Path(tempfile.gettempdir()) / f"memtui-{os.getuid()}"


def ensure_private_dir(path: Path | None = None) -> Path:
    """Create the runtime directory if needed and check it is ours alone.

    Raises:
        RuntimeDirError: if it is a symlink, not a directory, owned by someone else, or open
            to group or others.
    """
    path = path or runtime_dir()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"{path} is not a plain directory")
    if info.st_uid != os.getuid():
        raise RuntimeDirError(f"{path} is owned by uid {info.st_uid}, not by you")
    if info.st_mode & 0o077:
        raise RuntimeDirError(f"{path} is accessible to other users (mode {info.st_mode:o})")
    return path


def write_sidecar(directory: Path, name: str, content: dict[str, Any]) -> Path:
    """Atomically publish a job's discovery record (write to a temp file, then rename)."""
    final = directory / f"{name}{SIDECAR_SUFFIX}"
    temporary = directory / f".{name}{SIDECAR_SUFFIX}.tmp"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(content, handle)
    os.replace(temporary, final)
    return final


def pid_alive(pid: int, create_time: float | None = None) -> bool:
    """Whether `pid` runs and, when `create_time` is known, is the same process (not a reuse).

    The pid comes from files (recordings, sidecars): 0 and negative values would signal process
    groups, and huge ones overflow, so anything that cannot be a single process is "not alive".
    """
    if not isinstance(pid, int) or pid <= 0 or pid > 2**31 - 1:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    if create_time is None:
        return True
    try:
        import psutil

        return abs(psutil.Process(pid).create_time() - create_time) < 1.0
    except Exception:
        return True


def live_sidecars(directory: Path | None = None) -> list[dict[str, Any]]:
    """Every live job's sidecar; stale ones (dead pid) and their sockets are removed."""
    directory = directory or runtime_dir()
    if not directory.is_dir():
        return []
    jobs = []
    for orphan in directory.glob(f"*{SOCKET_SUFFIX}"):
        # A socket whose job died before writing (or after removing) its sidecar.
        stem = orphan.name.removesuffix(SOCKET_SUFFIX)
        has_sidecar = (directory / f"{stem}{SIDECAR_SUFFIX}").exists()
        if stem.isdigit() and not has_sidecar and not pid_alive(int(stem)):
            try:
                orphan.unlink()
            except OSError:
                pass
    for path in sorted(directory.glob(f"*{SIDECAR_SUFFIX}")):
        try:
            content = json.loads(path.read_text())
            pid = int(content["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if pid_alive(pid, content.get("process_create_time")):
            jobs.append(content)
            continue
        for stale in (path, Path(str(content.get("socket", "")))):
            if stale.name and stale.parent == directory:
                try:
                    stale.unlink()
                except OSError:
                    pass
    return jobs
