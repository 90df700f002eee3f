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
import sys
from types import TracebackType

from memtui_agent import api, autostart

_OWN_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}


def _trim(traceback: TracebackType | None) -> TracebackType | None:
    while traceback is not None and (
        os.path.abspath(traceback.tb_frame.f_code.co_filename) in _OWN_FILES
        or traceback.tb_frame.f_code.co_filename.startswith("<frozen runpy")
    ):
        traceback = traceback.tb_next
    return traceback


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
    try:
        if as_module:
            sys.argv = [target, *arguments]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *arguments]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_request:
        code = exit_request.code
        numeric = 0 if code is None else code if isinstance(code, int) else 1
        api.stop(exit_code=numeric, error=exit_request)
        raise
    except KeyboardInterrupt as interrupt:
        api.stop(exit_code=130, error=interrupt)
        raise
    except BaseException as error:
        api.stop(exit_code=1, error=error)
        sys.excepthook(type(error), error, _trim(error.__traceback__))
        return 1
    api.stop(exit_code=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
