"""A leak as the viewer holds and words it: a graph history grows in nodes, never in bytes, and
a recording made before nodes were counted still reads."""

from __future__ import annotations

import msgspec

from memtui.model.leaks import LeakRow, leak_growth, leak_holding
from memtui.reports.leak_report import leak_entry
from memtui_protocol import schema
from memtui_protocol.schema import LeakKind
from memtui_protocol.units import format_bytes


def _history() -> schema.Leak:
    return schema.Leak(
        holder="total_loss",
        kind="graph_history",
        bytes=4,
        tensors=1,
        per_step=0,
        first_step=2,
        nodes=960,
        nodes_per_step=14,
    )


def test_a_graph_history_is_shown_in_nodes_and_a_tensor_leak_in_bytes() -> None:
    row = LeakRow.of(_history(), counted_at=69)
    assert row.kind is LeakKind.GRAPH_HISTORY
    assert leak_holding(row) == "960 graph nodes"
    assert leak_growth(row, format_bytes) == "+14 nodes"
    entry = leak_entry(row)
    assert (entry.kind, entry.nodes, entry.nodes_per_step) == ("graph_history", 960, 14)
    tensors = LeakRow.of(
        schema.Leak(holder="history", kind="tensors", bytes=8192, tensors=2, per_step=4096,
                    first_step=3),
        counted_at=9,
    )  # fmt: skip
    assert (
        leak_growth(tensors, format_bytes) == "+4.00 KiB" and leak_holding(tensors) == "2 tensors"
    )


def test_a_leak_recorded_before_nodes_were_counted_reads_with_none() -> None:
    old = msgspec.json.encode(
        {"holder": "h", "kind": "tensors", "bytes": 1, "tensors": 1, "per_step": 1, "first_step": 1}
    )
    leak = msgspec.json.decode(old, type=schema.Leak)
    assert (leak.nodes, leak.nodes_per_step) == (0, 0)
    assert "nodes" not in msgspec.json.decode(msgspec.json.encode(leak))  # omitted when 0
