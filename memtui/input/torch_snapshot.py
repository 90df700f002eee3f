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

import heapq
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
from memtui.input.input_files import InputFileError, first_hole, open_input
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
MAX_DEVICES = 256
"""torch numbers CUDA devices with an 8-bit index; a snapshot naming more is not one."""
MAX_SIZE = 1 << 63
"""Sizes, counts and free bytes are non-negative and fit an int64, as the allocator keeps them."""
MAX_OOMS = 16
"""OOM events kept per device (all are counted): the first ones are the ones that matter."""
MAX_ACTIONS = 64
"""Distinct trace action names counted per device; torch has about ten, the rest are `other`."""
MAX_FRAME_TEXT = 512
"""Characters of a frame's file name and function name shown; a longer one is cut."""
MAX_SNAPSHOT_BYTES = 4 << 30
"""Snapshots are read whole (a pickle cannot be resumed): a larger file is refused in one line."""


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
    """The first `MAX_OOMS` OOM events of the trace."""
    oom_events: int = 0
    """Every OOM event of the trace, counted."""

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

    The walk keeps one iterator per level, never a container's children all at once, so its
    own memory is bounded by the depth whatever the data's width (a list of a million reused
    references used to put a million entries on the walk's stack).

    Raises:
        SnapshotError: with the reason, for one line.
    """
    seen = _check_item(data, 0, budget)
    stack: list[Any] = [_children(data)] if _children(data) is not None else []
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        seen = _check_item(item, seen, budget)
        children = _children(item)
        if children is None:
            continue
        if len(stack) >= MAX_DEPTH:
            raise SnapshotError(
                f"{NOT_SNAPSHOT} (nested more than {MAX_DEPTH} deep, or refers to itself)"
            )
        stack.append(children)


_END = object()


def _check_item(item: Any, seen: int, budget: int) -> int:
    """Count `item` against the budget and check its type; the new count."""
    seen += 1
    if seen > budget:
        raise SnapshotError(
            f"{NOT_SNAPSHOT} (its data repeats references into more than {budget:,} items)"
        )
    if isinstance(item, bool) or item is None or isinstance(item, (str, bytes, float)):
        return seen
    if isinstance(item, int):
        if not INT_RANGE[0] <= item < INT_RANGE[1]:
            raise SnapshotError(f"{NOT_SNAPSHOT} (an integer outside 64 bits)")
        return seen
    if not isinstance(item, (dict, list, tuple, set, frozenset)):
        raise SnapshotError(f"{NOT_SNAPSHOT} (holds a {type(item).__name__})")
    return seen


def _children(item: Any) -> Any:
    """An iterator over a container's keys and values (None for a scalar)."""
    if isinstance(item, dict):
        return (value for pair in item.items() for value in pair)
    if isinstance(item, (list, tuple, set, frozenset)):
        return iter(item)
    return None


def _read(path: Path) -> Any:
    try:
        with open_input(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_SNAPSHOT_BYTES:
                limit = format_bytes(MAX_SNAPSHOT_BYTES)
                raise SnapshotError(
                    f"{path}: {format_bytes(size)}, larger than the {limit} memtui reads as a "
                    "snapshot"
                )
            hole = first_hole(handle.fileno(), size)
            if hole is not None:
                raise SnapshotError(
                    f"{path}: {NOT_SNAPSHOT} (a sparse file: nothing is stored from byte {hole:,} "
                    "on; torch writes snapshots whole)"
                )
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


# ----- typed fields: every value is checked before it is used ------------------------------


def _size(value: Any, what: str) -> int:
    """A size, count or byte figure: an int (not a bool, not digits in a string) in int64."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SIZE:
        raise SnapshotError(f"{NOT_SNAPSHOT} ({what} is {_shown(value)}, not a size)")
    return value


def _optional_size(value: Any, what: str) -> int | None:
    return None if value is None else _size(value, what)


def _device(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_DEVICES:
        raise SnapshotError(
            f"{NOT_SNAPSHOT} ({what} is {_shown(value)}, not a device 0-{MAX_DEVICES - 1})"
        )
    return value


def _address(value: Any) -> int | None:
    """An address when it is one (older blocks carry none; anything else is not shown)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
        return None
    return value


def _shown(value: Any) -> str:
    """A wrong value, named in an error line without printing a huge one."""
    if isinstance(value, (str, bytes)):
        return f"a {type(value).__name__} of {len(value):,} characters"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return f"a {type(value).__name__}"
    if isinstance(value, int) and not isinstance(value, bool):
        return "negative" if value < 0 else "too large"
    return (
        repr(value) if value is None or isinstance(value, (bool, float)) else type(value).__name__
    )


def _cut(text: str) -> str:
    return (
        text
        if len(text) <= MAX_FRAME_TEXT
        else text[: MAX_FRAME_TEXT - 1] + "\N{HORIZONTAL ELLIPSIS}"
    )


def _segments_and_traces(data: Any) -> tuple[str, list[Any], list[Any], dict[str, Any] | None]:
    if isinstance(data, dict) and isinstance(data.get("segments"), list):
        traces = data.get("device_traces") or []
        settings = data.get("allocator_settings")
        if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
            raise SnapshotError(f"{NOT_SNAPSHOT} (device_traces is not a list per device)")
        if len(traces) > MAX_DEVICES:
            raise SnapshotError(
                f"{NOT_SNAPSHOT} (traces for {len(traces):,} devices; at most {MAX_DEVICES})"
            )
        return "dict", data["segments"], traces, settings if isinstance(settings, dict) else None
    if isinstance(data, list):
        return "segment list", data, [], None
    raise SnapshotError(f"{NOT_SNAPSHOT} (no segments)")


def _check_segment(index: int, segment: Any) -> int:
    """The segment's device, once its shape and every block's size and state are checked."""
    blocks = segment.get("blocks") if isinstance(segment, dict) else None
    if not (
        isinstance(blocks, list)
        and "total_size" in segment
        and all(isinstance(b, dict) and "size" in b for b in blocks)
        and all(isinstance(b.get("state"), str) for b in blocks)
    ):
        raise SnapshotError(f"{NOT_SNAPSHOT} (segment {index} lacks total_size or sized blocks)")
    where = f"segment {index}"
    _size(segment["total_size"], f"{where}'s total_size")
    for key in ("allocated_size", "active_size"):
        _optional_size(segment.get(key), f"{where}'s {key}")
    for block in blocks:
        _size(block["size"], f"a block size in {where}")
    return _device(segment.get("device", 0), f"{where}'s device")


def first_python_frame(frames: Any) -> str | None:
    """`filename:line name` of the innermost Python frame; torch records innermost first.

    Frames of another shape are passed over; names are cut to `MAX_FRAME_TEXT` characters."""
    for frame in frames if isinstance(frames, list) else []:
        if not isinstance(frame, dict):
            continue
        filename = frame.get("filename")
        if isinstance(filename, str) and filename.endswith(".py"):
            line = frame.get("line")
            name = frame.get("name")
            shown_line = line if isinstance(line, int) and not isinstance(line, bool) else "?"
            shown_name = _cut(name) if isinstance(name, str) else "?"
            return f"{_cut(filename)}:{shown_line} {shown_name}"
    return None


def _block_frames(block: dict[str, Any], where: str) -> tuple[Any, int]:
    """Frames and requested bytes in either format (as `_memory_viz._block_extra` reads them)."""
    if "frames" in block:
        return block["frames"], _size(block.get("requested_size", block["size"]), where)
    history = block.get("history")
    if isinstance(history, list) and history and isinstance(history[0], dict):
        return history[0].get("frames", []), _size(
            history[0].get("real_size", block["size"]), where
        )
    return [], _size(block.get("requested_size", block["size"]), where)


def _summarize_device(
    device: int, segments: list[dict[str, Any]], trace: list[Any]
) -> DeviceSummary:
    """One device's totals in one pass, keeping a bounded amount of what it passes: the
    `TOP_ALLOCATIONS` largest blocks, `MAX_OOMS` OOM events and `MAX_ACTIONS` action names.
    A frame is turned into text only for what is kept (a reused million-character file name
    used to be copied into every block's text)."""
    allocated = active = inactive = largest_free = blocks = 0
    top: list[tuple[int, int, dict[str, Any], int | None]] = []  # (size, order, block, address)
    order = 0
    for segment in segments:
        offset = 0
        seg_allocated = seg_active = 0
        for block in segment["blocks"]:
            blocks += 1
            size, state = block["size"], block["state"]
            address = _address(block.get("address"))
            if address is None and _address(segment.get("address")) is not None:
                address = segment["address"] + offset  # old blocks carry no address
            offset += size
            if state == "inactive":
                inactive += size
                largest_free = max(largest_free, size)
                continue
            seg_active += size
            if state == "active_allocated":
                seg_allocated += size
                order += 1
                entry = (size, -order, block, address)
                if len(top) < TOP_ALLOCATIONS:
                    heapq.heappush(top, entry)
                elif entry[:2] > top[0][:2]:
                    heapq.heapreplace(top, entry)
        # Trust the allocator's own totals where present; older snapshots lack them.
        own_allocated, own_active = segment.get("allocated_size"), segment.get("active_size")
        allocated += own_allocated if own_allocated is not None else seg_allocated
        active += own_active if own_active is not None else seg_active
    live = []
    for size, _order, block, address in sorted(top, key=lambda e: e[:2], reverse=True):
        frames, requested = _block_frames(block, f"a requested size on device {device}")
        live.append(Allocation(size, requested, address, first_python_frame(frames)))
    ooms: list[OomEvent] = []
    oom_count = 0
    actions: Counter[str] = Counter()
    for event in trace:
        if not isinstance(event, dict):
            continue
        action = event.get("action")
        if not isinstance(action, str):
            action = "(no action)"
        if action not in actions and len(actions) >= MAX_ACTIONS:
            action = "(other)"
        actions[action] += 1
        if action != "oom":
            continue
        oom_count += 1
        size = _size(event.get("size", 0), f"an oom event's size on device {device}")
        free = _optional_size(
            event.get("device_free"), f"an oom event's device_free on device {device}"
        )
        if len(ooms) < MAX_OOMS:
            ooms.append(OomEvent(size, free, first_python_frame(event.get("frames"))))
    reserved = sum(segment["total_size"] for segment in segments)
    if max(reserved, allocated, active, inactive) >= MAX_SIZE:
        raise SnapshotError(f"{NOT_SNAPSHOT} (device {device}'s totals do not fit in 64 bits)")
    return DeviceSummary(
        device=device,
        segments=len(segments),
        reserved=reserved,
        allocated=allocated,
        active=active,
        inactive=inactive,
        largest_free_block=largest_free,
        blocks=blocks,
        top_allocations=tuple(live),
        trace_actions=dict(actions),
        ooms=tuple(ooms),
        oom_events=oom_count,
    )


def load_snapshot(path: str | os.PathLike[str]) -> SnapshotSummary:
    """Read and summarize a snapshot file, per device.

    An empty snapshot still has device 0 (with zeros), so every viewer has a step to show.
    Every field is checked for its type and range before it is used (a size is an int of
    int64, a device 0-255), so a wrong one is the one line below, never a traceback.

    Raises:
        SnapshotError: missing, unreadable, not a pickle, a pickle naming any non-builtin global,
            or plain data not shaped like a snapshot.
    """
    path = Path(path)
    data = _read(path)
    try:
        layout, segments, traces, settings = _segments_and_traces(data)
        by_device: dict[int, list[dict[str, Any]]] = {}
        for index, segment in enumerate(segments):
            by_device.setdefault(_check_segment(index, segment), []).append(segment)
        numbers = sorted(set(by_device) | {n for n, trace in enumerate(traces) if trace}) or [0]
        devices = tuple(
            _summarize_device(n, by_device.get(n, []), traces[n] if n < len(traces) else [])
            for n in numbers
        )
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    except (TypeError, ValueError, AttributeError, OverflowError, KeyError) as exc:
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
    if device.oom_events:
        text += f"; {device.oom_events} out-of-memory event(s) in the trace"
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
