"""The private runtime directory where live jobs publish their sockets and sidecars.

Both halves use it: the agent creates sockets and sidecars here, `memtui attach` lists them. The
directory is created 0700 and verified (owned by us, not a symlink, no group/other access)
before use, by the agent and by the viewer alike, because anyone who could write here could
impersonate a job: point `attach` at a socket of their choosing, or put escape sequences on the
viewer's terminal. Each sidecar is checked the same way (a regular file of ours, private, small)
and decoded into the `Sidecar` schema; one that fails is skipped and said in one line.
"""

from __future__ import annotations

import os
import signal
import stat
import tempfile
from pathlib import Path
from typing import Annotated, Any

import msgspec

from memtui_protocol.os_text import carried
from memtui_protocol.safe_open import RefusedPath, Replace, create_in, open_folder, open_own

SIDECAR_SUFFIX = ".json"
SOCKET_SUFFIX = ".sock"
MAX_SIDECAR_BYTES = 64 * 1024
"""A sidecar is a few hundred bytes; a bound keeps a planted huge file from costing memory."""

Pid = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]


class Sidecar(msgspec.Struct, forbid_unknown_fields=False):
    """A live job's discovery record: what `memtui attach` lists and where it connects."""

    pid: Pid
    socket: str
    argv: list[str] = []
    started: str | None = None
    started_unix: float | None = None
    recording: str | None = None
    rank: Annotated[int, msgspec.Meta(ge=0)] | None = None
    process_create_time: float | None = None
    session: str | None = None


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
    check_private_dir(path)
    _usable(path)
    return path


def _usable(path: Path) -> None:
    """Give the owner back the rights a job's umask took (a job that ran `umask(0o777)` made
    this folder 000, and every later job lost its socket): the mode is set explicitly to
    0700, on the folder itself, never through a link.

    A folder of mode 000 cannot be opened for reading by its owner (only root ignores modes),
    so it is then opened with `O_PATH`, which needs no right on the folder itself, checked
    through that descriptor, and given its mode through `/proc/self/fd/N`, which names the
    opened folder and nothing a link planted at `path` since could point to (`fchmod` refuses
    an `O_PATH` descriptor).
    """
    flags = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        descriptor = os.open(path, os.O_RDONLY | flags)
        by_path = False
    except PermissionError:
        descriptor = os.open(path, getattr(os, "O_PATH", os.O_RDONLY) | flags)
        by_path = True
    try:
        info = os.fstat(descriptor)
        _check_private(path, info)
        if stat.S_IMODE(info.st_mode) != 0o700:
            if by_path:
                os.chmod(f"/proc/self/fd/{descriptor}", 0o700)
            else:
                os.fchmod(descriptor, 0o700)
    finally:
        os.close(descriptor)


def check_private_dir(path: Path) -> None:
    """Refuse a runtime directory that is not ours alone (see `ensure_private_dir`)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"{path} is not a plain directory")
    _check_private(path, info)


def _check_private(path: Path, info: os.stat_result) -> None:
    if info.st_uid != os.getuid():
        raise RuntimeDirError(f"{path} is owned by uid {info.st_uid}, not by you")
    if info.st_mode & 0o077:
        mode = stat.S_IMODE(info.st_mode)
        raise RuntimeDirError(f"{path} is accessible to other users (mode {mode:o})")


def write_sidecar(directory: Path, name: str, content: Sidecar) -> Path:
    """Atomically publish a job's discovery record (write to a temp file, then rename), both
    names relative to the folder opened once (never through a link planted in its place)."""
    final = f"{name}{SIDECAR_SUFFIX}"
    temporary = f".{name}{SIDECAR_SUFFIX}.tmp"
    folder = open_folder(directory)
    try:
        _check_private(directory, os.fstat(folder))
        # A leftover of a killed job with a reused pid is replaced (the folder is ours alone).
        descriptor = create_in(folder, temporary, directory / temporary, replaces=Replace.OWN_FILE)
        with os.fdopen(descriptor, "wb") as handle:
            try:
                encoded = msgspec.json.encode(content)
            except UnicodeEncodeError:  # argv or a path with a byte that is not UTF-8
                encoded = msgspec.json.encode(carried(content))
            handle.write(encoded)
        os.replace(temporary, final, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(folder)
    return directory / final


def read_sidecar(path: Path, directory: Path) -> Sidecar:
    """One sidecar, trusted only if it is a small private regular file of ours that decodes
    into `Sidecar` and names a socket inside `directory`.

    Raises:
        RuntimeDirError: anything else, in one line.
    """
    try:
        descriptor = open_own(path, os.O_RDONLY)
    except RefusedPath as exc:
        raise RuntimeDirError(str(exc)) from None
    except OSError as exc:
        raise RuntimeDirError(f"{path}: cannot open ({exc.strerror or exc})") from None
    try:
        _check_private(path, os.fstat(descriptor))
        data = os.read(descriptor, MAX_SIDECAR_BYTES + 1)
    finally:
        os.close(descriptor)
    if len(data) > MAX_SIDECAR_BYTES:
        raise RuntimeDirError(f"{path}: larger than {MAX_SIDECAR_BYTES} bytes")
    try:
        sidecar = msgspec.json.decode(data, type=Sidecar)
    except msgspec.DecodeError as exc:
        raise RuntimeDirError(f"{path}: not a memtui sidecar ({exc})") from None
    socket_path = Path(sidecar.socket)
    if socket_path.parent != directory or not socket_path.name.endswith(SOCKET_SUFFIX):
        raise RuntimeDirError(f"{path}: names a socket outside {directory}")
    return sidecar


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
        return not process_ending(pid)
    if process_ending(pid):
        return False  # a zombie, or killed: it will never write again
    if create_time is None:
        return True
    now = process_create_time(pid)
    return now is None or abs(now - create_time) < 1.0


PF_EXITING = 0x4
"""`/proc/PID/stat` flags (field 9): the process is in `do_exit`."""
_SIGKILL_BIT = 1 << (signal.SIGKILL - 1)


def process_ending(pid: int) -> bool:
    """Whether `pid` will never run its own code again, though `kill(pid, 0)` still finds it:
    a zombie (dead, not yet reaped by its parent: `memtui run` or a shell reaps it only when
    it gets to it), a process in its exit, or one with SIGKILL pending (a process-group
    SIGKILL a moment ago). False where /proc cannot tell (another OS): alive, as before."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as handle:
            stat_line = handle.read()
        # The command name (field 2) may hold spaces and parentheses: count after its end.
        fields = stat_line[stat_line.rindex(b")") + 2 :].split()
        state, flags = fields[0], int(fields[6])  # fields 3 and 9
    except (OSError, ValueError, IndexError):
        return False
    if state in (b"Z", b"X", b"x") or flags & PF_EXITING:
        return True
    try:
        with open(f"/proc/{int(pid)}/status", "rb") as handle:
            for line in handle:
                pending = line.startswith((b"SigPnd:", b"ShdPnd:"))
                if pending and int(line.split()[1], 16) & _SIGKILL_BIT:
                    return True
    except (OSError, ValueError, IndexError):
        pass
    return False


def process_create_time(pid: int) -> float | None:
    """When `pid` started, in Unix time, as psutil's `Process.create_time()` computes it on
    Linux (the process's start in clock ticks after boot, plus the boot time); None where
    /proc cannot tell. Read here without psutil: the protocol imports only the standard library
    and msgspec."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as handle:
            stat_line = handle.read()
        with open("/proc/stat", "rb") as handle:
            boot = next(float(line.split()[1]) for line in handle if line.startswith(b"btime "))
        # The command name (field 2) may hold spaces and parentheses: count after its end.
        fields = stat_line[stat_line.rindex(b")") + 2 :].split()
        ticks = float(fields[19])  # field 22, starttime
        return ticks / os.sysconf("SC_CLK_TCK") + boot
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def live_sidecars(
    directory: Path | None = None, problems: list[str] | None = None
) -> list[dict[str, Any]]:
    """Every live job's sidecar; stale ones (dead pid) and their sockets are removed.

    Args:
        problems: receives one line per sidecar skipped as untrustworthy or malformed.

    Raises:
        RuntimeDirError: the directory exists but is not ours alone; nothing in it is read.
    """
    directory = directory or runtime_dir()
    if not os.path.lexists(directory):
        return []
    check_private_dir(directory)
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
            sidecar = read_sidecar(path, directory)
        except RuntimeDirError as exc:
            if problems is not None:
                problems.append(f"skipped {exc}")
            continue
        if pid_alive(sidecar.pid, sidecar.process_create_time):
            jobs.append(msgspec.structs.asdict(sidecar))
            continue
        for stale in (path, Path(sidecar.socket)):
            if stale.name and stale.parent == directory:
                try:
                    stale.unlink()
                except OSError:
                    pass
    return jobs
