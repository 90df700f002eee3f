"""Whether `memtui attach PID` may inject into a process: each refusal one line, nothing touched.

Everything here reads `/proc` (and, for gdb, the ptrace policy); nothing stops, signals or traces
the target. The process is pinned first (`pin_process`: a pidfd, its uid and start time), every
check reads that process, and the pin is confirmed again right before the injection, so a pid
that changed hands meanwhile is refused, never injected into. The checks run in the order a user
would fix them: the process exists and is theirs, it is Python, of memtui's version, has
imported torch, allows remote debugging, and this machine lets us trace it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
PTRACE_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
CAP_SYS_PTRACE = 19
MIN_PYTHON = (3, 10)
REMOTE_EXEC_PYTHON = (3, 14)
"""From here on `sys.remote_exec` delivers the bootstrap; before it, gdb."""

PTRACE_FIX = (
    "allow it with `sudo sysctl kernel.yama.ptrace_scope=0`, or give the tracer CAP_SYS_PTRACE "
    "(`sudo setcap cap_sys_ptrace=eip $(command -v gdb)`), or in a container start it with "
    "`docker run --cap-add=SYS_PTRACE`"
)
GDB_MISSING = (
    "gdb is needed to attach to Python {version} and is not installed: "
    "`apt-get install gdb` (Debian, Ubuntu) or `dnf install gdb` (Fedora, RHEL)"
)


class AttachRefused(Exception):
    """The attach cannot go ahead; `str()` is the one line to show. The job was not touched."""


@dataclass(frozen=True)
class Pin:
    """What makes a pid one process and no other: its real uid, its start time (clock ticks
    after boot, field 22 of /proc/PID/stat: a reused pid has another) and, where the kernel has
    them, a pidfd (which names the process itself, never a later one with its pid)."""

    uid: int
    start_ticks: int
    pidfd: int | None = None


@dataclass(frozen=True)
class Target:
    """A process that passed the checks."""

    pid: int
    python: tuple[int, int]
    argv: list[str]
    pin: Pin | None = None
    """The process the checks were made on; `confirm_pin` right before injecting."""


REUSED = (
    "pid {pid} is no longer the process memtui checked (it ended and its pid was reused); "
    "nothing was injected"
)


def read_pin(pid: int) -> tuple[int, int]:
    """(real uid, start ticks) of `pid` now.

    Raises:
        AttachRefused: no such process.
    """
    folder = PROC / str(pid)
    try:
        stat_line = (folder / "stat").read_bytes()
        status = (folder / "status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise AttachRefused(f"no process with pid {pid} (it has ended?)") from None
    except OSError as exc:
        raise AttachRefused(f"cannot read /proc/{pid}: {exc.strerror or exc}") from None
    try:
        # The command name (field 2) may hold spaces and parentheses: count after its end.
        ticks = int(stat_line[stat_line.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        raise AttachRefused(f"cannot read /proc/{pid}/stat") from None
    uid = _field(status, "Uid")
    if uid is None:
        raise AttachRefused(f"cannot read the owner of pid {pid}")
    return uid, ticks


def pin_process(pid: int) -> Pin:
    """Pin `pid` to the process that has it now: a pidfd first (where available), then the
    uid and start time read while that pidfd shows the same process alive.

    Raises:
        AttachRefused: no such process.
    """
    pidfd = None
    opener = getattr(os, "pidfd_open", None)
    if opener is not None:
        try:
            pidfd = opener(pid)
        except ProcessLookupError:
            raise AttachRefused(f"no process with pid {pid} (it has ended?)") from None
        except OSError:
            pidfd = None  # an old kernel: the start time alone pins it
    try:
        uid, ticks = read_pin(pid)
        pin = Pin(uid=uid, start_ticks=ticks, pidfd=pidfd)
        confirm_pin(pid, pin)  # the pidfd's process is the one whose start time was read
    except BaseException:
        release_pin(Pin(0, 0, pidfd))
        raise
    return pin


def confirm_pin(pid: int, pin: Pin | None) -> None:
    """Refuse unless `pid` is still the pinned process: the pidfd's process alive, and the
    same uid and start time. Called at the end of the checks and again right before the
    injection.

    Raises:
        AttachRefused: the process ended, or its pid now names another one.
    """
    if pin is None:
        return
    if pin.pidfd is not None:
        try:
            signal.pidfd_send_signal(pin.pidfd, 0)
        except ProcessLookupError:
            raise AttachRefused(
                f"pid {pid} ended after memtui checked it; nothing was injected"
            ) from None
        except PermissionError:
            pass  # alive (signal 0 to a process we may not signal): the start time decides
    if read_pin(pid) != (pin.uid, pin.start_ticks):
        raise AttachRefused(REUSED.format(pid=pid))


def release_pin(pin: Pin | None) -> None:
    """Close the pin's pidfd."""
    if pin is not None and pin.pidfd is not None:
        try:
            os.close(pin.pidfd)
        except OSError:
            pass


def check_target(pid: int, need_torch: bool = True) -> Target:
    """Every refusal that can be decided without touching the process.

    Raises:
        AttachRefused: dead pid, another user's process, not Python, another Python version,
            torch not imported, remote debugging disabled.
    """
    if pid <= 0 or pid > 2**31 - 1:
        raise AttachRefused(f"{pid} is not a process id")
    if pid == os.getpid():
        raise AttachRefused("memtui cannot attach to itself")
    pin = pin_process(pid)
    try:
        return _checked(pid, pin, need_torch)
    except BaseException:
        release_pin(pin)
        raise


def _checked(pid: int, pin: Pin, need_torch: bool) -> Target:
    """`check_target`'s checks on the process `pin` holds."""
    folder = PROC / str(pid)
    uid = pin.uid
    if uid != os.getuid():
        raise AttachRefused(another_user(pid, uid))
    try:
        maps = (folder / "maps").read_text(errors="replace")
        exe = os.readlink(folder / "exe")
        argv = [
            part.decode(errors="replace")
            for part in (folder / "cmdline").read_bytes().split(b"\0")
            if part
        ]
    except FileNotFoundError:
        raise AttachRefused(f"no process with pid {pid} (it has ended?)") from None
    except PermissionError:
        raise AttachRefused(f"cannot read /proc/{pid}: {ptrace_denied(pid)}") from None
    version = python_version(maps, exe)
    if version is None:
        raise AttachRefused(f"pid {pid} is not a Python process (it runs {exe})")
    ours = tuple(sys.version_info[:2])
    if version < MIN_PYTHON:
        raise AttachRefused(f"pid {pid} runs Python {_dotted(version)}; memtui needs 3.10 or newer")
    if version != ours:
        raise AttachRefused(
            f"pid {pid} runs Python {_dotted(version)} and this memtui runs on {_dotted(ours)}: "
            f"use the memtui of a Python {_dotted(version)} environment (pip install memtui there)"
        )
    if need_torch and "libtorch_python" not in maps:
        raise AttachRefused(f"pid {pid} has not imported torch: there is nothing to monitor yet")
    if remote_debug_disabled(folder, argv):
        raise AttachRefused(
            f"pid {pid} disabled remote debugging (PYTHON_DISABLE_REMOTE_DEBUG or "
            "-X disable_remote_debug): memtui will not inject code into it"
        )
    confirm_pin(pid, pin)  # everything above was read from the pinned process
    return Target(pid=pid, python=version, argv=argv, pin=pin)


def imported_torch(pid: int) -> bool | None:
    """Whether `pid` has loaded torch's Python bindings (None: its memory map is unreadable)."""
    try:
        return "libtorch_python" in (PROC / str(pid) / "maps").read_text(errors="replace")
    except OSError:
        return None


MAX_DESCENDANTS = 256
"""Processes looked at below a pid (a launcher's ranks and their workers)."""


def descendants(pid: int) -> list[int]:
    """`pid`'s children, then theirs, each level in order of pid (read from `/proc`)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [entry for entry in PROC.iterdir() if entry.name.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    level = [pid]
    while level and len(found) < MAX_DESCENDANTS:
        level = sorted(child for parent in level for child in children.get(parent, []))
        found.extend(level)
    return found[:MAX_DESCENDANTS]


def _field(status: str, name: str) -> int | None:
    """The real id of a `/proc/PID/status` line such as `Uid:  1000 1000 1000 1000`."""
    for line in status.splitlines():
        if line.startswith(f"{name}:"):
            parts = line.split()
            return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    return None


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def python_version(maps: str, exe: str) -> tuple[int, int] | None:
    """The CPython version of a process: its libpython, else its executable's name."""
    found = re.search(r"libpython(\d+)\.(\d+)", maps)
    if found is None:
        found = re.fullmatch(r"python(\d+)\.(\d+)", Path(exe).name.removesuffix(" (deleted)"))
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2))


def remote_debug_disabled(folder: Path, argv: list[str]) -> bool:
    """PEP 768's opt-outs, honoured for every Python version (gdb included)."""
    try:
        environ = (folder / "environ").read_bytes().split(b"\0")
    except OSError:
        environ = []
    for entry in environ:
        name, _, value = entry.partition(b"=")
        if name == b"PYTHON_DISABLE_REMOTE_DEBUG" and value:
            return True
    for index, word in enumerate(argv):
        if word == "-Xdisable_remote_debug":
            return True
        if word == "-X" and argv[index + 1 : index + 2] == ["disable_remote_debug"]:
            return True
    return False


def ptrace_scope(scope_file: Path = PTRACE_SCOPE) -> int | None:
    """Yama's `ptrace_scope`: 0 any process of the same user; 1 descendants only and 2 nobody,
    each unless the tracer holds CAP_SYS_PTRACE; 3 nobody at all until reboot. None: no Yama."""
    try:
        return int(scope_file.read_text().strip())
    except (OSError, ValueError):
        return None


def ptrace_refusal(scope_file: Path = PTRACE_SCOPE, status_file: Path | None = None) -> str | None:
    """Why this machine will not let us trace another process of ours, decided before trying
    (None: it may). Scopes 1 and 2 are refused only where neither we hold CAP_SYS_PTRACE nor
    could gdb (a file capability): gdb itself then answers, and `ptrace_message` explains."""
    scope = ptrace_scope(scope_file)
    if scope == 3:
        return "ptrace is disabled on this machine until reboot (kernel.yama.ptrace_scope=3)"
    if scope not in (1, 2):
        return None
    if has_capability(CAP_SYS_PTRACE, status_file or PROC / "self" / "status"):
        return None
    return None if _gdb_has_ptrace_capability() else ptrace_message(scope)


def _gdb_has_ptrace_capability() -> bool:
    import subprocess

    gdb = shutil.which("gdb")
    if gdb is None or shutil.which("getcap") is None:
        return False
    try:
        found = subprocess.run(
            ["getcap", gdb], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "cap_sys_ptrace" in found


def ptrace_message(scope: int | None) -> str:
    """The one line for Yama's policy refusing a trace, with its value and the fix."""
    meaning = SCOPE_MEANINGS.get(scope, "") if scope is not None else ""
    policy = f" (kernel.yama.ptrace_scope={scope}{': ' + meaning if meaning else ''})"
    return f"ptrace is not permitted here{policy if scope is not None else ''}: {PTRACE_FIX}"


SCOPE_MEANINGS = {
    1: "a process may trace only its own descendants",
    2: "only a tracer with CAP_SYS_PTRACE may trace",
}
CAPABILITY_NAMES = (
    "chown",
    "dac_override",
    "dac_read_search",
    "fowner",
    "fsetid",
    "kill",
    "setgid",
    "setuid",
    "setpcap",
    "linux_immutable",
    "net_bind_service",
    "net_broadcast",
    "net_admin",
    "net_raw",
    "ipc_lock",
    "ipc_owner",
    "sys_module",
    "sys_rawio",
    "sys_chroot",
    "sys_ptrace",
    "sys_pacct",
    "sys_admin",
    "sys_boot",
    "sys_nice",
    "sys_resource",
    "sys_time",
    "sys_tty_config",
    "mknod",
    "lease",
    "audit_write",
    "audit_control",
    "setfcap",
    "mac_override",
    "mac_admin",
    "syslog",
    "wake_alarm",
    "block_suspend",
    "audit_read",
    "perfmon",
    "bpf",
    "checkpoint_restore",
)
"""Linux capabilities by bit (capability.h), for naming what a process holds that we lack."""
CONTAINER_MARKERS = (Path("/.dockerenv"), Path("/run/.containerenv"))


def ptrace_denied(
    pid: int,
    scope_file: Path = PTRACE_SCOPE,
    own_status: Path | None = None,
    target_status: Path | None = None,
) -> str:
    """Why the kernel refused to let memtui read or trace `pid`, told apart from what can be
    read: Yama's policy (only where it exists and forbids it: the sysctl hint with its actual
    value), another user's process, a process holding capabilities memtui lacks, a container
    without CAP_SYS_PTRACE; else the causes left (a process that is not dumpable, a security
    module), never a fix that does not apply here."""
    own = own_status or PROC / "self" / "status"
    target = target_status or PROC / str(pid) / "status"
    scope = ptrace_scope(scope_file)
    traces = has_capability(CAP_SYS_PTRACE, own)
    if scope == 3:
        return "ptrace is disabled on this machine until reboot (kernel.yama.ptrace_scope=3)"
    if scope in (1, 2) and not traces:
        return ptrace_message(scope)
    try:
        owner = _field(target.read_text(), "Uid")
    except OSError:
        return f"no process with pid {pid} (it has ended?)"
    if owner is not None and owner != os.getuid():
        return another_user(pid, owner)
    extra = _capabilities(target, "CapPrm") & ~_capabilities(own, "CapPrm")
    held = ", ".join(_capability_name(bit) for bit in range(64) if extra >> bit & 1)
    if extra and not traces:
        fix = (
            "start the container with `docker run --cap-add=SYS_PTRACE`"
            if in_container()
            else "run memtui attach with CAP_SYS_PTRACE (e.g. as root)"
        )
        return (
            f"process {pid} holds capabilities memtui lacks ({held}): the kernel lets only a "
            f"tracer with CAP_SYS_PTRACE read it; {fix}"
        )
    if not traces and in_container():
        return (
            f"the kernel refused to let memtui read process {pid} (yours): this container "
            "has no CAP_SYS_PTRACE; start it with `docker run --cap-add=SYS_PTRACE`, or the "
            "process is not dumpable (a setuid program, or prctl(PR_SET_DUMPABLE, 0))"
        )
    why = f"it holds capabilities memtui lacks ({held}), " if extra else ""
    policy = "no Yama ptrace policy here" if scope is None else f"ptrace_scope={scope}"
    return (
        f"the kernel refused to let memtui read process {pid} although it is yours "
        f"({policy}): {why}it is not dumpable (a setuid program, or prctl(PR_SET_DUMPABLE, "
        "0)), or a security module forbids it"
    )


def another_user(pid: int, uid: int) -> str:
    """The line for a process of another user: memtui attaches to the user's own."""
    try:
        import pwd

        name = pwd.getpwuid(uid).pw_name
    except (KeyError, ImportError):
        name = f"uid {uid}"
    return (
        f"process {pid} belongs to {name}: memtui attaches to your own processes (run it as {name})"
    )


def in_container() -> bool:
    """Whether this process runs in a Docker or Podman container (their marker files)."""
    return any(marker.exists() for marker in CONTAINER_MARKERS)


def _capabilities(status_file: Path, field: str) -> int:
    """A capability set of /proc/PID/status as a bit mask (0 where it cannot be read)."""
    try:
        for line in status_file.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _capability_name(bit: int) -> str:
    return f"cap_{CAPABILITY_NAMES[bit]}" if bit < len(CAPABILITY_NAMES) else f"capability {bit}"


def has_capability(bit: int, status_file: Path) -> bool:
    """Whether this process's effective capability set holds `bit`."""
    try:
        for line in status_file.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def check_delivery(target: Target) -> str:
    """How the bootstrap gets in: "remote_exec" or "gdb".

    Raises:
        AttachRefused: gdb missing, or ptrace not permitted.
    """
    if target.python >= REMOTE_EXEC_PYTHON:
        method = "remote_exec"
    else:
        if shutil.which("gdb") is None:
            raise AttachRefused(GDB_MISSING.format(version=_dotted(target.python)))
        method = "gdb"
    problem = ptrace_refusal()
    if problem is not None:
        raise AttachRefused(problem)
    return method
