"""Run a script or module under the agent exactly as `python script.py` / `python -m mod` would.

`memtui run script.py` starts `python -m memtui_agent.startup.runner script.py ARGS`. Running the
target through runpy here, rather than through the bootstrap `sitecustomize`, lets the agent see the
job's exit precisely: an exception with its phase, or a `sys.exit(N)` with its code, which no hook
can observe from outside. Tracebacks are trimmed of this module's and runpy's frames so the user
sees the traceback `python script.py` would print.
"""

from __future__ import annotations

import os
import runpy
import sys

from memtui_agent.startup import api, autostart
from memtui_agent.steps.failures import exit_code_of, without_agent_frames


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
            namespace = runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *arguments]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            namespace = runpy.run_path(os.path.abspath(target), run_name="__main__")
    except SystemExit as exit_request:
        api.stop(exit_code=exit_code_of(exit_request), error=exit_request)
        raise
    except BaseException as error:
        code = 130 if isinstance(error, KeyboardInterrupt) else 1
        api.stop(exit_code=code, error=error)
        show_error(error, as_module)
        return code
    api.stop(exit_code=0, namespace=namespace)
    del namespace  # the job's globals: freed as they would be without the agent
    return 0


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
