"""The allocations table (`--alloc-events`): a passive view of the view state's allocation rows.

Its box is on screen only when the recording has allocator events, so jobs run without the flag
keep the usual layout.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text

from memtui.model.view_state import AllocationsView
from memtui.terminal_text import plain
from memtui.tui.palette import ALLOC_STYLES
from memtui.tui.widgets import PanelTable, Row
from memtui_protocol.units import format_bytes


class AllocationsTable(PanelTable[AllocationsView]):
    """The cursor step's largest allocations, segment growth and OOM, with their source lines.

    A line's identity is its place in the step's list (the same allocation size and source line
    may appear in two blocks: the cursor step's and the one that never closed)."""

    COLUMNS = ("event", "size", "count", "source line")

    def rows_of(self, view: AllocationsView) -> Iterable[Row]:
        for index, row in enumerate(view.rows):
            size = format_bytes(row.size, view.binary) if row.size is not None else ""
            count = f"x{row.count:,}" if row.count is not None else ""
            yield (
                f"{index}:{row.kind}",
                (
                    plain(row.label, style=ALLOC_STYLES.get(row.kind, "")),
                    Text(size, justify="right"),
                    Text(count, justify="right"),
                    plain(row.where),
                ),
            )
