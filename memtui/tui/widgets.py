"""Passive views of the view state: each widget has one reactive, its own slice, and renders.

No widget reads the Session or a source; the app hands each widget its slice of the same
immutable view state at its tick, which is what lets live and replay look identical. A widget
whose slice is equal to the one it holds is skipped (Textual's reactive compares them), so a
tick redraws only the panels whose data moved.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Generic, TypeVar

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.geometry import Size
from textual.reactive import reactive
from textual.widgets import DataTable, Static

from memtui.model.job_state import JobState
from memtui.model.kept_trail import kept_words
from memtui.model.leaks import leak_cadence, leak_growth, leak_holding
from memtui.model.step_rows import NOT_KNOWN, AlertRow, describe_rate
from memtui.model.view_state import (
    ActivationsView,
    AlertsView,
    DtypesView,
    GapView,
    HeaderView,
    NotesView,
    PilesView,
)
from memtui.terminal_text import plain, terminal_safe
from memtui.tui.palette import (
    ERROR_STYLE,
    PART_COLOURS,
    PART_LABELS,
    PILE_COLOURS,
    SEVERITY_STYLES,
    SEVERITY_WORDS,
    alert_style,
)
from memtui_protocol.peak import PEAK_LABEL
from memtui_protocol.schema import Pile, Severity
from memtui_protocol.units import format_bytes

ViewT = TypeVar("ViewT")
"""The slice of the view state a widget shows."""
Row = tuple[str, tuple[Text, ...]]
"""A table row: its key (a real identity, unique in the table) and its cells."""


def _size(value: int | None, binary: bool, missing: str = "n/a") -> str:
    return format_bytes(value, binary, missing)


class FlowPanel(Static, Generic[ViewT]):
    """A Static whose height follows its content, without a layout pass at every tick.

    A reactive declared with `layout=True` makes Textual lay out and repaint the whole screen
    each time it changes, that is at every tick of a live job (a quarter of a CPU core at 4 Hz
    on a 160x48 terminal). Here the layout runs only when the panel's number of lines changes
    (a note line appears, a long line wraps); otherwise only the panel repaints.
    """

    view: reactive[ViewT | None] = reactive(None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shape: tuple[int, int, tuple[int, ...]] | None = None
        self.lines: list[Text] = []
        """`free_lines` of the current view, built once per view for the layout check and
        `render`."""

    def free_lines(self, view: ViewT | None) -> list[Text]:
        """The lines of the panel that may wrap; the rest is one line per row."""
        return []

    def rows(self, view: ViewT | None) -> int:
        """How many one-line rows the panel shows besides `free_lines`."""
        return 0

    def watch_view(self, view: ViewT | None) -> None:
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

    view: reactive[HeaderView | None] = reactive(None)

    def render(self) -> Text:
        view = self.view
        if view is None:
            return Text("memtui · connecting…")
        width = max(self.size.width - 2, 10)
        ended = view.status is JobState.ENDED
        state = f" {terminal_safe(view.state)} "  # the End's status and phase are recorded text
        style = "bold reverse" if ended else "bold reverse green"
        if ended and view.worst is Severity.ERROR:  # its words say which error, too
            style = "bold reverse red"
        first = Text(state, style=style)
        step = "no steps yet"
        if view.step is not None:
            step = f"step {view.step} of {view.steps_total}"
            if view.first_step is not None:
                step += f" (recorded from step {view.first_step})"
        parts = [step, describe_rate(view.steps_per_second), view.title]
        first.append("  " + terminal_safe(" · ".join(parts)))
        second = plain(view.job or "(waiting for the job)", style="bold")
        second.append(f"  {terminal_safe(view.source)}", style="dim")
        first.truncate(width, overflow="ellipsis")
        second.truncate(width, overflow="ellipsis")
        return Text("\n").join([first, second])


class PilesPanel(FlowPanel[PilesView]):
    """The step's peak composition as one stacked bar, then each pile's bytes, share and max."""

    def rows(self, view: PilesView | None) -> int:
        return 3 + len(view.rows) if view is not None and view.rows else 1  # bar, head, total

    def free_lines(self, view: PilesView | None) -> list[Text]:
        if view is None or not view.rows:
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
            label = _activations_label(view.activations_from, view.activations_why_at)
            lines.insert(0, Text(label, style="dim"))
        if view.kept is not None:  # holders are the job's names: recorded text
            lines.append(plain(kept_words(view.kept, view.binary), style="dim"))
        return [plain(" · ".join(extra), style="dim"), *lines]  # the optimizer's recorded name

    def render(self) -> Text | Group:
        view = self.view
        if view is None or not view.rows:
            return Text("no piles yet: waiting for the first forward", style="dim")
        width = max(self.size.width, 10)
        bar = Text()
        used = 0
        for row in view.rows:
            cells = round(row.share * width)
            cells = min(cells, width - used)
            if cells > 0:
                bar.append(" " * cells, style=f"on {PART_COLOURS[row.name]}")
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
        for row in view.rows:
            name = Text("■ ", style=PART_COLOURS[row.name])
            name.append(PART_LABELS[row.name])
            if row.name is Pile.ACTIVATIONS and not view.activations_measured and row.known:
                name.append(" ≈", style="bold")
            if not row.known:  # its high where that is known (the weights' of a step not known)
                high = _size(row.step_max, view.binary) if row.step_max is not None else ""
                table.add_row(name, Text(NOT_KNOWN, style="bold"), Text(""), high)
                continue
            if row.at_peak is None:
                table.add_row(name, Text("n/a", style="dim"), Text(""), Text(""))
                continue
            table.add_row(
                name,
                _size(row.at_peak, view.binary),
                f"{row.share * 100:.1f}%",
                _size(row.step_max, view.binary) if row.step_max is not None else "",
            )
        # The one peak every view states (memtui_protocol.peak): GPU's "other" is beside it.
        total: Text | str = Text(NOT_KNOWN, style="bold")
        if view.peak is not None:
            total = _size(view.peak, view.binary)
        elif all(row.known for row in view.rows):  # the live piles before the first step
            total = _size(sum(row.at_peak or 0 for row in view.rows), view.binary)
        table.add_row(Text(PEAK_LABEL, style="bold"), total, "", "")
        return Group(bar, table, *self.lines)


def _activations_label(source: int | None, why_at: int | None = None) -> str:
    """Why the activations row is not this step's own measurement: carried (marked ≈), or not
    known (no figure shown, and the step whose alert says why)."""
    if source is None:
        why = f" (why: the alert of step {why_at})" if why_at is not None else ""
        return (
            f"activations {NOT_KNOWN}: this step was not measured, nor confirmed as a repeat "
            f"of a measured step{why}"
        )
    return f"≈ activations from step {source} (a repeat, proven by its counters)"


class GapPanel(FlowPanel[GapView]):
    """Where the bytes are: each level of memory and what the difference to the last means."""

    def rows(self, view: GapView | None) -> int:
        if view is None or not view.rows:
            return 1
        return len(view.rows) + (1 + len(view.leaks) if view.leaks else 0)

    def free_lines(self, view: GapView | None) -> list[Text]:
        if view is None or not view.rows:
            return []
        lines = [plain(line, style="dim") for line in view.allocator_lines]
        if view.leaks:
            lines.append(Text(_leaks_heading(view), style=ERROR_STYLE))
        return lines

    def render(self) -> Text | Table | Group:
        view = self.view
        if view is None or not view.rows:
            return Text("no data yet", style="dim")
        table = Table.grid(padding=(0, 1), expand=True)
        table.add_column("level", min_width=12, no_wrap=True, overflow="ellipsis")
        table.add_column("bytes", justify="right", width=11, no_wrap=True)
        table.add_column("gap", justify="right", width=12, no_wrap=True)
        table.add_column("meaning", ratio=1, overflow="ellipsis", no_wrap=True)
        for row in view.rows:
            if not row.applicable:  # n/a, and why (no GPU)
                table.add_row(
                    Text(row.label, style="dim"),
                    Text("n/a", style="dim"),
                    "",
                    Text(row.meaning, style="dim"),
                )
                continue
            if not row.known:
                table.add_row(
                    row.label, Text(NOT_KNOWN, style="bold"), "", Text(row.meaning, style="dim")
                )
                continue
            delta = "" if row.delta is None else "+" + _size(row.delta, view.binary)
            if row.delta is not None and (row.delta < 0 or row.free):
                delta = _size(row.delta, view.binary)  # "22.82 GiB free on the machine"
            table.add_row(
                row.label,
                _size(row.value, view.binary),
                delta,
                Text(row.meaning, style="dim"),
            )
        if not view.leaks:
            return Group(table, *self.lines) if self.lines else table
        *allocator, heading = self.lines
        return Group(table, *allocator, heading, _leaks_table(view))


def _leaks_heading(view: GapView) -> str:
    """Which count the leak rows are: the job's last, or the censuses of the cursor step and
    those before it."""
    what = "memory no pile holds, by holder"
    if view.leaks_final:
        return f"Leaks at the job's end: {what}"
    counted = {row.counted_at for row in view.leaks}
    if len(counted) == 1:
        return f"Leaks as the census at step {counted.pop()} counted them: {what}"
    return f"Leaks, each holder's latest census up to this step: {what}"


def _leaks_table(view: GapView) -> Table:
    """One row per growing holder, as an error (red), largest and oldest first (the view's
    order): what it keeps alive, its growth per step, since when, how often it grows."""
    table = Table.grid(padding=(0, 1), expand=True)
    table.add_column("holder", ratio=1, min_width=12, no_wrap=True, overflow="ellipsis")
    table.add_column("held", justify="right", width=11, no_wrap=True)
    table.add_column("per step", justify="right", width=12, no_wrap=True)
    table.add_column("since", justify="right", width=10, no_wrap=True)
    cadence = any(row.every is not None for row in view.leaks)  # a column only when known
    if cadence:
        table.add_column("grows", width=13, no_wrap=True, overflow="ellipsis")
    table.add_column("holds", width=16, no_wrap=True, overflow="ellipsis")
    heading = ("holder", "held", "per step", "since", *(("grows",) if cadence else ()), "holds")
    table.add_row(*(Text(cell, style="dim") for cell in heading))
    for row in view.leaks:
        grows = (Text(leak_cadence(row.every) or "", style="dim"),) if cadence else ()
        table.add_row(
            plain(row.holder, style=ERROR_STYLE),
            _size(row.bytes, view.binary),
            leak_growth(row, lambda size: _size(size, view.binary)),
            f"step {row.first_step}",
            *grows,
            Text(leak_holding(row), style="dim"),
        )
    return table


def sync_rows(table: DataTable[Text], rows: Iterable[Row]) -> None:
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


def _rebuild(table: DataTable[Text], wanted: list[Row], current: list[str | None]) -> None:
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


class PanelTable(DataTable[Text], Generic[ViewT]):
    """A passive table over one slice: its rows, each keyed by a real identity, kept in sync
    by key. The row cursor shows only while it has focus (unfocused, no false selection)."""

    COLUMNS: tuple[str, ...] = ()

    view: reactive[ViewT | None] = reactive(None)

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.show_cursor = False
        self.add_columns(*self.COLUMNS)

    def on_focus(self) -> None:
        self.show_cursor = True

    def on_blur(self) -> None:
        self.show_cursor = False

    def watch_view(self, view: ViewT | None) -> None:
        if view is not None:
            sync_rows(self, self.rows_of(view))

    def rows_of(self, view: ViewT) -> Iterable[Row]:
        """The slice as table rows."""
        raise NotImplementedError


class DtypeTable(PanelTable[DtypesView]):
    """Pile x dtype -> bytes and number of unique storages."""

    COLUMNS = ("pile", "dtype", "bytes", "storages")

    def rows_of(self, view: DtypesView) -> Iterable[Row]:
        for row in view.rows:
            yield (
                row.key,
                (
                    Text("■ ", style=PILE_COLOURS[row.pile]) + Text(PART_LABELS[row.pile]),
                    plain(row.dtype),
                    Text(_size(row.bytes, view.binary, NOT_KNOWN), justify="right"),
                    Text(str(row.storages) if row.storages is not None else "", justify="right"),
                ),
            )


class TopActivations(PanelTable[ActivationsView]):
    """Modules by saved-activation bytes live at once during the cursor step, keyed by module
    id: two modules of one name (two root models of one class) are two rows."""

    COLUMNS = ("module", "saved")

    def rows_of(self, view: ActivationsView) -> Iterable[Row]:
        if not view.known:
            yield "not-known", (Text(f"{NOT_KNOWN} at this step", style="bold"), Text(""))
        for row in view.rows:
            yield row.key, (plain(row.label), Text(_size(row.bytes, view.binary), justify="right"))


MIN_MESSAGE_WIDTH = 12
"""The alerts table never cuts a message to fewer columns than this (it scrolls instead)."""


class AlertsTable(PanelTable[AlertsView]):
    """Alerts worst first (errors, then warnings, each newest first): step, severity as a
    word, kind and as much of the message as the table's width holds, cut with an ellipsis.
    The rest of it, and `where` (module or parameter names, often a long list), are in the
    AlertDetail line under the table and, whole, in the dialog Enter opens (handled by the app,
    which also moves the step cursor to the alert's step).

    Unfocused, the cursor stays on the first row, so the detail under the table is the newest
    alert of the highest severity; once the user focuses the table the cursor is theirs and
    keeps its alert as others arrive."""

    COLUMNS = ("step", "level", "kind", "message")

    def rows_of(self, view: AlertsView) -> Iterable[Row]:
        steps = max((len(str(alert.step)) for alert in view.rows), default=0)
        kinds = max((len(str(alert.kind)) for alert in view.rows), default=0)
        levels = max(len(word) for word in SEVERITY_WORDS.values())
        room = self.message_width(max(steps, len("step")), max(kinds, len("kind")) + levels + 2)
        for alert in view.rows:
            message = plain(alert.message)
            message.truncate(room, overflow="ellipsis")
            severity = alert.severity
            yield (
                alert.key,
                (
                    Text(str(alert.step), justify="right"),
                    Text(SEVERITY_WORDS[severity], style=SEVERITY_STYLES[severity]),
                    plain(alert.kind, style=alert_style(alert.kind)),
                    message,
                ),
            )

    def watch_view(self, view: AlertsView | None) -> None:
        super().watch_view(view)
        if view is not None and not self.has_focus and self.row_count and self.cursor_row != 0:
            self.move_cursor(row=0, scroll=False)
            self.scroll_to(y=0, animate=False)

    def message_width(self, step_width: int, kind_width: int) -> int:
        """Columns left for the message beside the step and the kind (with the level): each
        cell is padded by one column on either side, and the vertical scrollbar takes its
        own."""
        width = self.scrollable_content_region.width or self.size.width
        padding = 2 * self.cell_padding
        return max(MIN_MESSAGE_WIDTH, width - step_width - kind_width - 4 * padding)

    def on_resize(self) -> None:
        """The message column follows the table's width: cut the messages again."""
        if self.view is not None:
            sync_rows(self, self.rows_of(self.view))

    def step_of_row(self, row_key: str) -> int | None:
        """The step of the alert shown in a row, from the view state (never from a cell's text)."""
        return self.view.step_of(row_key) if self.view is not None else None

    def alert_at_cursor(self) -> AlertRow | None:
        """The alert the row cursor is on: the newest until the user moves it (the cursor stays
        on its alert as newer ones arrive above it)."""
        if self.view is None or not 0 <= self.cursor_row < self.row_count:
            return None
        key = self.ordered_rows[self.cursor_row].key.value
        return next((row for row in self.view.rows if row.key == key), None)


def alert_text(alert: AlertRow) -> Text:
    """One alert whole, on one line that wraps: step, kind, `where` (unless the message
    already starts with it, as a leak's does with its holder), message."""
    severity = alert.severity
    line = Text(f"{SEVERITY_WORDS[severity]} ", style=SEVERITY_STYLES[severity])
    line.append(f"step {alert.step} ", style="bold")
    line.append_text(plain(alert.kind, style=alert_style(alert.kind)))
    if alert.where and not alert.message.startswith(alert.where):
        line.append_text(plain(f" [{alert.where}]", style="cyan"))
    line.append_text(plain(f": {alert.message}"))
    return line


CUT_HINT = "… a (or Enter in the table): all of it"
"""The AlertDetail's last line when the alert is longer than the room under the table."""


class AlertDetail(FlowPanel[AlertRow]):
    """The alert under the alerts table's cursor, whole: the table cuts a long message (a
    leak's figures and fix, the numbers of an `activations_vary`, a list of parameters); here
    it wraps. Longer than its room, it ends with a line that says how to read the rest."""

    def free_lines(self, view: AlertRow | None) -> list[Text]:
        return [alert_text(view)] if view is not None else []

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        """All the lines the alert wraps to (CSS `max-height` caps it): measured from the
        whole alert, never from what `render` cut to fit the last height."""
        if not self.lines:
            return 0
        return len(self.lines[0].wrap(self.app.console, max(width, 10)))

    def render(self) -> Text:
        if not self.lines:
            return Text("")
        width, room = max(self.size.width, 10), self.size.height
        wrapped = self.lines[0].wrap(self.app.console, width)
        if room < 2 or len(wrapped) <= room:
            return self.lines[0]
        shown = Text("\n").join(list(wrapped)[: room - 1])
        shown.append("\n")
        shown.append(CUT_HINT, style="dim")
        return shown


class NotesLine(FlowPanel[NotesView]):
    """Warnings about the view itself: damaged recording tails, agent parts that turned off."""

    DEFAULT_CSS = "NotesLine { height: auto; color: $warning; padding: 0 1; }"

    def free_lines(self, view: NotesView | None) -> list[Text]:
        return [plain(" · ".join(view.notes))] if view is not None and view.notes else []

    def render(self) -> Text:
        return self.lines[0] if self.lines else Text("")
