"""What a step did, read from counters at its backward passes and its close: a carry's proof.

A step whose activations are carried from a measured one must be shown, at its own close, to
have done what that step did (DESIGN.md, "Steps"). Two counters say it without any per-tensor
hook:

- autograd's own sequence number, which every graph node created on a thread takes the next
  value of (`torch._C._autograd._get_sequence_nr`, 0.07 us to read): the nodes recorded before
  each top-level backward and after the last one are exact. A layer skipped (LayerDrop), a
  dropout switched to 0, a branch taken, an extra forward that is never backpropagated: each
  changes them.
- memory in use, as a change from the step's start: on a GPU the caching allocator's
  `allocated`, exact; on a CPU glibc's in-use heap (`mallinfo2`), which moves by a few hundred
  bytes between equal steps, so it is compared within a tolerance. It sees what the node count
  cannot: tensors of other sizes behind the same ops, and memory the step keeps at its close.

A step's `Signature` is compared with its measured twin's; any difference means "not known".
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MEMORY_TOLERANCE = 16 * 1024
"""On a CPU, in-use heap bytes that differ by less than this (or 1% of the activations' high,
if more) count as equal: equal steps of this project's CPU jobs differed by up to 2 KiB."""


def _sequence_reader() -> Callable[[], int] | None:
    try:
        import torch

        reader = torch._C._autograd._get_sequence_nr
        reader()
        return reader  # type: ignore[no-any-return]
    except Exception:
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_reader() -> Callable[[], int | None] | None:
    """glibc's bytes in use (small chunks plus mmapped ones), or None off glibc or where
    another allocator (jemalloc, tcmalloc) answers instead and reports nothing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    mallinfo2.argtypes = []

    def read() -> int | None:
        info = mallinfo2()
        return int(info.uordblks + info.hblkhd)

    first = read()
    return read if first else None


@dataclass(frozen=True)
class Signature:
    """Counters of one step, for comparing it with another."""

    nodes: tuple[int, ...]
    """Autograd nodes recorded before each top-level backward, then after the last."""
    memory: tuple[int, ...] | None
    """Memory in use at each backward's start, then at the close, less that at the step's
    start; None where nothing can be read."""
    exact_memory: bool


@dataclass(frozen=True)
class Mismatch:
    """Why a step is not a repeat of its twin, in numbers."""

    what: str
    now: tuple[int, ...]
    then: tuple[int, ...]

    def describe(self) -> str:
        """One clause for a message."""
        return f"{self.what}: {_series(self.now)} here, {_series(self.then)} in the step measured"


class SignatureRecorder:
    """Reads the counters at the step's start, its top-level backward passes and its close."""

    def __init__(self, memory: Callable[[], int | None] | None, exact_memory: bool) -> None:
        self._nodes = _sequence_reader()
        self._memory = memory
        self._exact = exact_memory
        self._node_mark = self._read_nodes()
        self._memory_start = self._read_memory()
        self._node_counts: list[int] = []
        self._memory_deltas: list[int] = []

    @property
    def available(self) -> bool:
        """Whether the node counter exists (without it no carry can be confirmed)."""
        return self._nodes is not None

    def backward(self) -> None:
        """A top-level backward is starting."""
        self._sample()

    def close(self) -> Signature:
        """The step's signature; the next step starts from here."""
        self._sample()
        signature = Signature(
            nodes=tuple(self._node_counts),
            memory=tuple(self._memory_deltas) if self._memory_start is not None else None,
            exact_memory=self._exact,
        )
        self._node_counts = []
        self._memory_deltas = []
        self._memory_start = self._read_memory()
        return signature

    def _sample(self) -> None:
        now = self._read_nodes()
        self._node_counts.append(now - self._node_mark)
        self._node_mark = now
        if self._memory_start is not None:
            used = self._read_memory()
            self._memory_deltas.append(used - self._memory_start if used is not None else 0)

    def _read_nodes(self) -> int:
        return self._nodes() if self._nodes is not None else 0

    def _read_memory(self) -> int | None:
        try:
            return self._memory() if self._memory is not None else None
        except Exception:
            return None


def compare(now: Signature, twin: Signature, activations_high: int = 0) -> Mismatch | None:
    """None when `now` repeats `twin`; else what differs."""
    if now.nodes != twin.nodes:
        what = "backward passes" if len(now.nodes) != len(twin.nodes) else "autograd nodes"
        return Mismatch(what, now.nodes, twin.nodes)
    if now.memory is None or twin.memory is None:
        return None
    tolerance = 0 if now.exact_memory else max(MEMORY_TOLERANCE, activations_high // 100)
    if any(abs(a - b) > tolerance for a, b in zip(now.memory, twin.memory, strict=True)):
        return Mismatch("memory in use from the step's start", now.memory, twin.memory)
    return None


def _series(values: tuple[Any, ...]) -> str:
    return ", ".join(f"{value:,}" for value in values)
