"""The names a user wrote, as roots for a census: where a leak's holder is looked for.

A holder is named by the shortest path from something the user can find in their own code: a
global of the script (`history`, `val_total`), a local of the training loop's function
(`history (local of train)`), a model's attribute (`model.encoder.cache`). So a census starts
from the script's globals, then the locals of the training thread's frames that belong to the
job (not torch's, not memtui's, not the standard library's runner frames), then the model trees
the agent registered, under their class names, for what no name reaches.

Nothing here runs the job's code or keeps its objects: the script's globals are its module's
dict read through `ModuleType`'s own descriptor and walked lazily by the census (`Namespace`),
and frame locals are read without `frame.f_locals`, whose snapshot on Python 3.10-3.12 would
keep every local of the training loop alive until the next read (`frame_locals`).
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
from memtui_agent.job.frame_locals import LocalsReader, frame_locals
from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.memory.census import Namespace, Root
from memtui_agent.memory.object_access import derives, type_name


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
_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
MAX_FRAMES = 256
"""Frames looked at from the close outwards (a deeply recursive job)."""


def _is_jobs(filename: str) -> bool:
    """Code of the job or of a library it trains with (Lightning, transformers), not torch's,
    memtui's or the standard library's (runpy, threading)."""
    path = os.path.abspath(str.__str__(filename))
    if path.startswith(_NOT_THE_JOBS):
        return False
    return not path.startswith(_STDLIB) or path.startswith(_INSTALLED)


def census_roots(
    registry: ModuleRegistry, frame: types.FrameType | None, read: LocalsReader = frame_locals
) -> list[Root]:
    """Roots in order of preference: script globals, the job's frame locals from `frame`
    outwards, then the registered model trees."""
    roots: list[Root] = []
    main = main_namespace()
    if main is not None:
        roots.append(Namespace(main))
    for code, local_names in _job_frames(frame, read):
        owner = _owner(code)
        roots.extend((f"{name} (local of {owner})", value) for name, value in local_names)
    roots.extend((type_name(type(root)), root) for root in registry.live_roots())
    return roots


def final_roots(
    registry: ModuleRegistry,
    namespace: dict[str, Any] | None,
    error: BaseException | None,
    read: LocalsReader = frame_locals,
) -> list[Root]:
    """Roots as the job ends, when its frames are gone: the script's globals (`namespace`,
    what runpy returned, else `__main__`'s), the locals of the job's frames an exception
    unwound through, then the model trees."""
    roots: list[Root] = []
    if type(namespace) is not dict:
        namespace = main_namespace()
    if namespace is not None:
        roots.append(Namespace(namespace))
    traceback = error.__traceback__ if error is not None else None
    frames: list[types.FrameType] = []
    while traceback is not None and len(frames) < MAX_FRAMES:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    for frame in reversed(frames):  # innermost first, as at a close
        code = frame.f_code
        if _is_jobs(code.co_filename) and code.co_name != "<module>":
            found = read(frame)
            owner = _owner(code)
            roots.extend((f"{n} (local of {owner})", v) for n, v in found or ())
    roots.extend((type_name(type(root)), root) for root in registry.live_roots())
    return roots


def main_namespace() -> dict[str, Any] | None:
    """`__main__`'s globals, read through `ModuleType`'s own descriptor (a module object of
    the job's own class, a lazy one included, is not asked)."""
    modules = sys.modules
    main = dict.get(modules, "__main__") if type(modules) is dict else None
    if main is None or not derives(type(main), types.ModuleType):
        return None
    found = _MODULE_DICT.__get__(main)
    return found if type(found) is dict else None


def _owner(code: types.CodeType) -> str:
    return str.__str__(getattr(code, "co_qualname", code.co_name))[:200]


def _job_frames(
    frame: types.FrameType | None, read: LocalsReader
) -> Iterator[tuple[types.CodeType, list[tuple[str, Any]]]]:
    """The job's own frames (innermost first) and their locals; module-level code is skipped
    (its locals are the globals already given), as is a frame whose locals cannot be read
    without keeping them (`frame_locals`)."""
    seen = 0
    while frame is not None and seen < MAX_FRAMES:
        seen += 1
        code = frame.f_code
        if _is_jobs(code.co_filename) and code.co_name != "<module>":
            found = read(frame)
            if found is not None:
                yield code, found
        frame = frame.f_back
