"""The allocator's history entries, read without torch: which are new, and a step's summary.

Entries are dicts as `torch.cuda.memory._snapshot()["device_traces"]` holds them, one list per
device, oldest first: `action` ("alloc", "free_requested", "free_completed", "segment_alloc",
"segment_free", "segment_map", "segment_unmap", "snapshot", "oom"), `addr` (`device_free` on an
"oom"), `size`, `stream`, `frames` (innermost first: `filename`, `line`, `name`; absent when no
stack was recorded) and, in newer torch, `time_us`. Older formats lack `time_us`; every read of
the ring leaves a "snapshot" entry behind it, which marks the boundary there instead. Malformed
entries are skipped, never fatal: this runs inside the training job.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

from memtui_protocol import schema

TOP = 10
"""Largest allocations and segment growth events kept per step."""
WHERE_CHARS = 160
GROWTH_ACTIONS = ("segment_alloc", "segment_map")
SKIP_MARKERS = ("/site-packages/torch/", "/dist-packages/torch/", "/torchinductor_")
"""Frames in these paths are torch's own (or code it generated), never the user's line."""


# ----- which entries are new ---------------------------------------------------------------------


@dataclass
class Cursor:
    """Where the previous read of one device's ring ended."""

    drained: bool = False
    time_us: int | None = None
    at_time: int = 0
    """Entries stamped with `time_us` that were already read (several share a microsecond)."""


def _time(entry: Any) -> int | None:
    value = entry.get("time_us") if isinstance(entry, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _action(entry: Any) -> Any:
    return entry.get("action") if isinstance(entry, dict) else None


def new_entries(
    trace: list[Any], cursor: Cursor, max_entries: int
) -> tuple[list[Any], bool, Cursor]:
    """The entries of one device's ring newer than `cursor`, oldest first.

    Returns the new entries, whether the ring wrapped past the cursor (events in between may be
    lost), and the cursor for the next read.
    """
    if not trace:
        return [], False, cursor
    full = len(trace) >= max_entries
    newest = _time(trace[-1])
    if not cursor.drained:
        new, overflowed = list(trace), full
    elif cursor.time_us is not None and newest is not None:
        new, overflowed = _newer_than_time(trace, cursor.time_us, cursor.at_time, full)
    else:
        # No timestamps (older torch): every read leaves a "snapshot" entry behind it.
        marker = next(
            (i for i in range(len(trace) - 1, -1, -1) if _action(trace[i]) == "snapshot"), None
        )
        new = list(trace[marker + 1 :]) if marker is not None else list(trace)
        overflowed = marker is None and full
    at_time = 0
    for entry in reversed(trace):
        if _time(entry) != newest:
            break
        at_time += 1
    return new, overflowed, Cursor(drained=True, time_us=newest, at_time=at_time)


def _newer_than_time(
    trace: list[Any], last: int, seen_at_last: int, full: bool
) -> tuple[list[Any], bool]:
    """Entries after the cursor by time, scanning from the newest end (the ring is in order)."""
    newer = len(trace)
    while newer > 0 and (_time(trace[newer - 1]) or 0) > last:
        newer -= 1
    same = newer
    while same > 0 and _time(trace[same - 1]) == last:
        same -= 1
    at_last = newer - same
    # Entries stamped in the cursor's own microsecond after the previous read came last.
    extra = at_last - seen_at_last if at_last > seen_at_last else 0
    new = list(trace[newer - extra :])
    # Nothing at or before the cursor is left: the ring wrapped, unless the first new entry is
    # the "snapshot" mark the previous read itself left right after the cursor.
    overflowed = full and same == 0 and at_last == 0 and (not new or _action(new[0]) != "snapshot")
    return new, overflowed


# ----- the summary -------------------------------------------------------------------------------


def _is_user_file(filename: str, skip_prefixes: tuple[str, ...]) -> bool:
    path = filename.replace("\\", "/")
    return not any(marker in path for marker in SKIP_MARKERS) and not filename.startswith(
        skip_prefixes
    )


def _format_where(frame: dict[str, Any], cwd: str | None) -> str:
    filename = str(frame.get("filename", ""))
    if cwd and filename.startswith(cwd.rstrip(os.sep) + os.sep):
        filename = filename[len(cwd.rstrip(os.sep)) + 1 :]
    where = f"{filename}:{frame.get('line', '?')} {frame.get('name', '?')}"
    return where if len(where) <= WHERE_CHARS else "…" + where[-(WHERE_CHARS - 1) :]


class _SourceLines:
    """The user's source line for a stack, with each frame judged once per summary.

    torch symbolises a ring read into shared frame dicts, so judging by identity makes the walk
    a few dictionary lookups per entry; the cache lives only while those objects do.
    """

    def __init__(self, skip_prefixes: tuple[str, ...], cwd: str | None) -> None:
        self.skip_prefixes = skip_prefixes
        self.cwd = cwd
        self._verdicts: dict[int, tuple[bool, bool]] = {}
        self._keep: list[Any] = []

    def _verdict(self, frame: dict[str, Any]) -> tuple[bool, bool]:
        known = self._verdicts.get(id(frame))
        if known is None:
            filename = frame.get("filename")
            python = isinstance(filename, str) and filename.endswith(".py")
            known = (python, python and _is_user_file(str(filename), self.skip_prefixes))
            self._verdicts[id(frame)] = known
            self._keep.append(frame)  # ids stay unique while the frame is alive
        return known

    def where(self, frames: Any) -> str:
        """Innermost frame outside torch and the agent; else the innermost Python frame."""
        fallback = None
        for frame in frames if isinstance(frames, list) else ():
            if not isinstance(frame, dict):
                continue
            python, user = self._verdict(frame)
            if user:
                return _format_where(frame, self.cwd)
            if python and fallback is None:
                fallback = frame
        return _format_where(fallback, self.cwd) if fallback is not None else ""


def _size(entry: dict[str, Any]) -> int | None:
    size = entry.get("size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size >= 0 else None


def _fold(by_size: dict[int, list[dict[str, Any]]], lines: _SourceLines, top: int) -> list[Any]:
    """Largest first, one row per size and source line; only the top sizes walk their frames."""
    rows: list[schema.AllocEvent] = []
    for size in sorted(by_size, reverse=True):
        if len(rows) >= top:
            break
        counts = Counter(lines.where(entry.get("frames")) for entry in by_size[size])
        rows.extend(
            schema.AllocEvent(size=size, count=count, where=where)
            for where, count in sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        )
    return rows[:top]


def summarize(
    entries: list[Any],
    *,
    expected_allocations: int | None = None,
    overflowed: bool = False,
    top: int = TOP,
    skip_prefixes: tuple[str, ...] = (),
    cwd: str | None = None,
) -> schema.AllocEvents:
    """A step's events from its ring entries (dicts as `_snapshot()["device_traces"]` holds).

    Args:
        entries: the step's entries, oldest first; malformed ones are skipped.
        expected_allocations: the step's allocation count from the allocator's counters, to
            count allocations the ring did not keep; None when unknown.
        overflowed: the ring wrapped past the previous read.
        top: rows kept for the largest allocations and for segment growth.
        skip_prefixes: paths whose frames are not the user's (torch's and the agent's folders).
        cwd: the job's folder; source lines under it are shown relative to it.
    """
    allocations = alloc_bytes = growth = growth_bytes = oom_count = 0
    by_size: dict[int, list[dict[str, Any]]] = {}
    growth_by_size: dict[int, list[dict[str, Any]]] = {}
    oom_entry: dict[str, Any] | None = None
    for entry in entries:
        if not isinstance(entry, dict):
            continue
        action = entry.get("action")
        size = _size(entry)
        if size is None:
            continue
        if action == "alloc":
            allocations += 1
            alloc_bytes += size
            by_size.setdefault(size, []).append(entry)
        elif action in GROWTH_ACTIONS:
            growth += 1
            growth_bytes += size
            growth_by_size.setdefault(size, []).append(entry)
        elif action == "oom":
            oom_count += 1
            oom_entry = entry
    lines = _SourceLines(skip_prefixes, cwd)
    oom = oom_free = None
    if oom_entry is not None:
        oom = schema.AllocEvent(
            size=_size(oom_entry) or 0, count=oom_count, where=lines.where(oom_entry.get("frames"))
        )
        free = oom_entry.get("device_free")
        oom_free = free if isinstance(free, int) and not isinstance(free, bool) else None
    lost = 0
    if expected_allocations is not None and expected_allocations > allocations:
        lost = expected_allocations - allocations
    return schema.AllocEvents(
        largest=_fold(by_size, lines, top),
        segments=_fold(growth_by_size, lines, top),
        allocations=allocations,
        alloc_bytes=alloc_bytes,
        segment_allocs=growth,
        segment_bytes=growth_bytes,
        oom=oom,
        oom_free=oom_free,
        lost=lost,
        overflowed=overflowed,
    )


def device_traces(snapshot: Any) -> list[list[Any]]:
    """`snapshot["device_traces"]`, checked: one list of entries per device."""
    traces = snapshot.get("device_traces") if isinstance(snapshot, dict) else None
    if not isinstance(traces, list) or not all(isinstance(trace, list) for trace in traces):
        raise ValueError("this torch's memory snapshot has no device_traces list")
    return traces


@dataclass
class Drained:
    """What a close read from the ring; summarised when the step's frame is built
    (`steps.frame.build_step`, as the emitter writes it)."""

    entries: list[Any]
    overflowed: bool
    expected_allocations: int | None
    skip_prefixes: tuple[str, ...] = ()
    cwd: str | None = None

    def summary(self) -> schema.AllocEvents | None:
        """The step's `AllocEvents` (None if the entries could not be read: never raises)."""
        try:
            return summarize(
                self.entries,
                expected_allocations=self.expected_allocations,
                overflowed=self.overflowed,
                skip_prefixes=self.skip_prefixes,
                cwd=self.cwd,
            )
        except Exception:
            return None
