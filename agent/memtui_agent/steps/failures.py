"""How a job failed: out-of-memory errors, re-raised exceptions, exit codes, clean tracebacks."""

from __future__ import annotations

import os
import re
import runpy
import sys
from dataclasses import dataclass
from types import TracebackType

from memtui_protocol.schema import Phase

OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_oom(error: BaseException) -> bool:
    """Whether an exception is an out-of-memory failure, on CUDA or from the CPU allocator.

    CUDA raises `torch.OutOfMemoryError`; the CPU allocator raises a plain RuntimeError whose
    message says "can't allocate memory" (DefaultCPUAllocator).
    """
    if type(error).__name__ == "OutOfMemoryError" or isinstance(error, MemoryError):
        return True
    if isinstance(error, RuntimeError):
        text = str(error).lower()
        return any(marker in text for marker in OOM_MARKERS)
    return False


_CUDA_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B|bytes)", re.IGNORECASE)
_CPU_REQUEST = re.compile(r"tried to allocate (\d+) bytes", re.IGNORECASE)
_UNIT = {"b": 1, "bytes": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNIT.update({"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def requested_bytes(error: BaseException) -> int | None:
    """The allocation size an out-of-memory message names, if it names one.

    CUDA: "Tried to allocate 2.00 GiB"; the CPU allocator: "you tried to allocate N bytes".
    """
    text = str(error)
    match = _CPU_REQUEST.search(text)
    if match:
        return int(match.group(1))
    match = _CUDA_REQUEST.search(text)
    if match:
        return int(float(match.group(1)) * _UNIT.get(match.group(2).lower(), 1))
    return None


_SIZE = r"([0-9.]+) ?([KMGT]i?B|bytes)"
_RESERVED_UNALLOCATED = re.compile(
    _SIZE + r" is reserved by PyTorch but unallocated", re.IGNORECASE
)


def _size_in(pattern: re.Pattern[str], error: BaseException) -> int | None:
    match = pattern.search(str(error))
    if match is None:
        return None
    return int(float(match.group(1)) * _UNIT.get(match.group(2).lower(), 1))


def reserved_unallocated_bytes(error: BaseException) -> int | None:
    """What a CUDA out-of-memory message says the caching allocator held reserved but not
    allocated ("and 1.17 GiB is reserved by PyTorch but unallocated"): fragmentation, memory
    the failed request could not use. None where the message does not say (CPU, other builds).
    torch prints it rounded to two decimals of its unit, so the figure is within 0.5% of it."""
    return _size_in(_RESERVED_UNALLOCATED, error)


@dataclass(frozen=True)
class ErrorContext:
    """Where an exception was first seen, without keeping the exception (or its frames) alive.

    Exceptions cannot be weakly referenced, so identity is `id()` confirmed by type and message:
    a recycled id of an unrelated exception does not match.
    """

    ident: int
    kind: str
    message: str
    phase: Phase
    where: str | None

    @classmethod
    def of(cls, error: BaseException, phase: Phase, where: str | None) -> ErrorContext:
        """Capture an exception's identity and where it surfaced."""
        return cls(id(error), type(error).__name__, first_line(error), phase, where)

    def matches(self, error: BaseException) -> bool:
        """Whether `error`, or an exception in its cause/context chain, is the one noted."""
        current: BaseException | None = error
        for _ in range(32):
            if current is None:
                return False
            if (
                id(current) == self.ident
                and type(current).__name__ == self.kind
                and first_line(current) == self.message
            ):
                return True
            current = current.__cause__ or current.__context__
        return False


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, bounded, for one-line displays."""
    text = str(error).strip()
    return text.splitlines()[0][:500] if text else type(error).__name__


_AGENT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""The `memtui_agent` package: its frames are the runner's and the wrappers', not the job's."""
_RUNPY = os.path.abspath(runpy.__file__)


def _is_ours(traceback: TracebackType) -> bool:
    filename = traceback.tb_frame.f_code.co_filename
    return (
        filename.startswith(_AGENT_DIR)
        or filename.startswith("<frozen runpy")
        or os.path.abspath(filename) == _RUNPY
    )


def _is_torchs(traceback: TracebackType) -> bool:
    torch = sys.modules.get("torch")
    folder = os.path.dirname(getattr(torch, "__file__", None) or "") + os.sep
    return folder != os.sep and traceback.tb_frame.f_code.co_filename.startswith(folder)


def without_agent_frames(traceback: TracebackType | None) -> TracebackType | None:
    """The traceback with the runner's, runpy's and the agent's wrapper frames cut out.

    Traceback objects are relinked in place (`tb_next` is writable), so what the user reads is
    what `python script.py` would have printed. An exception raised inside the agent (Ctrl-C
    while a hook of ours ran: only BaseExceptions get out of them) also loses torch's frame
    that called that hook (`post_hook(self, args, kwargs)`): a line a plain run never reaches,
    which would point at memtui. The traceback then ends where the job called into torch.
    """
    kept = []
    raised_in_ours = False
    while traceback is not None:
        raised_in_ours = _is_ours(traceback)
        if not raised_in_ours:
            kept.append(traceback)
        traceback = traceback.tb_next
    if raised_in_ours and len(kept) > 1 and _is_torchs(kept[-1]):
        kept.pop()
    # Every frame can be ours: a script that does not compile, or `-m` of a missing module,
    # fails inside runpy before any of the job's code runs. Python then prints no traceback.
    for index, current in enumerate(kept):
        current.tb_next = kept[index + 1] if index + 1 < len(kept) else None
    return kept[0] if kept else None


def exit_code_of(request: SystemExit) -> int:
    """The process exit code Python derives from a `SystemExit` (None -> 0, text -> 1)."""
    code = request.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1
