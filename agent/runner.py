"""Run a script or module under the agent exactly as `python script.py` / `python -m mod` would.

`memtui run script.py` starts `python -m memtui_agent.runner script.py ARGS`. Running the target
through runpy here, rather than through the bootstrap `sitecustomize`, lets the agent see the
job's exit precisely: an exception with its phase, or a `sys.exit(N)` with its code, which no hook
can observe from outside. Tracebacks are trimmed of this module's and runpy's frames so the user
sees the traceback `python script.py` would print.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import Any

from memtui_agent import api, autostart
from memtui_agent.config import AgentConfig
from memtui_agent.failures import exit_code_of, without_agent_frames


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
    record_stops(AgentConfig.from_env(os.environ).stop_file)
    try:
        if as_module:
            sys.argv = [target, *arguments]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *arguments]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(os.path.abspath(target), run_name="__main__")
    except SystemExit as exit_request:
        api.stop(exit_code=exit_code_of(exit_request), error=exit_request)
        raise
    except BaseException as error:
        code = 130 if isinstance(error, KeyboardInterrupt) else 1
        api.stop(exit_code=code, error=error)
        show_error(error, as_module)
        return code
    api.stop(exit_code=0)
    return 0


def record_stops(stop_file: str | None) -> None:
    """On SIGTERM after `memtui run` asked for the stop (it creates `stop_file` first), write
    `End(status=stopped)`, then die of SIGTERM as without memtui (exit 143).

    A job that sets its own SIGTERM handler replaces this one and keeps its own behaviour; a
    SIGTERM from anyone else finds no stop file and kills the job exactly as before.
    """
    if stop_file is None or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        try:
            if os.path.exists(stop_file):
                os.unlink(stop_file)
                api.stop(exit_code=128 + signum, stopped=True)
        except Exception:
            pass  # never into the job: it dies of the signal either way
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)


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


if __name__ == "__main__":
    sys.exit(main())
