"""What `--alloc-events` recordings show: rows for the TUI, a dict for the report, a text section.

Pure functions over `schema.AllocEvents` (no Textual, no torch). A step's events are listed with
the out-of-memory event first (the one to act on), then its largest allocations and the segment
growth, each with the source line that asked for it, then what the bounded ring did not keep.
The step that never closed (the job died in it, usually of an OOM) comes from the `End` frame.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from memtui_protocol import schema
from memtui_protocol.schema import TextEnum
from memtui_protocol.units import format_bytes


class AllocKind(TextEnum):
    """What a line of the allocations table is (the table styles by this, never by its words)."""

    HEADING = "heading"
    """A step's totals, first in its block."""
    NONE = "none"
    """Nothing recorded for the cursor step."""
    OOM = "oom"
    ALLOC = "alloc"
    SEGMENT = "segment"
    RING_FULL = "ring_full"


@dataclass(frozen=True)
class AllocRow:
    """One line of the allocations table: what happened, how big, how often, from where."""

    kind: AllocKind
    label: str
    """The event column's words (`OOM`, `segment +`, `step 25 (never closed)`)."""
    size: int | None
    count: int | None
    where: str


def alloc_rows(
    events: schema.AllocEvents | None,
    binary: bool = True,
    unfinished: schema.AllocEvents | None = None,
    unfinished_step: int | None = None,
    has_step: bool = True,
) -> tuple[AllocRow, ...]:
    """The cursor step's events, then (on the newest step) the unfinished step's.

    Args:
        events: the cursor step's `alloc_events` (None: nothing recorded for it).
        binary: GiB or GB in the free-memory text of an OOM row.
        unfinished: the `End` frame's events, shown when the cursor is on the newest step.
        unfinished_step: that step's number, for its heading row.
        has_step: whether there is a cursor step at all (not before the first close).
    """
    rows: list[AllocRow] = []
    if events is None and has_step:
        rows.append(
            AllocRow(AllocKind.NONE, "none", None, None, "no allocator history for this step")
        )
    elif events is not None:
        rows.extend(_step_rows("step", events, binary))
    if unfinished is not None:
        label = f"step {unfinished_step}" if unfinished_step is not None else "last step"
        rows.extend(_step_rows(f"{label} (never closed)", unfinished, binary))
    return tuple(rows)


def _step_rows(heading: str, events: schema.AllocEvents, binary: bool) -> list[AllocRow]:
    summary = "all allocations of the step"
    if events.segment_allocs:
        grown = format_bytes(events.segment_bytes, binary)
        summary += f"; the allocator grew {events.segment_allocs} segment(s) by {grown}"
    rows = [AllocRow(AllocKind.HEADING, heading, events.alloc_bytes, events.allocations, summary)]
    if events.oom is not None:
        free = (
            f" ({format_bytes(events.oom_free, binary)} free on the device)"
            if events.oom_free is not None
            else ""
        )
        oom = events.oom
        rows.append(AllocRow(AllocKind.OOM, "OOM", oom.size, oom.count, oom.where + free))
    rows.extend(
        AllocRow(AllocKind.ALLOC, "alloc", row.size, row.count, row.where) for row in events.largest
    )
    rows.extend(
        AllocRow(AllocKind.SEGMENT, "segment +", row.size, row.count, row.where)
        for row in events.segments
    )
    lost = ring_note(events)
    if lost:
        rows.append(AllocRow(AllocKind.RING_FULL, "ring full", None, events.lost or None, lost))
    return rows


def ring_note(events: schema.AllocEvents) -> str:
    """What the bounded ring did not keep, in words; "" when it kept everything."""
    if events.lost:
        return (
            f"{events.lost:,} allocation(s) of this step fell off the bounded ring before the "
            "close: the largest may be among them"
        )
    if events.overflowed:
        return "the ring wrapped within this step: its earliest events are missing"
    return ""


def unfinished_step_number(steps: list[schema.Step]) -> int:
    """The number of the step the job was in when it ended (the one after the last close)."""
    return (steps[-1].step if steps else 0) + 1


def _event_dict(event: schema.AllocEvent) -> dict[str, Any]:
    return {"size": event.size, "count": event.count, "where": event.where}


def events_dict(events: schema.AllocEvents) -> dict[str, Any]:
    """The report's `alloc_events` object (named keys, not the wire's arrays)."""
    oom = None
    if events.oom is not None:
        oom = {**_event_dict(events.oom), "device_free": events.oom_free}
    return {
        "allocations": events.allocations,
        "alloc_bytes": events.alloc_bytes,
        "largest": [_event_dict(event) for event in events.largest],
        "segment_allocs": events.segment_allocs,
        "segment_bytes": events.segment_bytes,
        "segments": [_event_dict(event) for event in events.segments],
        "oom": oom,
        "lost": events.lost,
        "overflowed": events.overflowed,
    }


def events_text(steps: list[schema.Step], end: schema.End | None, binary: bool = True) -> list[str]:
    """The text report's section: the run's largest allocation, growth, OOMs, what was lost."""
    recorded = [(step.step, step.alloc_events) for step in steps if step.alloc_events is not None]
    if end is not None and end.alloc_events is not None:
        recorded.append((unfinished_step_number(steps), end.alloc_events))
    if not recorded:
        return []
    size = partial(format_bytes, binary=binary)
    lines = [f"allocator events (--alloc-events): {len(recorded)} step(s) recorded"]
    largest = [
        (event.size, number, event) for number, events in recorded for event in events.largest
    ]
    if largest:
        top_size, number, event = max(largest, key=lambda item: item[0])
        lines.append(
            f"  largest allocation: {size(top_size)} x{event.count} at step {number}"
            + (f" from {event.where}" if event.where else "")
        )
    grown = [(number, events) for number, events in recorded if events.segment_allocs]
    if grown:
        total = sum(events.segment_bytes for _, events in grown)
        steps_text = ", ".join(str(number) for number, _ in grown[:10])
        more = f" and {len(grown) - 10} more" if len(grown) > 10 else ""
        lines.append(f"  segment growth: {size(total)} in steps {steps_text}{more}")
    for number, events in recorded:
        if events.oom is not None:
            free = f", {size(events.oom_free)} free" if events.oom_free is not None else ""
            where = f" from {events.oom.where}" if events.oom.where else ""
            lines.append(
                f"  out of memory at step {number}: {size(events.oom.size)} requested{free}{where}"
            )
    short = [number for number, events in recorded if events.lost or events.overflowed]
    if short:
        lines.append(
            f"  the bounded ring missed events in {len(short)} step(s) (first: step {short[0]})"
        )
    return lines
