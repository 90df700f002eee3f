"""Run a script or module under the agent exactly as `python script.py` / `python -m mod` would.

`memtui run script.py` starts `python -m memtui_agent.startup.runner script.py ARGS`. Running the
target through runpy here, rather than through the bootstrap `sitecustomize`, lets the agent see the
job's exit precisely: an exception with its phase, or a `sys.exit(N)` with its code, which no hook
can observe from outside. Tracebacks are trimmed of this module's and runpy's frames so the user
sees the traceback `python script.py` would print.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import runpy
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

from memtui_agent.startup import api, autostart
from memtui_agent.steps.failures import exit_code_of, without_agent_frames
from memtui_protocol.config import AgentConfig


def main(argv: list[str] | None = None) -> int:
    """`[--module] TARGET ARGS...` -> the job's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(argv) and argv[0] == "--module"
    if as_module:
        argv = argv[1:]
    if not argv:
        print("memtui runner: nothing to run", file=sys.stderr)
        return 2
    target, arguments = argv[0], argv[1:]
    autostart.arm_from_environment(install_exit_handlers=False)
    config = AgentConfig.from_env(os.environ)
    try:
        if as_module:
            sys.argv = [target, *arguments]
            sys.path[0] = os.getcwd()
            namespace = runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *arguments]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            namespace = runpy.run_path(os.path.abspath(target), run_name="__main__")
    except SystemExit as exit_request:
        stop_when_threads_end(exit_code=exit_code_of(exit_request), error=exit_request)
        if not isinstance(exit_request.code, (int, type(None))):
            # Python prints `sys.exit("message")`'s message as the process ends: the job's error.
            copy_error(config.error_file, f"{exit_request.code}\n")
        raise
    except BaseException as error:
        code = 130 if isinstance(error, KeyboardInterrupt) else 1
        stop_when_threads_end(exit_code=code, error=error)
        with copied_stderr(config.error_file):
            show_error(error, as_module)
        return code
    stop_when_threads_end(exit_code=0, namespace=namespace)
    del namespace  # the job's globals: freed as they would be without the agent
    return 0


def job_threads_running() -> bool:
    """Whether threads of the job that Python waits for at exit (not daemons) still run."""
    current = threading.current_thread()
    return any(
        thread is not current and not thread.daemon and thread.is_alive()
        for thread in threading.enumerate()
    )


def stop_when_threads_end(**end: Any) -> None:
    """Stop the agent where the job ends: now, or, when the script returned while threads of
    its own still run (a training thread it never joined), where Python ends it, after
    waiting for them at exit (`atexit` runs then). Stopping now would end the recording and
    remove the hooks while that thread still trains, and read its tensors meanwhile."""
    if not job_threads_running():
        api.stop(**end)
        return

    def stop_at_exit() -> None:
        api.stop(**end)
        end.clear()  # the job's globals (`namespace`): freed as they would be at exit

    atexit.register(stop_at_exit)


def show_error(error: BaseException, as_module: bool) -> None:
    """Print the job's exception as `python script.py` would: runner and runpy frames cut.

    A module `-m` cannot find fails inside runpy with no frame of the job's: Python prints
    `python: No module named x` for that, and so does this. Ctrl-C prints its traceback and
    `KeyboardInterrupt`, as Python does, and the job exits 130.
    """
    trimmed = without_agent_frames(error.__traceback__)
    error = error.with_traceback(trimmed)
    if as_module and trimmed is None and isinstance(error, ImportError):
        print(f"{sys.executable}: {error}", file=sys.stderr)
        return
    sys.excepthook(type(error), error, trimmed)


class _Tee:
    """The job's stderr, with what is written to it also kept: the error hook writes through
    this exactly what it would write to stderr itself (its colours, a custom hook's layout)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, fileno: the stream's own
        return getattr(self.stream, name)


@contextlib.contextmanager
def copied_stderr(path: str | None) -> Iterator[None]:
    """What is written to `sys.stderr` inside the block also goes to `path` (None: nothing)."""
    if path is None or sys.stderr is None:
        yield
        return
    tee = _Tee(sys.stderr)
    original, sys.stderr = sys.stderr, tee
    try:
        yield
    finally:
        sys.stderr = original
        copy_error(path, tee.kept.getvalue())


def copy_error(path: str | None, text: str) -> None:
    """Append the job's error to the file `memtui run` made for it (best effort: the error is
    on the job's stderr anyway)."""
    if path is None or not text:
        return
    try:
        with open(path, "a", encoding="utf-8", errors="replace") as handle:
            handle.write(text)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
