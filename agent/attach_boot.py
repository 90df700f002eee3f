"""The bootstrap `memtui attach` runs inside a job that was started without memtui.

Both deliveries run the same few lines in the job's main thread, at a point where running
Python is safe (a pending call added through gdb on Python 3.10-3.13, `sys.remote_exec` on
3.14+). Those lines execute this file with two globals, `__name__` and `REQUEST` (the path of
the request `memtui attach` wrote), and must never raise: an exception escaping a pending call
would surface inside the job's own code. So this file only reads the request and starts one
daemon thread; everything that can fail (finding `memtui_agent`, importing it) runs on that
thread and is answered in the reply file, never raised.

It imports nothing of memtui at module level: the job may not be able to import `memtui_agent`
at all. Then the package is loaded from memtui's install location, and memtui's environment is
put on `sys.path` for the import of the agent's dependencies only, after checking that the
job's Python has the same major.minor (compiled dependencies such as msgspec are built for one).
torch is never imported from there: the job's own is already loaded, or the attach is refused.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from enum import Enum
from typing import Any

AGENT_DEPENDENCIES = ("msgspec", "psutil")
"""Imported while memtui's environment is on `sys.path`; `pynvml` too where CUDA is present."""


class Answer(str, Enum):
    """How far a request got, as the reply file says (the viewer waits for one of these)."""

    ARMED = "armed"
    """The hooks wait for the job's next step boundary."""
    STARTED = "started"
    """The agent runs on the training thread and records."""
    RUNNING = "running"
    """An agent was already running: nothing was done."""
    REFUSED = "refused"
    """Nothing was done (or what was done is undone); `message` says why."""
    DETACHING = "detaching"
    DETACHED = "detached"


def write_reply(path: str, state: Answer, message: str = "", **extra: Any) -> None:
    """Tell `memtui attach` how far we got: one small JSON file, replaced atomically."""
    try:
        temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        descriptor = os.open(temporary, flags, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            json.dump(dict(extra, state=state.value, message=message), handle)
        os.replace(temporary, path)
    except Exception:
        pass  # the viewer then times out and says so; the job is not to be disturbed


def load_agent(request: dict[str, Any]) -> Any:
    """`memtui_agent`, the job's own if it can import one, else memtui's.

    Raises:
        RuntimeError: the job cannot use memtui's copy (another Python version), in one line.
    """
    import importlib.util

    loaded = sys.modules.get("memtui_agent")
    if loaded is not None:
        return loaded
    if importlib.util.find_spec("memtui_agent") is not None:
        import memtui_agent

        return memtui_agent
    ours = tuple(request["python"])
    theirs = tuple(sys.version_info[:2])
    if ours != theirs:
        raise RuntimeError(
            f"the job runs Python {theirs[0]}.{theirs[1]} and cannot import memtui_agent; "
            f"memtui runs on {ours[0]}.{ours[1]}: install memtui into the job's environment"
        )
    added = [entry for entry in request["dependency_paths"] if entry not in sys.path]
    sys.path.extend(added)  # after the job's own entries: its packages win
    try:
        package_dir = request["agent_dir"]
        spec = importlib.util.spec_from_file_location(
            "memtui_agent",
            os.path.join(package_dir, "__init__.py"),
            submodule_search_locations=[package_dir],
        )
        if spec is None or spec.loader is None:
            raise RuntimeError(f"no memtui_agent package in {package_dir}")
        module = importlib.util.module_from_spec(spec)
        sys.modules["memtui_agent"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop("memtui_agent", None)
            raise
        for name in AGENT_DEPENDENCIES:
            __import__(name)
        if _cuda_present():
            try:
                __import__("pynvml")
            except Exception:
                pass  # the agent reports NVML as unavailable
    finally:
        for entry in added:
            try:
                sys.path.remove(entry)
            except ValueError:
                pass
    return module


def _cuda_present() -> bool:
    try:
        return bool(sys.modules["torch"].cuda.is_available())
    except Exception:
        return False


def run(request_path: str) -> None:
    """Read the request, then load and run the agent's side on a thread of its own."""
    with open(request_path, encoding="utf-8") as handle:
        request = json.load(handle)
    reply = request["reply"]
    if time.time() > request["deadline"]:
        return  # memtui attach gave up long ago (the main thread ran no Python meanwhile)
    if request["pid"] != os.getpid():
        return

    def body() -> None:
        try:
            if "torch" not in sys.modules:
                write_reply(reply, Answer.REFUSED, "the job has not imported torch")
                return
            if request["action"] == "detach" and "memtui_agent" not in sys.modules:
                write_reply(reply, Answer.REFUSED, "no memtui agent runs in this process")
                return
            load_agent(request)
            from memtui_agent import inject

            inject.handle(request)
        except BaseException as exc:
            write_reply(reply, Answer.REFUSED, f"{type(exc).__name__}: {exc}")

    threading.Thread(target=body, name="memtui-attach", daemon=True).start()


if __name__ == "__memtui_attach__":
    try:
        run(REQUEST)  # type: ignore[name-defined]  # noqa: F821
    except BaseException:
        pass
