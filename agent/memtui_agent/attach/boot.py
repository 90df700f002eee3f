"""The bootstrap `memtui attach` runs inside a job that was started without memtui.

Both deliveries run the same few lines in the job's main thread, at a point where running
Python is safe (a pending call added through gdb on Python 3.10-3.13, `sys.remote_exec` on
3.14+). Those lines execute this file with two globals, `__name__` and `REQUEST` (the path of
the request `memtui attach` wrote), and must never raise: an exception escaping a pending call
would surface inside the job's own code. So this file only reads the request and starts one
daemon thread; everything that can fail (finding `memtui_agent`, importing it) runs on that
thread and is answered in the reply file, never raised.

It imports nothing of memtui at module level: the job may not be able to import `memtui_agent`
at all. Its thread first loads `memtui_protocol` (standard library only, for the request and
reply types), then the agent: the job's own packages where it can import them, else memtui's from
its install location, with memtui's environment put on `sys.path` for the import of the agent's
dependencies only, after checking that the job's Python has the same major.minor (compiled
dependencies such as msgspec are built for one). torch is never imported from there: the job's
own is already loaded, or the attach is refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import threading
import time
from types import ModuleType
from typing import Any

AGENT_DEPENDENCIES = ("msgspec", "psutil")
"""Imported while memtui's environment is on `sys.path`; `pynvml` too where CUDA is present."""


def load_package(name: str, package_dir: str) -> ModuleType:
    """The package `name`: the job's own if it can import one, else the one in `package_dir`."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    if importlib.util.find_spec(name) is not None:
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(package_dir, "__init__.py"), submodule_search_locations=[package_dir]
    )
    if spec is None or spec.loader is None:
        raise RuntimeError(f"no {name} package in {package_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_agent(request: Any) -> ModuleType:
    """`memtui_agent`, the job's own if it can import one, else memtui's.

    Raises:
        RuntimeError: the job cannot use memtui's copy (another Python version), in one line.
    """
    if "memtui_agent" in sys.modules or importlib.util.find_spec("memtui_agent") is not None:
        return load_package("memtui_agent", request.agent_dir)
    ours = request.python
    theirs = tuple(sys.version_info[:2])
    if ours != theirs:
        raise RuntimeError(
            f"the job runs Python {theirs[0]}.{theirs[1]} and cannot import memtui_agent; "
            f"memtui runs on {ours[0]}.{ours[1]}: install memtui into the job's environment"
        )
    added = [entry for entry in request.dependency_paths if entry not in sys.path]
    sys.path.extend(added)  # after the job's own entries: its packages win
    try:
        module = load_package("memtui_agent", request.agent_dir)
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
        text = handle.read()
    raw = json.loads(text)
    if time.time() > raw["deadline"]:
        return  # memtui attach gave up long ago (the main thread ran no Python meanwhile)
    if raw["pid"] != os.getpid():
        return

    def body() -> None:
        try:
            protocol = load_package("memtui_protocol", raw["protocol_dir"])
        except BaseException:
            return  # no way to answer: memtui attach times out and says so
        attach = importlib.import_module(f"{protocol.__name__}.attach")
        request = attach.AttachRequest.from_json(text)
        try:
            if "torch" not in sys.modules:
                attach.write_reply(
                    request.reply, attach.Answer.REFUSED, "the job has not imported torch"
                )
                return
            if request.action is attach.Action.DETACH and "memtui_agent" not in sys.modules:
                attach.write_reply(
                    request.reply, attach.Answer.REFUSED, "no memtui agent runs in this process"
                )
                return
            load_agent(request)
            from memtui_agent.attach import inject

            inject.handle(request)
        except BaseException as exc:
            attach.write_reply(request.reply, attach.Answer.REFUSED, f"{type(exc).__name__}: {exc}")

    threading.Thread(target=body, name="memtui-attach", daemon=True).start()


if __name__ == "__memtui_attach__":
    try:
        run(REQUEST)  # type: ignore[name-defined]  # noqa: F821
    except BaseException:
        pass
