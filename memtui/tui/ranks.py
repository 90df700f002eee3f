"""The ranks table: every rank of a distributed job side by side, the heaviest per pile marked.

Shown only when the view has several ranks (a session folder, or `attach` to a torchrun job);
single-process jobs keep the usual layout.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.reactive import reactive

from memtui.model.rank_rows import RankRow
from memtui.model.session import ViewState
from memtui.terminal_text import plain, terminal_safe
from memtui.tui.widgets import PanelTable, sync_rows
from memtui_protocol.schema import PILES
from memtui_protocol.units import format_bytes

HEAVIEST_STYLE = "bold #f85149"


class RanksTable(PanelTable):
    """Per rank: the latest step and each pile's high in it; `▶` marks the rank on screen."""

    view: reactive[ViewState | None] = reactive(None)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.show_cursor = False
        self.add_columns("rank", "step", "weights", "gradients", "optimizer", "activations", "")

    def watch_view(self, view: ViewState | None) -> None:
        if view is None:
            return
        sync_rows(self, (self._row(row, view) for row in view.ranks))

    def _row(self, row: RankRow, view: ViewState) -> tuple[str, tuple[Any, ...]]:
        marker = "▶ " if row.label == view.rank else "  "
        cells: list[Any] = [
            Text(marker + terminal_safe(row.label)),
            Text(str(row.step or "-"), justify="right"),
        ]
        for pile, value in zip(PILES, row.piles, strict=True):
            shown = format_bytes(value, view.binary) if value is not None else "-"
            style = HEAVIEST_STYLE if pile in row.heaviest else ""
            cells.append(Text(shown, style=style, justify="right"))
        cells.append(plain(row.state, style="dim"))
        return row.label, tuple(cells)
