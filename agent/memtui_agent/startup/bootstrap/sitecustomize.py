"""Bootstrap for `memtui run -- COMMAND`: arm the agent in every Python process of the command.

Python imports this module at start-up because `memtui run` put its folder first on PYTHONPATH.
It must leave the interpreter as if it had not been there, apart from the armed agent:

- the user's own `sitecustomize` (the next one on sys.path) runs, and whatever it raises reaches
  `site` as it would without us (an ImportError inside it is not mistaken for "no module");
- afterwards `sys.modules["sitecustomize"]` is the user's module, or absent if there is none
  (ending with `ModuleNotFoundError(name="sitecustomize")` is how "absent" is said to `site`,
  which ignores exactly that error), and our folder is off `sys.path`, so a later
  `import sitecustomize` finds what it would have found;
- an interpreter without memtui (a system Python the command runs) says nothing on its own
  stderr, which the command may capture: it appends one line to the file `memtui run` names in
  MEMTUI_NOTES, and `memtui run` says it once.

Our own failures never raise: a broken install must not stop the user's command.
"""

import importlib.machinery
import importlib.util
import os
import stat
import sys
import types

NOTES_VARIABLE = "MEMTUI_NOTES"
"""`memtui_protocol.notes.NOTES_VARIABLE`, spelled again: see `_note`."""
MAX_NOTE_CHARS = 500
"""`memtui_protocol.notes.MAX_NOTE_CHARS`."""


def _shown(text: str) -> str:
    """`text` with every character a terminal would act on or hide escaped (`\\x1b`). The
    bootstrap runs where memtui may not be installed, so it cannot use the protocol's rule
    (`memtui_protocol.shown_text`); `isprintable` is that rule and a little more (unassigned
    and private-use code points, spaces other than ' ')."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def _note(message: str) -> None:
    """Tell `memtui run` (one line in its notes file), or stderr where no run asked.

    A copy of `memtui_protocol.notes.note`, which this interpreter may not be able to import
    (the note is often that it cannot): the same line, and the same opener's rules
    (`safe_open.open_own`: never through a link, never blocking on a FIFO, only a regular file
    of ours). `tests/integration/test_reliability_planted.py` holds both to the same lines and
    refusals."""
    path = os.environ.get(NOTES_VARIABLE)
    try:
        if not path:
            print(f"memtui: {_shown(message)}", file=sys.stderr)
            return
        line = f"{sys.executable}: {message}".replace("\n", " ")[:MAX_NOTE_CHARS] + "\n"
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        descriptor = os.open(path, flags)
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                return
            os.write(descriptor, line.encode("utf-8", "replace"))
        finally:
            os.close(descriptor)
    except Exception:
        pass


def _leave_sys_path() -> list[str]:
    """Take our folder off sys.path; the rest of sys.path, where the user's module lives."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    return list(sys.path)


def _load_user_sitecustomize(path: list[str]) -> types.ModuleType | None:
    """Import the user's `sitecustomize`, if any, as `import sitecustomize` would.

    Returns:
        The user's module, or None when there is none.

    Raises:
        Whatever the user's module raises while it runs.
    """
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("sitecustomize", None)
        raise
    return module


RUNNER = "memtui_agent.startup.runner"


def _is_memtui_runner() -> bool:
    """`python -m memtui_agent.startup.runner`: `memtui run script.py` itself, which arms its
    agent on its own (the processes it starts are armed here)."""
    argv = list(getattr(sys, "orig_argv", ()))  # any Python may run this file: plain code
    return any(argv[i] == "-m" and argv[i + 1] == RUNNER for i in range(len(argv) - 1))


def _arm() -> None:
    if _is_memtui_runner():
        return
    try:
        from memtui_agent.startup import autostart
    except Exception as exc:
        _note(f"agent unavailable in this interpreter ({type(exc).__name__}: {exc})")
        return
    try:
        autostart.arm_from_environment(install_exit_handlers=True)
    except Exception as exc:
        _note(f"agent not armed ({type(exc).__name__}: {exc})")


def _main() -> types.ModuleType:
    """Chain, arm, then hand `site` the outcome the user's own sitecustomize would have had."""
    ours = sys.modules.get("sitecustomize")
    user_error: BaseException | None = None
    user_module = None
    try:
        user_module = _load_user_sitecustomize(_leave_sys_path())
    except Exception as exc:
        user_error = exc
    finally:
        if user_module is None and ours is not None:
            sys.modules["sitecustomize"] = ours  # the import system expects ours until we end
    _arm()
    if user_error is not None:
        raise user_error  # `site` prints it as "Error in sitecustomize", as without us
    if user_module is None:
        raise ModuleNotFoundError("No module named 'sitecustomize'", name="sitecustomize")
    sys.modules["sitecustomize"] = user_module
    return user_module


if __name__ == "sitecustomize":  # imported by `site`; a test loads it under another name
    _main()
