"""Passive views of a `ViewState`: each widget has one reactive in and renders, nothing else.

No widget reads the Session or a source; the app hands every widget the same immutable view state
at its tick, which is what lets live and replay look identical.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widgets import DataTable, Static

from memtui.model.job_state import JobState
from memtui.model.session import ViewState
from memtui.model.step_rows import describe_rate
from memtui.terminal_text import plain, terminal_safe
from memtui.tui.timeline import PILE_COLOURS
from memtui_protocol.units import format_bytes

PILE_LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations",
    "ddp_buckets": "DDP buckets",
    "fsdp_gathered": "FSDP gathered",
    "other": "other",
}
ROW_COLOURS = {**PILE_COLOURS, "ddp_buckets": "#d29922", "fsdp_gathered": "#39c5cf"}
"""The piles' colours plus the data-parallel wrappers' memory (shown only when present)."""


def _size(value: int | None, binary: bool) -> str:
    return format_bytes(value, binary)


class FlowPanel(Static):
    """A Static whose height follows its content, without a layout pass at every tick.

    A reactive declared with `layout=True` makes Textual lay out and repaint the whole screen
    each time it changes, that is at every tick of a live job (a quarter of a CPU core at 4 Hz
    on a 160x48 terminal). Here the layout runs only when the panel's number of lines changes
    (a note line appears, a long line wraps); otherwise only the panel repaints.
    """

    view: reactive[ViewState | None] = reactive(None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shape: Any = None
        self.lines: list[Text] = []
        """`free_lines` of the current view, built once per view for the layout check and
        `render`."""

    def free_lines(self, view: ViewState | None) -> list[Text]:
        """The lines of the panel that may wrap; the rest is one line per row."""
        return []

    def rows(self, view: ViewState | None) -> int:
        """How many one-line rows the panel shows besides `free_lines`."""
        return 0

    def watch_view(self, view: ViewState | None) -> None:
        width = max(self.size.width, 10)
        console = self.app.console
        self.lines = self.free_lines(view)
        wrapped = tuple(len(line.wrap(console, width)) for line in self.lines)
        shape = (width, self.rows(view), wrapped)
        if shape != self._shape:
            self._shape = shape
            self.refresh(layout=True)


class JobHeader(Static):
    """The job, where it is, and how this view is fed (live socket or recording)."""

    DEFAULT_CSS = "JobHeader { height: 2; padding: 0 1; background: $panel; }"

    view: reactive[ViewState | None] = reactive(None)

    def render(self) -> Text:
        view = self.view
        if view is None:
            return Text("memtui · connecting…")
        width = max(self.size.width - 2, 10)
        ended = view.status is JobState.ENDED
        first = Text(f" {view.state} ", style="bold reverse" if ended else "bold reverse green")
        parts = [describe_rate(view.steps_per_second), view.title]
        if not view.replay:  # replay's state already says which step
            step = f"step {view.step} of {view.steps_total}" if view.step is not None else None
            parts.insert(0, step or "no steps yet")
        first.append("  " + terminal_safe(" · ".join(parts)))
        second = plain(view.job or "(waiting for the job)", style="bold")
        second.append(f"  {terminal_safe(view.source)}", style="dim")
        first.truncate(width, overflow="ellipsis")
        second.truncate(width, overflow="ellipsis")
        return Text("\n").join([first, second])


class PilesPanel(FlowPanel):
    """The step's peak composition as one stacked bar, then each pile's bytes, share and max."""

    def rows(self, view: ViewState | None) -> int:
        return 3 + len(view.piles) if view is not None and view.piles else 1  # bar, head, total

    def free_lines(self, view: ViewState | None) -> list[Text]:
        if view is None or not view.piles:
            return []
        extra = [view.step_owner] if view.step_owner else []
        if view.loss is not None:
            extra.append(f"loss {view.loss:.4g}")
        if view.microbatches:
            extra.append(f"{view.microbatches} microbatch{'es' if view.microbatches > 1 else ''}")
        if view.skipped:
            extra.append("SKIPPED by GradScaler")
        lines = [plain(line, style="dim") for line in view.distributed_lines]
        if not view.activations_measured:  # its own line: it must not wrap into the others
            lines.insert(0, Text(_carried_label(view.activations_from), style="dim"))
        return [Text(" · ".join(extra), style="dim"), *lines]

    def render(self) -> Any:
        view = self.view
        if view is None or not view.piles:
            return Text("no piles yet: waiting for the first forward", style="dim")
        width = max(self.size.width, 10)
        bar = Text()
        used = 0
        for row in view.piles:
            cells = round(row.share * width)
            cells = min(cells, width - used)
            if cells > 0:
                bar.append(" " * cells, style=f"on {ROW_COLOURS[row.name]}")
                used += cells
        if used < width:
            bar.append(" " * (width - used))
        table = Table.grid(padding=(0, 1), expand=True)
        table.add_column("pile", ratio=2, no_wrap=True, overflow="ellipsis")
        table.add_column("at peak", justify="right", ratio=1)
        table.add_column("share", justify="right", ratio=1)
        table.add_column("step max", justify="right", ratio=1)
        table.add_row(
            Text("pile", style="bold"),
            Text("at peak", style="bold"),
            Text("share", style="bold"),
            Text("step max", style="bold"),
        )
        for row in view.piles:
            name = Text("■ ", style=ROW_COLOURS[row.name])
            name.append(PILE_LABELS[row.name])
            if row.name == "activations" and not view.activations_measured:
                name.append(" ≈", style="bold")
            if row.at_peak is None:
                table.add_row(name, Text("n/a", style="dim"), Text(""), Text(""))
                continue
            table.add_row(
                name,
                _size(row.at_peak, view.binary),
                f"{row.share * 100:.1f}%",
                _size(row.step_max, view.binary) if row.step_max is not None else "",
            )
        total = sum(row.at_peak or 0 for row in view.piles)
        table.add_row(Text("total at peak", style="bold"), _size(total, view.binary), "", "")
        from rich.console import Group

        return Group(bar, table, *self.lines)


def _carried_label(source: int | None) -> str:
    """Why the activations row (marked ≈) is not this step's own measurement."""
    if source is None:
        return "≈ activations not measured"
    return f"≈ activations from step {source} (a repeat of its shapes)"


class GapPanel(FlowPanel):
    """Where the bytes are: each level of memory and what the difference to the last means."""

    def rows(self, view: ViewState | None) -> int:
        return len(view.gap) if view is not None and view.gap else 1

    def free_lines(self, view: ViewState | None) -> list[Text]:
        if view is None or not view.gap:
            return []
        return [plain(line, style="dim") for line in view.allocator_lines]

    def render(self) -> Any:
        view = self.view
        if view is None or not view.gap:
            return Text("no data yet", style="dim")
        table = Table.grid(padding=(0, 1), expand=True)
        table.add_column("level", min_width=12, no_wrap=True, overflow="ellipsis")
        table.add_column("bytes", justify="right", width=11, no_wrap=True)
        table.add_column("gap", justify="right", width=12, no_wrap=True)
        table.add_column("meaning", ratio=1, overflow="ellipsis", no_wrap=True)
        for row in view.gap:
            if not row.applicable:
                table.add_row(Text(row.label, style="dim"), Text("n/a", style="dim"), "", "")
                continue
            delta = "" if row.delta is None else "+" + _size(row.delta, view.binary)
            if row.delta is not None and row.delta < 0:
                delta = _size(row.delta, view.binary)
            table.add_row(
                row.label,
                _size(row.value, view.binary),
                delta,
                Text(row.meaning, style="dim"),
            )
        if not view.allocator_lines:
            return table
        from rich.console import Group

        return Group(table, *self.lines)


def sync_rows(table: DataTable[Any], rows: Iterable[tuple[str, tuple[Any, ...]]]) -> None:
    """Make `table` show exactly `rows` (key, cells), updating in place instead of rebuilding.

    Keys are stable (an alert keeps its key as newer ones arrive above it), so when the rows
    change the cursor goes back to the row it was on and that row keeps its place on screen:
    a new alert does not throw the user back to the top of the table.
    """
    wanted = list(rows)
    keys = [key for key, _ in wanted]
    current = [row_key.value for row_key in table.rows]
    if current != keys:
        _rebuild(table, wanted, current)
        return
    columns = list(table.columns)
    for key, cells in wanted:
        for column, value in zip(columns, cells, strict=True):
            # An unchanged cell is left alone: any update re-renders the whole table.
            if table.get_cell(key, column) != value:
                table.update_cell(key, column, value, update_width=True)


def _rebuild(
    table: DataTable[Any], wanted: list[tuple[str, tuple[Any, ...]]], current: list[str | None]
) -> None:
    """Rows were added, removed or reordered: rebuild, then restore the cursor and the scroll."""
    row = table.cursor_row
    held = current[row] if 0 <= row < len(current) else None
    scroll_y = table.scroll_y
    table.clear()
    for key, cells in wanted:
        table.add_row(*cells, key=key)
    keys = [key for key, _ in wanted]
    if held is None or held not in keys:
        return
    moved_to = keys.index(held)
    table.move_cursor(row=moved_to, scroll=False)
    if scroll_y:  # at the very top the newest rows stay in view; scrolled, the rows stay put
        target = max(0.0, scroll_y + moved_to - row)
        table.call_after_refresh(table.scroll_to, y=target, animate=False)


class PanelTable(DataTable):  # type: ignore[type-arg]
    """A table whose row cursor shows only while it has focus (unfocused, no false selection)."""

    def on_focus(self) -> None:
        self.show_cursor = True

    def on_blur(self) -> None:
        self.show_cursor = False


class DtypeTable(PanelTable):
    """Pile x dtype -> bytes and number of unique storages."""

    view: reactive[ViewState | None] = reactive(None)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.show_cursor = False
        self.add_columns("pile", "dtype", "bytes", "storages")

    def watch_view(self, view: ViewState | None) -> None:
        if view is None:
            return
        sync_rows(
            self,
            (
                (
                    f"{pile}/{dtype}",
                    (
                        Text("■ ", style=PILE_COLOURS[pile]) + Text(PILE_LABELS[pile]),
                        plain(dtype),
                        Text(_size(size, view.binary), justify="right"),
                        Text(str(count), justify="right"),
                    ),
                )
                for pile, dtype, size, count in view.dtypes
            ),
        )


class TopActivations(PanelTable):
    """Modules by saved-activation bytes live at once during the cursor step."""

    view: reactive[ViewState | None] = reactive(None)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.show_cursor = False
        self.add_columns("module", "saved")

    def watch_view(self, view: ViewState | None) -> None:
        if view is None:
            return
        sync_rows(
            self,
            (
                (key, (plain(name), Text(_size(size, view.binary), justify="right")))
                for key, name, size in view.top_activations
            ),
        )


WHERE_WIDTH = 32
"""The `where` column's width: a module path or the first parameter names, then an ellipsis."""


def _where_cell(where: str | None) -> Text:
    cell = plain(where or "", style="cyan")
    cell.truncate(WHERE_WIDTH, overflow="ellipsis")
    return cell


class AlertsTable(PanelTable):
    """Alerts newest first; selecting one moves the cursor to its step (handled by the app)."""

    view: reactive[ViewState | None] = reactive(None)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.show_cursor = False
        # `where` before the message: messages are long, and the module or parameter names
        # are what the user acts on, so they must be on screen without scrolling sideways.
        self.add_columns("step", "kind", "where", "message")

    def watch_view(self, view: ViewState | None) -> None:
        if view is None:
            return
        sync_rows(
            self,
            (
                (
                    alert.key,
                    (
                        Text(str(alert.step), justify="right"),
                        plain(alert.kind, style="bold red" if alert.kind == "oom" else "bold"),
                        _where_cell(alert.where),
                        plain(alert.message),
                    ),
                )
                for alert in view.alerts
            ),
        )

    def step_of_row(self, row_key: str) -> int | None:
        """The step of the alert shown in a row, from the view state (never from a cell's text)."""
        view = self.view
        if view is None:
            return None
        return next((alert.step for alert in view.alerts if alert.key == row_key), None)


class NotesLine(FlowPanel):
    """Warnings about the view itself: damaged recording tails, agent parts that turned off."""

    DEFAULT_CSS = "NotesLine { height: auto; color: $warning; padding: 0 1; }"

    def free_lines(self, view: ViewState | None) -> list[Text]:
        return [plain(" · ".join(view.notes))] if view is not None and view.notes else []

    def render(self) -> Text:
        return self.lines[0] if self.lines else Text("")
