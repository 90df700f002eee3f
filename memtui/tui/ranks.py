"""The ranks table: every rank of a distributed job side by side, the heaviest per pile marked.

Shown only when the view has several ranks (a session folder, or `attach` to a torchrun job);
single-process jobs keep the usual layout.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text

from memtui.model.step_rows import NOT_KNOWN
from memtui.model.view_state import RanksView
from memtui.terminal_text import plain, terminal_safe
from memtui.tui.palette import COLUMN_LABELS
from memtui.tui.widgets import PanelTable, Row
from memtui_protocol.schema import Pile
from memtui_protocol.units import format_bytes

HEAVIEST_STYLE = "bold #f85149"


class RanksTable(PanelTable[RanksView]):
    """Per rank: the latest step and each pile's high in it; `▶` marks the rank on screen.

    Rows are keyed by the rank's label, which a session folder gives each recording once."""

    COLUMNS = ("rank", "step", *(COLUMN_LABELS[pile] for pile in Pile), "")

    def rows_of(self, view: RanksView) -> Iterable[Row]:
        for row in view.rows:
            marker = "▶ " if row.label == view.shown else "  "
            cells = [
                Text(marker + terminal_safe(row.label)),
                Text(str(row.step or "-"), justify="right"),
            ]
            for pile, value in row.piles:
                shown = format_bytes(value, view.binary, "-" if row.step is None else NOT_KNOWN)
                style = HEAVIEST_STYLE if pile in row.heaviest else ""
                cells.append(Text(shown, style=style, justify="right"))
            cells.append(plain(row.state, style="dim"))
            yield row.label, tuple(cells)
