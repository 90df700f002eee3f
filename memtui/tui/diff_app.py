"""`memtui diff A B --tui`: the diff's rows in a table, the two runs named in the header.

A passive view: the rows are `memtui.reports.diff_report.diff_rows`, the same the text diff
prints, so the screen and `memtui diff` without `--tui` cannot disagree. `u` switches binary
and decimal units (the rows are rebuilt from the diff, never from their text).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Footer, Static

from memtui.model.run_diff import RunDiff
from memtui.reports.diff_report import DiffRow, RunName, diff_rows
from memtui.terminal_text import plain

COLUMNS = ("", "A", "B", "change")
"""The table's columns: what, run A's figure, run B's, and B minus A."""


class DiffApp(App[int]):
    """One screen: which runs, then the diff table (arrows scroll it, `q` quits)."""

    TITLE = "memtui diff"
    CSS = """
    #runs { height: auto; padding: 0 1; border: round $primary 40%; }
    #diff { height: 1fr; }
    """
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("u", "toggle_units", "Units"),
    ]

    def __init__(self, diff: RunDiff, names: tuple[RunName, RunName], binary: bool = True):
        super().__init__()
        self.diff = diff
        self.names = names
        self.binary = binary

    def compose(self) -> ComposeResult:
        yield Static(self.runs_text(), id="runs")
        yield DataTable(id="diff", cursor_type="row", zebra_stripes=True)
        yield Footer()

    def runs_text(self) -> Text:
        """The header: which recording each side is (shown literally: a path is the user's
        text, never markup)."""
        text = plain(f"A: {self.names[0].shown}")
        text.append("\n")
        text.append_text(plain(f"B: {self.names[1].shown}"))
        return text

    def on_mount(self) -> None:
        table = self.query_one("#diff", DataTable)
        table.add_columns(*COLUMNS)
        self.fill()
        table.focus()

    @property
    def rows(self) -> tuple[DiffRow, ...]:
        """The rows on screen, in the units shown."""
        return diff_rows(self.diff, self.binary)

    def fill(self) -> None:
        """The table's rows, each under its section's name, keyed by the row's identity."""
        table = self.query_one("#diff", DataTable)
        table.clear()
        section = None
        for row in self.rows:
            if row.section is not section:
                section = row.section
                table.add_row(
                    Text(f"{section}:", style="bold"), "", "", "", key=f"section-{section}"
                )
            table.add_row(
                plain(f"  {row.what}"),
                plain(row.a, justify="right"),
                plain(row.b, justify="right"),
                plain(row.change),
                key=row.key,
            )

    def action_toggle_units(self) -> None:
        self.binary = not self.binary
        self.fill()
