"""Getting the bootstrap into a running job: `memtui attach PID` and `memtui detach PID`.

The same few lines run in the job's main thread at a point where running Python is safe, and
execute the bootstrap (`memtui_agent/attach/boot.py`), which answers in a reply file:

- Python 3.14+: `sys.remote_exec(pid, script)`, which CPython runs at its next safe point.
- Python 3.10-3.13: gdb, the way memray does it. gdb stops the process, but runs nothing at the
  arbitrary instruction where it stopped: it sets breakpoints on `malloc`, `free` and their
  Python counterparts and lets the job run. At the first of those entered (no allocator lock
  is held there, so allocating is safe) it copies the lines into the job and hands them to
  `Py_AddPendingCall(PyRun_SimpleString, ...)`, deletes the breakpoints and detaches. CPython
  runs pending calls on its main thread between bytecodes, holding the GIL. The lines catch
  every exception (one escaping a pending call would surface inside the job) and bind no name in
  `__main__`.

memtui never kills the target: when no breakpoint is reached in time, gdb is interrupted
(SIGINT to gdb alone; gdb keeps the signal from the job), removes its breakpoints and detaches.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memtui.commands.attach_target import (
    REUSED,
    AttachRefused,
    Pin,
    Target,
    confirm_pin,
    ptrace_denied,
    release_pin,
)
from memtui_protocol.attach import Action, Answer, AttachRequest, read_reply
from memtui_protocol.runtime_dir import pid_alive
from memtui_protocol.safe_open import write_new

SAFE_POINTS = ("malloc", "calloc", "realloc", "free", "PyMem_Malloc", "PyMem_Free")
"""Functions at whose entry gdb may allocate and add a pending call (memray's choice)."""
GDB_SECONDS = 20.0
"""How long gdb waits for the job to enter one of `SAFE_POINTS` (a busy job: microseconds)."""
ANSWER_SECONDS = 30.0
"""How long the job's main thread has to run the bootstrap; later it does nothing."""


def runner_lines(boot: Path, request: Path) -> str:
    """The lines both deliveries run in the job: no name bound in `__main__`, nothing raised."""
    b = "__import__('builtins')"
    return (
        "try:\n"
        f"    {b}.exec({b}.compile({b}.open({str(boot)!r}, 'rb').read(), {str(boot)!r}, "
        f"'exec'), {{'__name__': '__memtui_attach__', 'REQUEST': {str(request)!r}}})\n"
        "except BaseException:\n"
        "    pass\n"
    )


def gdb_literal(text: str) -> str:
    """`text` as a C string literal for gdb (printable ASCII only)."""
    if any(not (32 <= ord(char) < 127) for char in text if char != "\n"):
        raise AttachRefused("memtui's temporary folder has a name gdb cannot pass; set TMPDIR")
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


PIN_CHECK = """printf "MEMTUI_CHECKING_PIN\\n"
python
import gdb
_pid = gdb.selected_inferior().pid
with open("/proc/%d/stat" % _pid, "rb") as _f:
    _stat = _f.read()
with open("/proc/%d/status" % _pid) as _f:
    _uid = [int(_l.split()[1]) for _l in _f if _l.startswith("Uid:")][0]
_ticks = int(_stat[_stat.rindex(b")") + 2 :].split()[19])
if (_uid, _ticks) != ({uid}, {ticks}):
    print("MEMTUI_NOT_PINNED")
    gdb.execute("detach")
    gdb.execute("quit")
print("MEMTUI_PINNED")
end
"""
"""Run by gdb once it has stopped the process, before anything else: a stopped process cannot
end and hand its pid on, so this is the last word on which process gdb holds. A gdb without
Python fails here, before any breakpoint: nothing is injected where nothing was confirmed."""


def gdb_script(lines: str, pin: Pin | None = None) -> str:
    """The gdb commands: confirm the process is the pinned one, wait at a safe point, add the
    pending call, then leave."""
    size = len(lines.encode()) + 1
    breakpoints = "\n".join(f"break {name}" for name in SAFE_POINTS)
    check = PIN_CHECK.format(uid=pin.uid, ticks=pin.start_ticks) if pin is not None else ""
    return f"""set pagination off
set confirm off
set breakpoint pending off
set unwindonsignal on
sharedlibrary libc
sharedlibrary libpython
printf "MEMTUI_ATTACHED\\n"
{check}print (void *) Py_AddPendingCall
print (void *) PyRun_SimpleString
printf "MEMTUI_PYTHON\\n"
{breakpoints}
commands 1-{len(SAFE_POINTS)}
  disable breakpoints
  delete breakpoints
  set $memtui_lines = (char *) malloc({size})
  call (void *) memcpy($memtui_lines, {gdb_literal(lines)}, {size})
  set $memtui_rc = (int) Py_AddPendingCall((void *) PyRun_SimpleString, (void *) $memtui_lines)
  printf "MEMTUI_PENDING %d\\n", $memtui_rc
end
continue
delete breakpoints
detach
quit
"""


def deliver_gdb(pid: int, script: Path, seconds: float = GDB_SECONDS) -> None:
    """Run gdb on `script` against `pid`.

    Raises:
        AttachRefused: ptrace refused, no Python symbols, or no safe point reached in time.
    """
    command = [
        "gdb",
        "-batch",
        "-nx",
        "-nw",
        "-iex",
        "set auto-load off",
        "-iex",
        "set auto-solib-add off",
        "-p",
        str(pid),
        "-x",
        str(script),
    ]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # a Ctrl-C at the terminal reaches neither gdb nor the job
    )
    try:
        output, _ = process.communicate(timeout=seconds)
        timed_out = False
    except subprocess.TimeoutExpired:
        # gdb stops the job, keeps the SIGINT from it (gdb's default: nopass), removes its
        # breakpoints and detaches.
        process.send_signal(signal.SIGINT)
        timed_out = True
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.terminate()  # gdb detaches on SIGTERM too; never SIGKILL it mid-trace
            output, _ = process.communicate()
    explain_gdb(pid, output, timed_out, seconds)


XSTATE_FAULT = "Couldn't write extended state status"
"""gdb 13's error when it cannot write back the registers of a CPU with AMX state (seen on
Sapphire Rapids hosts): no function can be called in the process, so nothing can be injected."""


def explain_gdb(pid: int, output: str, timed_out: bool, seconds: float) -> None:
    """Turn gdb's output into success (return) or one line (raise)."""
    if "MEMTUI_PENDING 0" in output:
        return
    if "MEMTUI_NOT_PINNED" in output:
        raise AttachRefused(REUSED.format(pid=pid))
    if "MEMTUI_CHECKING_PIN" in output and "MEMTUI_PINNED" not in output:
        last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
        raise AttachRefused(
            f"gdb could not confirm that pid {pid} is still the process memtui checked (its "
            f"Python check failed: {last[0]}; a gdb without Python cannot make it); nothing "
            "was injected"
        )
    if "ptrace:" in output and "MEMTUI_ATTACHED" not in output:
        if "No such process" in output:
            raise AttachRefused(f"no process with pid {pid} (it has ended?)")
        raise AttachRefused(f"gdb could not trace pid {pid}: {ptrace_denied(pid)}")
    if "MEMTUI_ATTACHED" in output and "MEMTUI_PYTHON" not in output:
        raise AttachRefused(f"pid {pid} has no Python C API that gdb can find (a stripped Python?)")
    if "MEMTUI_PENDING" in output:
        raise AttachRefused(f"pid {pid} refused the pending call (its queue is full); try again")
    if XSTATE_FAULT in output:
        raise AttachRefused(
            f"gdb could not call into pid {pid}: it failed to restore the CPU's extended register "
            "state (a known fault of gdb 13 on CPUs with AMX); nothing was changed: a newer gdb "
            "is needed on this machine"
        )
    if timed_out:
        raise AttachRefused(
            f"pid {pid} ran no code for {seconds:.0f} s (idle, or stopped); nothing was changed: "
            "try again while it trains"
        )
    last = [line for line in output.splitlines() if line.strip()][-1:] or ["no output"]
    raise AttachRefused(f"gdb could not inject into pid {pid}: {last[0]}")


def deliver_remote_exec(pid: int, script: Path) -> None:
    """Python 3.14+: CPython's own safe-point injection (PEP 768).

    Raises:
        AttachRefused: not permitted, or remote debugging disabled.
    """
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is None:
        raise AttachRefused("this Python has no sys.remote_exec")
    try:
        remote_exec(pid, str(script))
    except ProcessLookupError:
        raise AttachRefused(f"no process with pid {pid} (it has ended?)") from None
    except PermissionError:
        raise AttachRefused(
            f"not permitted to write into pid {pid}: {ptrace_denied(pid)}"
        ) from None
    except (RuntimeError, OSError) as exc:
        if "disable" in str(exc).lower():
            raise AttachRefused(
                f"pid {pid} disabled remote debugging (PYTHON_DISABLE_REMOTE_DEBUG or "
                "-X disable_remote_debug)"
            ) from None
        raise AttachRefused(f"sys.remote_exec into pid {pid} failed: {exc}") from None


class Injection:
    """One request to a job: written, delivered, answered (in a private temporary folder)."""

    def __init__(self, target: Target, method: str, action: Action, **options: Any) -> None:
        self.target = target
        self.method = method
        self.folder = Path(tempfile.mkdtemp(prefix="memtui-attach-"))
        self.reply = self.folder / "reply.json"
        self.boot = self.folder / "boot.py"
        # Found, not imported: the viewer never imports the agent (it may pull in torch).
        agent_dir, protocol_dir = (
            package_dir(name) for name in ("memtui_agent", "memtui_protocol")
        )
        write_new(self.boot, (agent_dir / "attach" / "boot.py").read_bytes())
        # Where the agent's own dependencies are installed, for the job's interpreter to find.
        paths = {str(package_dir(name).parent) for name in ("msgspec", "psutil")}
        self.request = self.folder / "request.json"
        request = AttachRequest(
            action=action,
            pid=target.pid,
            python=(sys.version_info[0], sys.version_info[1]),
            agent_dir=str(agent_dir),
            protocol_dir=str(protocol_dir),
            dependency_paths=tuple(sorted(paths)),
            reply=str(self.reply),
            deadline=time.time() + ANSWER_SECONDS,
            options=options,
        )
        write_new(self.request, request.to_json().encode())

    def deliver(self) -> None:
        """Put the bootstrap into the job (it runs at the job's next safe point)."""
        lines = runner_lines(self.boot, self.request)
        # Right before the injection: still the process the checks were made on.
        confirm_pin(self.target.pid, self.target.pin)
        if self.method == "remote_exec":
            runner = self.folder / "run.py"
            write_new(runner, lines.encode())
            deliver_remote_exec(self.target.pid, runner)
            return
        script = self.folder / "attach.gdb"
        write_new(script, gdb_script(lines, self.target.pin).encode())
        deliver_gdb(self.target.pid, script)

    def wait(self, states: set[Answer], seconds: float) -> dict[str, Any] | None:
        """The job's latest answer once it is one of `states` (or final); None if it never
        answered at all within `seconds`."""
        deadline = time.monotonic() + seconds
        answer = None
        while True:
            answer = self.answer() or answer
            if answer is not None and (
                answer["state"] in states or answer["state"] is Answer.REFUSED
            ):
                return answer
            if not pid_alive(self.target.pid):
                raise AttachRefused(f"pid {self.target.pid} ended while memtui waited for it")
            if time.monotonic() >= deadline:
                return answer
            time.sleep(0.05)

    def answer(self) -> dict[str, Any] | None:
        """The reply file, if the job wrote one."""
        return read_reply(str(self.reply))

    def close(self) -> None:
        """Remove the folder: a bootstrap that runs after this finds nothing and does nothing."""
        shutil.rmtree(self.folder, ignore_errors=True)
        release_pin(self.target.pin)


def package_dir(name: str) -> Path:
    """The folder of the installed package `name`, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise AttachRefused(f"the {name} package is not installed next to memtui")
    return Path(next(iter(spec.submodule_search_locations)))
