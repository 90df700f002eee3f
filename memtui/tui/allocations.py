"""The allocations table (`--alloc-events`): a passive view of the view state's allocation rows.

Its box is on screen only when the recording has allocator events, so jobs run without the flag
keep the usual layout.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.reactive import reactive

from memtui.model.session import ViewState
from memtui.terminal_text import plain
from memtui.tui.widgets import PanelTable, sync_rows
from memtui_protocol.units import format_bytes

KIND_STYLES = {"OOM": "bold red", "ring full": "yellow", "none": "dim"}


class AllocationsTable(PanelTable):
    """The cursor step's largest allocations, segment growth and OOM, with their source lines."""

    view: reactive[ViewState | None] = reactive(None)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.show_cursor = False
        self.add_columns("event", "size", "count", "source line")

    def watch_view(self, view: ViewState | None) -> None:
        if view is None:
            return
        sync_rows(
            self, (_row(index, row, view.binary) for index, row in enumerate(view.alloc_rows))
        )


def _row(index: int, row: Any, binary: bool) -> tuple[str, tuple[Any, ...]]:
    heading = row.kind not in KIND_STYLES and row.kind not in ("alloc", "segment +")
    style = "bold" if heading else KIND_STYLES.get(row.kind, "")
    size = format_bytes(row.size, binary) if row.size is not None else ""
    count = f"x{row.count:,}" if row.count is not None else ""
    return (
        f"{index}:{row.kind}",
        (
            plain(row.kind, style=style),
            Text(size, justify="right"),
            Text(count, justify="right"),
            plain(row.where),
        ),
    )
