"""The names a user wrote, as roots for a census: where a leak's holder is looked for.

A holder is named by the shortest path from something the user can find in their own code: a
global of the script (`history`, `val_total`), a local of the training loop's function
(`history (local of train)`), a model's attribute (`model.encoder.cache`). So a census starts
from the script's globals, then the locals of the training thread's frames that belong to the
job (not torch's, not memtui's, not the standard library's runner frames), then the model trees
the agent registered, under their class names, for what no name reaches.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types
from collections.abc import Iterator
from typing import Any

import torch

import memtui_protocol
from memtui_agent.job.modules import ModuleRegistry


def _folder(path: str) -> str:
    return os.path.dirname(os.path.abspath(path)) + os.sep


_NOT_THE_JOBS = (
    _folder(torch.__file__),
    _folder(os.path.dirname(os.path.abspath(__file__))),  # memtui_agent
    _folder(memtui_protocol.__file__),
)
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_INSTALLED = tuple(
    os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("purelib", "platlib")
)


def _is_jobs(filename: str) -> bool:
    """Code of the job or of a library it trains with (Lightning, transformers), not torch's,
    memtui's or the standard library's (runpy, threading)."""
    path = os.path.abspath(filename)
    if path.startswith(_NOT_THE_JOBS):
        return False
    return not path.startswith(_STDLIB) or path.startswith(_INSTALLED)


def census_roots(registry: ModuleRegistry, frame: types.FrameType | None) -> list[tuple[str, Any]]:
    """Roots in order of preference: script globals, the job's frame locals from `frame`
    outwards, then the registered model trees."""
    roots: list[tuple[str, Any]] = []
    main = sys.modules.get("__main__")
    main_globals = vars(main) if main is not None else {}
    roots.extend(_globals(main_globals))
    for code, local_names in _job_frames(frame):
        owner = getattr(code, "co_qualname", code.co_name)
        roots.extend((f"{name} (local of {owner})", value) for name, value in local_names)
    roots.extend((type(root).__name__, root) for root in registry.live_roots())
    return roots


def final_roots(
    registry: ModuleRegistry,
    namespace: dict[str, Any] | None,
    error: BaseException | None,
) -> list[tuple[str, Any]]:
    """Roots as the job ends, when its frames are gone: the script's globals (`namespace`,
    what runpy returned, else `__main__`'s), the locals of the job's frames an exception
    unwound through, then the model trees."""
    roots: list[tuple[str, Any]] = []
    if namespace is None:
        main = sys.modules.get("__main__")
        namespace = vars(main) if main is not None else {}
    roots.extend(_globals(namespace))
    traceback = error.__traceback__ if error is not None else None
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    for frame in reversed(frames):  # innermost first, as at a close
        code = frame.f_code
        if _is_jobs(code.co_filename) and code.co_name != "<module>":
            owner = getattr(code, "co_qualname", code.co_name)
            roots.extend((f"{n} (local of {owner})", v) for n, v in list(frame.f_locals.items()))
    roots.extend((type(root).__name__, root) for root in registry.live_roots())
    return roots


def _globals(namespace: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for name, value in list(namespace.items()):
        if not name.startswith("__") and not isinstance(value, types.ModuleType):
            yield name, value


def _job_frames(
    frame: types.FrameType | None,
) -> Iterator[tuple[types.CodeType, list[tuple[str, Any]]]]:
    """The job's own frames (innermost first) and their locals; module-level code is skipped
    (its locals are the globals already given)."""
    while frame is not None:
        code = frame.f_code
        if _is_jobs(code.co_filename) and code.co_name != "<module>":
            yield code, list(frame.f_locals.items())
        frame = frame.f_back
