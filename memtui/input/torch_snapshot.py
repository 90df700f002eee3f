"""PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`) read without torch.

A snapshot is a pickle, and unpickling runs whatever callables the file names, so a plain
`pickle.load` of a file someone sent you is code execution (and would import torch for the
tensors it might mention). The allowed globals here are builtin containers only; a snapshot is
plain dicts, lists, strings and ints, so anything else means the file is not one.

Both shapes `torch/cuda/_memory_viz.py` accepts are read: the dict with `segments` (plus
`device_traces` and `allocator_settings` in newer torch), and the bare list of segments older
versions wrote, whose blocks keep their frames under `history` instead of `frames`.
"""

from __future__ import annotations

import io
import os
import pickle
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any

from memtui.errors import UserError
from memtui.input.input_files import InputFileError, open_input
from memtui_protocol import schema
from memtui_protocol.units import format_bytes

PICKLE_PROTO = b"\x80"
"""Every pickle protocol torch writes (2 and up) opens with this opcode."""
TOP_ALLOCATIONS = 10
SAFE_GLOBALS = {("builtins", "set"), ("builtins", "frozenset")}
"""Containers that protocols 2-3 can only spell as a global; nothing that runs code. Not
`bytearray`: `bytearray(3_000_000_000)` is a 32-byte pickle that allocates 3 GB."""
MAX_DEPTH = 32
"""A snapshot nests about eight deep (segments, blocks, frames); anything deeper is not one,
and a bound here keeps every later walk (and `json.dumps`) far from Python's recursion limit."""
MIN_WORK = 2_000_000
WORK_PER_BYTE = 16
"""The snapshot's data, counted as a tree (a list reached twice counts twice), may hold at most
this many items per byte of file (or `MIN_WORK`): the summary walks that tree, so a small pickle
of reused references cannot cost minutes and gigabytes."""
INT_RANGE = (-(1 << 63), 1 << 64)
"""Sizes, addresses, line numbers and times all fit in 64 bits; 10**400 is not a size."""
NOT_SNAPSHOT = "not a PyTorch memory snapshot"


class SnapshotError(UserError):
    """The file is unusable as a memory snapshot; `str()` is the one line to show."""


@dataclass(frozen=True)
class Allocation:
    """One live block, with the innermost Python line that allocated it (when recorded)."""

    size: int
    requested_size: int
    address: int | None
    frame: str | None


@dataclass(frozen=True)
class OomEvent:
    """An out-of-memory event from the trace: what was asked for and what was free."""

    size: int
    device_free: int | None
    frame: str | None


@dataclass(frozen=True)
class DeviceSummary:
    """What the caching allocator held on one device when the snapshot was taken."""

    device: int
    segments: int
    reserved: int
    allocated: int
    active: int
    inactive: int
    """Bytes of free ("inactive") blocks inside reserved segments: the fragmentation."""
    largest_free_block: int
    blocks: int
    top_allocations: tuple[Allocation, ...]
    trace_actions: dict[str, int]
    ooms: tuple[OomEvent, ...]

    @property
    def fragmentation(self) -> float:
        """Share of reserved bytes sitting in free blocks (0 when nothing is reserved)."""
        return self.inactive / self.reserved if self.reserved else 0.0


@dataclass(frozen=True)
class SnapshotSummary:
    """Every device of one snapshot file, plus when it was written (the file's mtime)."""

    path: Path
    layout: str
    """`dict` (segments and traces) or `segment list` (the old format)."""
    devices: tuple[DeviceSummary, ...]
    allocator_settings: dict[str, Any] | None
    written: float


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SAFE_GLOBALS:
            return super().find_class(module, name)
        raise SnapshotError(
            f"{NOT_SNAPSHOT} (the pickle refers to {module}.{name}; memtui reads only plain data)"
        )


def looks_like_snapshot(path: str | os.PathLike[str]) -> bool:
    """True when the file starts like a pickle (a recording starts with memtui's magic)."""
    try:
        with open_input(path) as handle:
            return handle.read(1) == PICKLE_PROTO
    except (InputFileError, OSError):
        return False


_ARG_BYTES = {
    **dict.fromkeys(b"JjrR\x84", 4),
    **dict.fromkeys(b"Khq\x82\x80", 1),
    **dict.fromkeys(b"M\x83", 2),
    **dict.fromkeys(b"G\x95", 8),
}
_ARG_BYTES.pop(ord("R"))
_LENGTH_PREFIX = {
    **dict.fromkeys(b"\x8aUC\x8c", 1),
    **dict.fromkeys(b"\x8bTBX", 4),
    **dict.fromkeys(b"\x8e\x96\x8d", 8),
}
_LINES = {**dict.fromkeys(b"ILSVFgpP", 1), **dict.fromkeys(b"ci", 2)}
_MEMO_PUTS = {ord("p"), ord("q"), ord("r")}
_MEMOIZE = 0x94


def _check_memo(data: bytes) -> None:
    """Refuse memo indexes that skip ahead before the C unpickler sees them.

    The C unpickler sizes its memo table by the largest index put, so `LONG_BINPUT 400000000`
    (a 12-byte pickle) allocates 6 GB. Pickle writes memo indexes in order, so an index beyond
    the number of entries put so far is never legitimate. This walks opcodes only, jumping over
    string arguments by their length.
    """
    position, puts, end = 0, 0, len(data)
    while position < end:
        code = data[position]
        position += 1
        if code == ord("."):
            return
        if code == _MEMOIZE:
            puts += 1
        elif code in _ARG_BYTES:
            if code in _MEMO_PUTS:
                width = _ARG_BYTES[code]
                index = int.from_bytes(data[position : position + width], "little")
                _check_memo_index(index, puts)
                puts += 1
            position += _ARG_BYTES[code]
        elif code in _LENGTH_PREFIX:
            width = _LENGTH_PREFIX[code]
            position += width + int.from_bytes(data[position : position + width], "little")
        elif code in _LINES:
            for _ in range(_LINES[code]):
                newline = data.find(b"\n", position)
                if newline < 0:
                    return  # truncated: the unpickler reports it
                if code in _MEMO_PUTS:
                    _check_memo_index(int(data[position:newline] or b"-1"), puts)
                    puts += 1
                position = newline + 1


def _check_memo_index(index: int, puts: int) -> None:
    if not 0 <= index <= puts:
        raise SnapshotError(f"{NOT_SNAPSHOT} (pickle memo index {index} skips ahead)")


def _check_tree(data: Any, budget: int) -> None:
    """Walk the unpickled data without recursion: refuse what is too deep, self-referencing,
    too large as a tree, or holds an integer no snapshot field can hold.

    Raises:
        SnapshotError: with the reason, for one line.
    """
    stack: list[tuple[Any, int]] = [(data, 0)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > budget:
            raise SnapshotError(
                f"{NOT_SNAPSHOT} (its data repeats references into more than {budget:,} items)"
            )
        if isinstance(item, bool) or item is None or isinstance(item, (str, bytes, float)):
            continue
        if isinstance(item, int):
            if not INT_RANGE[0] <= item < INT_RANGE[1]:
                raise SnapshotError(f"{NOT_SNAPSHOT} (an integer outside 64 bits)")
            continue
        if depth >= MAX_DEPTH:
            raise SnapshotError(
                f"{NOT_SNAPSHOT} (nested more than {MAX_DEPTH} deep, or refers to itself)"
            )
        if isinstance(item, dict):
            stack.extend((value, depth + 1) for pair in item.items() for value in pair)
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend((value, depth + 1) for value in item)
        else:
            raise SnapshotError(f"{NOT_SNAPSHOT} (holds a {type(item).__name__})")


def _read(path: Path) -> Any:
    try:
        with open_input(path) as handle:
            data = handle.read()
    except InputFileError as exc:
        raise SnapshotError(str(exc)) from None
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not data.startswith(PICKLE_PROTO):
        raise SnapshotError(f"{path}: {NOT_SNAPSHOT} (not a pickle of protocol 2 or later)")
    try:
        _check_memo(data)
        loaded = _PlainUnpickler(io.BytesIO(data)).load()
        _check_tree(loaded, max(MIN_WORK, WORK_PER_BYTE * len(data)))
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    except Exception as exc:  # a damaged pickle can raise almost anything
        raise SnapshotError(f"{path}: {NOT_SNAPSHOT} (damaged pickle: {exc})") from None
    return loaded


def _segments_and_traces(data: Any) -> tuple[str, list[Any], list[Any], dict[str, Any] | None]:
    if isinstance(data, dict) and isinstance(data.get("segments"), list):
        traces = data.get("device_traces") or []
        settings = data.get("allocator_settings")
        if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
            raise SnapshotError(f"{NOT_SNAPSHOT} (device_traces is not a list per device)")
        return "dict", data["segments"], traces, settings if isinstance(settings, dict) else None
    if isinstance(data, list):
        return "segment list", data, [], None
    raise SnapshotError(f"{NOT_SNAPSHOT} (no segments)")


def _check_segment(index: int, segment: Any) -> None:
    blocks = segment.get("blocks") if isinstance(segment, dict) else None
    if not (
        isinstance(blocks, list)
        and isinstance(segment.get("total_size"), int)
        and isinstance(segment.get("device", 0), int)
        and all(isinstance(b, dict) and isinstance(b.get("size"), int) for b in blocks)
        and all(isinstance(b.get("state"), str) for b in blocks)
    ):
        raise SnapshotError(f"{NOT_SNAPSHOT} (segment {index} lacks total_size or sized blocks)")


def first_python_frame(frames: Any) -> str | None:
    """`filename:line name` of the innermost Python frame; torch records innermost first."""
    for frame in frames if isinstance(frames, list) else []:
        if isinstance(frame, dict) and str(frame.get("filename", "")).endswith(".py"):
            return f"{frame['filename']}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return None


def _block_frames(block: dict[str, Any]) -> tuple[Any, int]:
    """Frames and requested bytes in either format (as `_memory_viz._block_extra` reads them)."""
    if "frames" in block:
        return block["frames"], int(block.get("requested_size", block["size"]))
    history = block.get("history")
    if isinstance(history, list) and history and isinstance(history[0], dict):
        return history[0].get("frames", []), int(history[0].get("real_size", block["size"]))
    return [], int(block.get("requested_size", block["size"]))


def _summarize_device(
    device: int, segments: list[dict[str, Any]], trace: list[Any]
) -> DeviceSummary:
    allocated = active = inactive = largest_free = blocks = 0
    live: list[Allocation] = []
    for segment in segments:
        offset = 0
        seg_allocated = seg_active = 0
        for block in segment["blocks"]:
            blocks += 1
            size, state = block["size"], block["state"]
            address = block.get("address")
            if address is None and isinstance(segment.get("address"), int):
                address = segment["address"] + offset  # old blocks carry no address
            offset += size
            if state == "inactive":
                inactive += size
                largest_free = max(largest_free, size)
                continue
            seg_active += size
            if state == "active_allocated":
                seg_allocated += size
                frames, requested = _block_frames(block)
                live.append(Allocation(size, requested, address, first_python_frame(frames)))
        # Trust the allocator's own totals where present; older snapshots lack them.
        allocated += int(segment.get("allocated_size", seg_allocated))
        active += int(segment.get("active_size", seg_active))
    live.sort(key=lambda item: -item.size)
    events = [event for event in trace if isinstance(event, dict)]
    ooms = tuple(
        OomEvent(int(e.get("size", 0)), e.get("device_free"), first_python_frame(e.get("frames")))
        for e in events
        if e.get("action") == "oom"
    )
    return DeviceSummary(
        device=device,
        segments=len(segments),
        reserved=sum(segment["total_size"] for segment in segments),
        allocated=allocated,
        active=active,
        inactive=inactive,
        largest_free_block=largest_free,
        blocks=blocks,
        top_allocations=tuple(live[:TOP_ALLOCATIONS]),
        trace_actions=dict(Counter(str(event.get("action")) for event in events)),
        ooms=ooms,
    )


def load_snapshot(path: str | os.PathLike[str]) -> SnapshotSummary:
    """Read and summarize a snapshot file, per device.

    An empty snapshot still has device 0 (with zeros), so every viewer has a step to show.

    Raises:
        SnapshotError: missing, unreadable, not a pickle, a pickle naming any non-builtin global,
            or plain data not shaped like a snapshot.
    """
    path = Path(path)
    data = _read(path)
    try:
        layout, segments, traces, settings = _segments_and_traces(data)
        for index, segment in enumerate(segments):
            _check_segment(index, segment)
        by_device: dict[int, list[dict[str, Any]]] = {}
        for segment in segments:
            by_device.setdefault(segment.get("device", 0), []).append(segment)
        numbers = sorted(set(by_device) | {n for n, trace in enumerate(traces) if trace}) or [0]
        devices = tuple(
            _summarize_device(n, by_device.get(n, []), traces[n] if n < len(traces) else [])
            for n in numbers
        )
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:  # a wrong field
        raise SnapshotError(f"{path}: {NOT_SNAPSHOT} (malformed: {exc})") from None
    return SnapshotSummary(path, layout, devices, settings, path.stat().st_mtime)


def describe_device(device: DeviceSummary, binary: bool = True) -> str:
    """One sentence: segments, fragmentation, the largest allocation and any OOM."""
    size = partial(format_bytes, binary=binary)
    text = (
        f"snapshot of cuda:{device.device}: {device.segments} segments, "
        f"{size(device.reserved)} reserved, {size(device.allocated)} allocated; "
        f"{size(device.inactive)} in free blocks ({device.fragmentation:.0%} fragmentation), "
        f"largest free block {size(device.largest_free_block)}"
    )
    for top in device.top_allocations[:1]:
        text += f"; largest allocation {size(top.size)}" + (f" at {top.frame}" if top.frame else "")
    if device.ooms:
        text += f"; {len(device.ooms)} out-of-memory event(s) in the trace"
    return text


def snapshot_messages(
    summary: SnapshotSummary, path: str | os.PathLike[str]
) -> list[schema.Message]:
    """The snapshot as a tiny recording, so `memtui replay` shows it in the usual screen.

    One Step per device (numbered from 1) carries the allocator's totals; the piles are all zero
    because a snapshot knows nothing of weights or activations, which puts every allocated byte
    under "other" in the gap view, where it belongs.
    """
    written = summary.written
    numbers = ",".join(str(device.device) for device in summary.devices)
    messages: list[schema.Message] = [
        schema.Hello(
            format_version=schema.FORMAT_VERSION,
            agent_version="snapshot",
            pid=0,
            argv=["torch.cuda.memory snapshot", str(path)],
            started=datetime.fromtimestamp(written, timezone.utc).isoformat(timespec="seconds"),
            started_unix=written,
            torch="unknown",
            device=f"cuda:{numbers}",
            recording=str(path),
        )
    ]
    zero = schema.Piles()
    for number, device in enumerate(summary.devices, start=1):
        allocator = schema.Allocator(allocated=device.allocated, reserved=device.reserved)
        messages.append(
            schema.Step(number, written, written, zero, zero, zero, allocator=allocator)
        )
        alert = schema.Alert(kind=schema.AlertKind.SNAPSHOT.value, message=describe_device(device))
        messages.append(schema.AlertNow(time=written, step=number, alert=alert))
    ok = schema.ExitStatus.OK.value
    messages.append(schema.End(time=written, status=ok, step=len(summary.devices)))
    return messages
