"""A running frame's local variables, read without the frame keeping them alive afterwards.

On Python 3.10 to 3.12, `frame.f_locals` of a function's frame copies its fast locals into a
dict stored ON the frame (the same dict `locals()` returns) and leaves it there until the next
read. A census that read it at a step's close kept every local of the training loop alive past
the job's own `del tmp`: a deleted 10 MiB temporary stayed allocated until the next census
refreshed the snapshot (issue 32). Emptying that dict afterwards is not safe either: it is the
job's own `locals()` dict, and a Python trace function writes it back into the frame
(`PyFrame_LocalsToFast` with `clear`), which would delete the job's variables.

So on those versions the fast locals are read where the interpreter keeps them, the frame's
`localsplus` array, through ctypes, without creating or touching the snapshot. The layout is
each version's (CPython's `_PyInterpreterFrame` on 3.11 and 3.12, `PyFrameObject` on 3.10) and
is trusted only where it checks out:

- once per process, on a frame of our own whose locals are known (`_self_test`): the values read
  must be those objects, by identity;
- on every frame, the pointers next to the array must be the frame's own code, globals and
  builtins (and on 3.11+ the frame object itself, or none for a finished frame; on 3.10 the
  value stack must start right after the locals).

A frame or an interpreter that does not check out gives no locals (`None`): its variables are
then not roots of the census, which says so; nothing is guessed and nothing is dereferenced
beyond what was checked. From Python 3.13 (PEP 667) `frame.f_locals` is a proxy that reads the
fast locals and stores nothing on the frame: it is used as it is.

Reading these pointers runs no code of the job: no attribute of its objects is looked up, and
only the training thread's own suspended frames (or a finished frame a traceback holds) are
read, so nothing writes them meanwhile.
"""

from __future__ import annotations

import ctypes
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_WORD = ctypes.sizeof(ctypes.c_void_p)
_HEAD = 2 * _WORD
"""`PyObject_HEAD` of a release build: reference count and type."""
_CELL = types.CellType
MAX_LOCALS = 4096
"""Local variables read per frame at most (a generated function with thousands of names)."""


@dataclass(frozen=True)
class _Layout:
    """Where one CPython version keeps a frame's fields, in bytes (64-bit release builds)."""

    interpreter_frame: int | None
    """Offset of `f_frame` (the `_PyInterpreterFrame *`) in the frame object; None on 3.10,
    whose frame object holds its locals itself."""
    code: int
    globals: int
    builtins: int
    frame_object: int | None
    """Offset of `frame_obj` (the frame object pointing back), 3.11+."""
    localsplus: int
    value_stack: int | None = None
    """Offset of `f_valuestack` (3.10): it points just past the locals and cells."""


def _layout() -> _Layout | None:
    if _WORD != 8 or sys.implementation.name != "cpython":
        return None
    version = sys.version_info[:2]
    if version == (3, 10):
        # ob_refcnt, ob_type, ob_size, f_back, f_code, f_builtins, f_globals, f_locals,
        # f_valuestack, ... f_localsplus at the end: the type's basic size less one pointer.
        return _Layout(
            interpreter_frame=None,
            code=32,
            globals=48,
            builtins=40,
            frame_object=None,
            localsplus=types.FrameType.__basicsize__ - _WORD,
            value_stack=64,
        )
    if version == (3, 11):
        # f_func, f_globals, f_builtins, f_locals, f_code, frame_obj, previous, prev_instr,
        # stacktop (int), is_entry, owner, localsplus.
        return _Layout(
            interpreter_frame=_HEAD + _WORD,
            code=32,
            globals=8,
            builtins=16,
            frame_object=40,
            localsplus=72,
        )
    if version == (3, 12):
        # f_code, previous, f_funcobj, f_globals, f_builtins, f_locals, frame_obj, prev_instr,
        # stacktop (int), return_offset (uint16), owner, localsplus.
        return _Layout(
            interpreter_frame=_HEAD + _WORD,
            code=0,
            globals=24,
            builtins=32,
            frame_object=48,
            localsplus=72,
        )
    return None


def _word(address: int) -> int:
    return ctypes.c_void_p.from_address(address).value or 0


def _object_at(slot: int) -> Any:
    """The object a checked, non-NULL slot at address `slot` points to (a new reference).

    Read through `py_object.from_address`, never `ctypes.cast(c_void_p(...), py_object)`: a
    cast of a ctypes instance leaves a reference cycle (the result's `_objects` dict holds the
    `c_void_p`), 2 objects of garbage per local read, work for the job's collector."""
    return ctypes.py_object.from_address(slot).value


def _slot_names(code: types.CodeType) -> list[str]:
    """The names of the frame's `localsplus` slots, in order: locals, then cells, then free
    variables (3.11+ merges an argument that is also a cell into one slot)."""
    if sys.version_info >= (3, 11):
        names = []
        describe = code._varname_from_oparg  # type: ignore[attr-defined]
        for index in range(MAX_LOCALS):
            try:
                names.append(describe(index))
            except IndexError:
                break
        return names
    return [*code.co_varnames, *code.co_cellvars, *code.co_freevars][:MAX_LOCALS]


class FastLocals:
    """Reads frames' fast locals for one interpreter, once its layout has passed the self test."""

    def __init__(self) -> None:
        self.layout = _layout()
        self.working = self.layout is not None and _self_test(self)

    def base(self, frame: types.FrameType) -> int | None:
        """The address of the frame's `localsplus` array, if every check passes."""
        layout = self.layout
        if layout is None:
            return None
        code = frame.f_code
        if layout.interpreter_frame is None:
            start = id(frame)
        else:
            start = _word(id(frame) + layout.interpreter_frame)
            if not start:
                return None
            # A running frame points back to its frame object; a finished one that its frame
            # object took over (a traceback's) points to none.
            back = _word(start + layout.frame_object) if layout.frame_object is not None else 0
            if back not in (0, id(frame)):
                return None
        if (
            _word(start + layout.code) != id(code)
            or _word(start + layout.globals) != id(frame.f_globals)
            or _word(start + layout.builtins) != id(frame.f_builtins)
        ):
            return None
        base = start + layout.localsplus
        if layout.value_stack is not None:
            slots = code.co_nlocals + len(code.co_cellvars) + len(code.co_freevars)
            if _word(start + layout.value_stack) != base + slots * _WORD:
                return None
        return base

    def read(self, frame: types.FrameType) -> list[tuple[str, Any]] | None:
        """The frame's bound local variables (cells read through), None if it cannot be read
        safely."""
        base = self.base(frame)
        if base is None:
            return None
        code = frame.f_code
        cells = set(code.co_cellvars) | set(code.co_freevars)
        found: list[tuple[str, Any]] = []
        for index, name in enumerate(_slot_names(code)):
            slot = base + index * _WORD
            if not _word(slot):
                continue  # not bound yet, or deleted
            value = _object_at(slot)
            if name in cells and type(value) is _CELL:
                try:
                    value = value.cell_contents
                except ValueError:  # an empty cell
                    continue
            found.append((name, value))
        return found


def _self_test(reader: FastLocals) -> bool:
    """Read a frame of our own whose locals are known: every value must come back by identity,
    an unbound one must be absent, and a cell must be read through."""
    first, second = object(), object()
    try:
        return _probe(reader, first, second)
    except Exception:
        return False


def _probe(reader: FastLocals, first: object, second: object) -> bool:
    shared = first

    def inner() -> object:
        return shared

    later: object  # noqa: F842 - declared, never bound: its slot must read as empty
    read = reader.read(sys._getframe())
    if read is None:
        return False
    values = dict(read)
    expected = {"reader": reader, "first": first, "second": second, "shared": first, "inner": inner}
    if "later" in values or "read" in values:
        return False
    return all(values.get(name) is value for name, value in expected.items())


_reader: FastLocals | None = None


def _fast_locals() -> FastLocals:
    global _reader
    if _reader is None:
        _reader = FastLocals()
    return _reader


def _proxy_locals(frame: types.FrameType) -> list[tuple[str, Any]] | None:
    """3.13+: `f_locals` is a write-through proxy (PEP 667) that keeps nothing on the frame."""
    proxy = frame.f_locals
    if type(proxy) is dict:  # not a proxy: a namespace (module or class body), or a snapshot
        return None
    return list(proxy.items())[:MAX_LOCALS]


def frame_locals(frame: types.FrameType) -> list[tuple[str, Any]] | None:
    """`frame`'s local variables, read so that the frame keeps no extra reference to them;
    None when this interpreter or this frame cannot be read that way."""
    if sys.version_info >= (3, 13):
        return _proxy_locals(frame)
    reader = _fast_locals()
    if not reader.working:
        return None
    return reader.read(frame)


LocalsReader = Callable[[types.FrameType], "list[tuple[str, Any]] | None"]
"""What reads a frame's locals (`frame_locals`; a test gives another)."""
