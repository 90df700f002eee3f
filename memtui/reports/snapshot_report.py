"""`memtui report` on a PyTorch memory snapshot: a text summary or a small JSON document.

Kept apart from `report.py` because a snapshot is one instant of the allocator, not a run of
steps: it has segments and blocks where a recording has piles, so the two reports share no keys.
"""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Any

from memtui.input.torch_snapshot import DeviceSummary, SnapshotSummary, load_snapshot
from memtui.terminal_text import json_safe, terminal_safe
from memtui_protocol.units import format_bytes


def device_report(device: DeviceSummary) -> dict[str, Any]:
    """One entry of `devices`: bytes as plain ints, fragmentation as a 0-1 share."""
    return {
        "device": f"cuda:{device.device}",
        "segments": device.segments,
        "reserved": device.reserved,
        "allocated": device.allocated,
        "active": device.active,
        "inactive": device.inactive,
        "fragmentation": round(device.fragmentation, 6),
        "largest_free_block": device.largest_free_block,
        "blocks": device.blocks,
        "top_allocations": [
            {
                "size": item.size,
                "requested_size": item.requested_size,
                "address": item.address,
                "frame": item.frame,
            }
            for item in device.top_allocations
        ],
        "trace_actions": dict(sorted(device.trace_actions.items())),
        "oom_events": [
            {"size": oom.size, "device_free": oom.device_free, "frame": oom.frame}
            for oom in device.ooms
        ],
        "oom_events_total": device.oom_events,
    }


def build_snapshot_report(summary: SnapshotSummary) -> dict[str, Any]:
    """The `memtui report SNAPSHOT --json` document."""
    return {
        "format": "memtui-snapshot-report",
        "version": 1,
        "snapshot": str(summary.path),
        "layout": summary.layout,
        "allocator_settings": summary.allocator_settings,
        "devices": [device_report(device) for device in summary.devices],
    }


def render_snapshot_text(summary: SnapshotSummary, binary: bool = True) -> str:
    """The readable summary: OOMs first (the reason anyone dumps a snapshot), then totals."""
    size = partial(format_bytes, binary=binary)
    lines = [f"PyTorch memory snapshot ({summary.layout} format): {summary.path}"]
    for device in summary.devices:
        lines.append(f"cuda:{device.device}")
        for oom in device.ooms:
            free = f", {size(oom.device_free)} free on the device" if oom.device_free else ""
            where = f" at {oom.frame}" if oom.frame else ""
            lines.append(f"  OUT OF MEMORY: {size(oom.size)} requested{free}{where}")
        lines.append(f"  segments: {device.segments} ({device.blocks} blocks)")
        lines.append(f"  reserved: {size(device.reserved)}")
        lines.append(f"  allocated: {size(device.allocated)}")
        lines.append(f"  active (incl. pending frees): {size(device.active)}")
        lines.append(
            f"  inactive (free blocks in segments): {size(device.inactive)}, "
            f"{device.fragmentation:.1%} of reserved; largest free block "
            f"{size(device.largest_free_block)}"
        )
        if device.top_allocations:
            lines.append("  largest allocations:")
            for item in device.top_allocations:
                lines.append(f"    {size(item.size):>12}  {item.frame or '(no frames recorded)'}")
        if device.trace_actions:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(device.trace_actions.items()))
            lines.append(f"  trace: {sum(device.trace_actions.values())} events ({counts})")
        shown = (
            f" (the first {len(device.ooms)} above)" if device.oom_events > len(device.ooms) else ""
        )
        lines.append(f"  oom events: {device.oom_events}{shown}")
    return "\n".join(lines)


def report_snapshot(path: str | os.PathLike[str], as_json: bool, binary: bool = True) -> int:
    """`memtui report` for a snapshot file: prints the report, returns the exit code."""
    summary = load_snapshot(path)
    if as_json:
        print(json_safe(json.dumps(build_snapshot_report(summary), indent=2, default=str)))
    else:
        print(terminal_safe(render_snapshot_text(summary, binary), keep_newlines=True))
    return 0
