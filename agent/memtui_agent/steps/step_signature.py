"""What a step did, read from counters at its backward passes and its close: a carry's proof.

A step whose activations are carried from a measured one must be shown, at its own close, to
have done what that step did (docs/design.md#steps). Counters that say it without any per-tensor
hook:

- autograd's own sequence number, which every graph node created on a thread takes the next
  value of (`torch._C._autograd._get_sequence_nr`, 0.07 us to read): the nodes recorded before
  each top-level backward and after the last one are exact. A layer skipped (LayerDrop), a
  dropout switched to 0, a branch taken, an extra forward that is never backpropagated: each
  changes them.
- memory, for what the node count cannot see (tensors of other sizes behind the same ops). On a
  GPU the caching allocator's cumulative counters over the step, read at the close anyway
  (bytes and number of allocations made): exact. On a CPU glibc's in-use heap (`malloc_info`,
  about 40 us) at the first backward, less that at the step's start: what the forward allocated
  and still holds, activations first; it moves by a few hundred bytes between equal steps, so
  it is compared within a tolerance. A step measured by the hooks holds more or less heap than
  the same step without them (autograd keeps its saved tensors otherwise under a pack hook):
  that share, counted by kind of saved tensor and calibrated at start (`hook_share`), is taken
  off its reading, so measured and unmeasured steps compare exactly.

A step's `Signature` is compared with its measured twin's; any difference means "not known".
Graphs kept past the close are seen exactly elsewhere (`held_graphs`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from memtui_agent.steps.hook_share import Costs, HookShare
from memtui_protocol.schema import Allocator

MEMORY_TOLERANCE = 16 * 1024
"""On a CPU, in-use heap bytes that differ by less than this (or 1% of the activations' high,
if more) count as equal: equal steps of this project's CPU jobs differed by up to 2 KiB, and of
a small Llama under bf16 autocast by up to 5 KiB. The job's own noise only: memtui's share of a
measured step's heap is taken off before comparing (`hook_share`)."""


def _sequence_reader() -> Callable[[], int] | None:
    try:
        import torch

        reader = torch._C._autograd._get_sequence_nr
        reader()
        return reader
    except Exception:
        return None


_MAIN_HEAP = b'<heap nr="0">'
_HEAP_END = b"</heap>"
_FAST = b'<total type="fast" count="'
_REST = b'<total type="rest" count="'
_SYSTEM = b'<system type="current" size="'
_MMAP = b'<total type="mmap" count="'
_SIZE = b' size="'


def _number_after(text: bytes, mark: bytes, start: int, end: int) -> int | None:
    """The number in `size="N"` that follows the first `mark` in `text[start:end]` (`mark`
    itself may end in an opening quote: `count="`, `size="`)."""
    at = text.find(mark, start, end)
    if at < 0:
        return None
    at += len(mark)
    if not mark.endswith(_SIZE):
        at = text.find(_SIZE, at, end)
        if at < 0:
            return None
        at += len(_SIZE)
    close = text.find(b'"', at, end)
    digits = text[at:close] if close >= 0 else b""
    return int(digits) if digits.isdigit() else None


def main_arena_in_use(text: bytes) -> int | None:
    """Bytes in use by the main arena plus those mapped on their own, from `malloc_info`'s XML:
    the main heap's `system current` less its free `fast` and `rest` bytes, plus the process's
    `mmap` total (after the last heap). None when the text has not that shape.

    Read with `bytes.find`, not a regular expression: a `.*?` over the 6 KB the call prints
    took as long as the call itself (61 us of 127 on benchmarks' `stack` model)."""
    start = text.find(_MAIN_HEAP)
    if start < 0:
        return None
    end = text.find(_HEAP_END, start)
    if end < 0:
        return None
    fast = _number_after(text, _FAST, start, end)
    rest = _number_after(text, _REST, start, end)
    system = _number_after(text, _SYSTEM, start, end)
    if fast is None or rest is None or system is None:
        return None
    tail = text.rfind(_HEAP_END)
    mapped = _number_after(text, _MMAP, tail, len(text))
    return system - fast - rest + (mapped or 0)


def heap_reader() -> Callable[[], int | None] | None:
    """glibc's bytes in use by the main thread's arena, plus those mapped on their own (large
    blocks), from `malloc_info` (about 40 us); None off glibc.

    The main arena, not all of them: other threads (a logger, a second model's forward) allocate
    from arenas of their own, and would otherwise move the counter between equal steps.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        malloc_info = libc.malloc_info
        open_memstream = libc.open_memstream
        fclose, free = libc.fclose, libc.free
    except (OSError, AttributeError):
        return None
    malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    open_memstream.restype = ctypes.c_void_p
    open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    fclose.argtypes = [ctypes.c_void_p]
    free.argtypes = [ctypes.c_void_p]

    def read() -> int | None:
        buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
        # A `c_void_p` result: an address, or None for NULL.
        stream: int | None = open_memstream(ctypes.byref(buffer), ctypes.byref(size))
        if not stream:
            return None
        try:
            malloc_info(0, stream)
        finally:
            fclose(stream)
        try:
            text = ctypes.string_at(buffer, size.value)
        finally:
            free(buffer)
        return main_arena_in_use(text)

    try:
        first = read()
    except Exception:
        return None
    return read if first else None


@dataclass(frozen=True)
class Signature:
    """Counters of one step, for comparing it with another."""

    nodes: tuple[int, ...]
    """Autograd nodes recorded before each top-level backward, then after the last."""
    memory: tuple[int, ...] | None
    """On a GPU: bytes and number of allocations the step made. On a CPU: heap bytes in use
    at the first backward less those at the step's start. None where nothing can be read."""
    exact_memory: bool


class Difference(Enum):
    """What in a step's counters can differ from its twin's."""

    NODES = "autograd nodes"
    BACKWARDS = "backward passes"
    HEAP = "heap bytes"
    DEVICE = "allocations"
    HELD = "held activations"
    PILES = "persistent piles"
    READERS = "memory readers"
    COUNTER = "node counter"

    @property
    def structural(self) -> bool:
        """The step ran other ops: something its inputs do not show changed."""
        return self in (Difference.NODES, Difference.BACKWARDS)


@dataclass(frozen=True)
class Mismatch:
    """Why a step is not a repeat of its twin, in numbers (`activation_wording.clause` says
    it)."""

    what: Difference
    now: tuple[int, ...]
    then: tuple[int, ...]


class SignatureRecorder:
    """Reads the counters as a step starts, at its top-level backward passes and its close."""

    def __init__(
        self,
        heap: Callable[[], int | None] | None,
        costs: Costs | None = None,
        own: Callable[[], int] | None = None,
    ) -> None:
        """`costs`: what the agent's pack hook adds to the heap per saved tensor
        (`hook_share.calibrate`); None takes nothing off a measured step's reading. `own`: the
        bytes of the agent's own tables that grow as it counts (`Ledger.own_bytes`): what they
        grew by is taken off too."""
        self._own = own
        self._nodes = _sequence_reader()
        self._heap = heap
        self.share = HookShare(costs) if costs is not None and heap is not None else None
        """Counts the saved tensors of a measured step (the pack hook calls it)."""
        self._node_mark = self._read_nodes()
        self._heap_start = self._read_heap()
        self._own_start = self._read_own()
        self._aside = 0
        """Heap bytes the agent's own actions (arming the hooks) moved since the step began."""
        self._heap_close = self._heap_start
        self._fresh = True
        """No root call yet in the open step (`root_call` takes the start's reading anew)."""
        self._heap_at_backward: int | None = None
        self._node_counts: list[int] = []

    @property
    def available(self) -> bool:
        """Whether the node counter exists (without it no carry can be confirmed)."""
        return self._nodes is not None

    def backward(self) -> None:
        """A top-level backward is starting."""
        self._count_nodes()
        if len(self._node_counts) == 1 and self._heap_start is not None:
            used = self._read_heap()
            # Alive or freed, the saved tensors now are what autograd would keep otherwise.
            share = self.share.at_backward() if self.share is not None else 0
            share += self._read_own() - self._own_start + self._aside
            self._heap_at_backward = used - self._heap_start - share if used is not None else None

    def root_call(self) -> None:
        """A root module's top-level call begins: the open step's first takes the start's
        reading again, so what the agent did since the close (the close's frame, disarming)
        is outside it. Without a root call the step starts at the close."""
        if not self._fresh:
            return
        self._fresh = False
        if self._heap_start is None or self._node_counts:
            return
        start = self._read_heap()
        if start is None:
            return
        self._heap_start, self._own_start, self._aside = start, self._read_own(), 0
        if self.share is not None:
            self.share.reset()  # what was packed before the call is outside the reading

    def aside(self, action: Callable[[], object]) -> None:
        """Run the agent's `action` (arming or disarming the hooks), its heap bytes set aside
        from the open step's reading: it runs at the step's start or its first root call, on
        steps measured and not alike (two heap readings, only where it runs)."""
        if self._heap_start is None or self._node_counts:
            action()  # no heap compared, or the step's reading was taken
            return
        before = self._read_heap()
        try:
            action()
        finally:
            after = self._read_heap()
            if before is not None and after is not None:
                self._aside += after - before

    def close(self, allocator: Allocator) -> Signature:
        """The closing step's signature (`allocator`: the close's reading); the next step
        starts from here."""
        self._count_nodes()
        memory: tuple[int, ...] | None
        if allocator.alloc_bytes is not None and allocator.allocations is not None:
            memory, exact = (allocator.alloc_bytes, allocator.allocations), True
        else:
            forward = self._heap_at_backward
            memory, exact = ((forward,) if forward is not None else None), False
        signature = Signature(tuple(self._node_counts), memory, exact)
        self._node_counts = []
        self._heap_at_backward = None
        self._heap_start = self._heap_close = self._read_heap() if not exact else None
        self._own_start = self._read_own()
        self._aside = 0
        self._fresh = True
        if self.share is not None:
            self.share.reset(counting=self._heap_start is not None)
        return signature

    @property
    def heap_at_close(self) -> int | None:
        """glibc's bytes in use at the last close (CPU jobs; None on a GPU or off glibc)."""
        return self._heap_close

    def _count_nodes(self) -> None:
        now = self._read_nodes()
        self._node_counts.append(now - self._node_mark)
        self._node_mark = now

    def _read_nodes(self) -> int:
        return self._nodes() if self._nodes is not None else 0

    def _read_own(self) -> int:
        return self._own() if self._own is not None else 0

    def _read_heap(self) -> int | None:
        try:
            return self._heap() if self._heap is not None else None
        except Exception:
            return None


def compare(now: Signature, twin: Signature, activations_high: int = 0) -> Mismatch | None:
    """None when `now` repeats `twin`; else what differs."""
    if now.nodes != twin.nodes:
        what = Difference.BACKWARDS if len(now.nodes) != len(twin.nodes) else Difference.NODES
        return Mismatch(what, now.nodes, twin.nodes)
    if now.exact_memory != twin.exact_memory:
        return Mismatch(Difference.READERS, (int(now.exact_memory),), (int(twin.exact_memory),))
    if now.memory is None or twin.memory is None:
        return None
    if now.exact_memory:
        return (
            None
            if now.memory == twin.memory
            else Mismatch(Difference.DEVICE, now.memory, twin.memory)
        )
    tolerance = max(MEMORY_TOLERANCE, activations_high // 100)
    if any(abs(a - b) > tolerance for a, b in zip(now.memory, twin.memory, strict=True)):
        return Mismatch(Difference.HEAP, now.memory, twin.memory)
    return None
