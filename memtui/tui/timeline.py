"""The piles over steps: a stacked column chart, one terminal column per step.

Everything that decides a cell (which character, which colours) is a pure function of the data
and the size, so tests can assert exact output without an app; the widget only feeds `self.size`
and its one reactive (the view state's `TimelineView`) into `render_lines()`.
"""

from __future__ import annotations

import math
from bisect import bisect_right

from rich.style import Style
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from memtui.model.step_rows import pile_values
from memtui.model.view_state import TimelineView
from memtui.tui.palette import CARRIED_ACTIVATIONS, PILE_COLOURS
from memtui_protocol import schema
from memtui_protocol.schema import Pile
from memtui_protocol.units import BINARY, DECIMAL, format_bytes

BLOCKS = " ▁▂▃▄▅▆▇█"
AXIS_WIDTH = 12
"""Fits the longest `format_bytes` label ("1023.99 MiB") plus the axis line."""
CURSOR_BG = "#3a3f4b"
ALERT_COLOUR = "#f85149"
LEVEL_ALLOCATED = "─"
LEVEL_RESERVED = "┄"
LEVEL_COLOUR = "#e6edf3"
MIN_WIDTH = 15
MAX_REPEAT = 8
MIN_HEIGHT = 3
UNKNOWN_MARK = "?"
"""Drawn above a step whose activations are not known, where they would stack."""
_NICE = (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10)

Cell = tuple[str, str | None, str | None]
"""(character, foreground colour, background colour); `None` means the widget's own."""


def nice_scale(value: float, binary: bool = True) -> float:
    """Round `value` up to 1, 1.2, 1.5, 2, ... x 10^k of its display unit.

    The top label is then a round number ("15.00 GiB") instead of whatever the peak happened to
    be, and a new step a little higher than the last does not rescale the whole chart.
    """
    if value <= 0:
        return 1.0
    units = [factor for _, factor in reversed(BINARY if binary else DECIMAL)]
    factor = next((f for f in reversed(units) if value >= f), 1)
    mantissa = value / factor
    power = 10 ** math.floor(math.log10(mantissa))
    nice = next(n * power for n in _NICE if n * power >= mantissa) * factor
    bigger = [f for f in units if f > factor]
    # 1010 MiB rounds to 1 GiB rather than "1200 MiB", which would print as "1.17 GiB".
    if bigger and nice > bigger[0] >= value:
        return float(bigger[0])
    return float(nice)


def column_cells(
    piles: schema.Piles, scale: float, height: int, carried: bool = False, unknown: bool = False
) -> list[Cell]:
    """The cells of one column, top to bottom, as (character, fg colour, bg colour).

    The piles stack bottom-up in `Pile` order, each drawn in its own colour. Pile boundaries
    are rounded to eighths of a row. A cell that holds one pile is a full block; a cell that
    holds a boundary draws the lower pile as a partial block over the upper pile's colour as
    background, so each pile stays visible at 1/8 resolution. A third pile inside the same cell
    cannot be drawn and is skipped. Empty space has no colours (widget background).
    `carried`: the step's activations were carried, not measured: drawn in a lighter green.
    `unknown`: the step's activations are not known: `piles` holds none, and a `?` in their
    colour sits on top of the other piles instead of a partial figure.
    """
    eighths = height * 8
    stack = pile_values(piles)
    boundaries: list[int] = []
    running = 0
    for _, value in stack:
        running += max(0, value or 0)  # a pile not known is not drawn: the `?` says so
        share = running * eighths / scale if scale > 0 else 0.0
        boundaries.append(min(eighths, int(share + 0.5)))

    def owner(unit: int) -> Pile | None:
        index = bisect_right(boundaries, unit)
        return stack[index][0] if index < len(stack) else None

    def colour(pile: Pile | None) -> str | None:
        if pile is None:
            return None
        return CARRIED_ACTIVATIONS if carried and pile is Pile.ACTIVATIONS else PILE_COLOURS[pile]

    cells: list[Cell] = []
    for row in range(height - 1, -1, -1):
        owners = [owner(row * 8 + unit) for unit in range(8)]
        lower = owners[0]
        filled = next((n for n in range(8) if owners[n] != lower), 8)
        if lower is None:
            cells.append((" ", None, None))
        elif filled == 8:
            cells.append((BLOCKS[8], colour(lower), None))
        else:
            cells.append((BLOCKS[filled], colour(lower), colour(owners[filled])))
    if unknown:
        top = next((row for row, cell in enumerate(cells) if cell[0] != " "), height)
        mark = max(0, top - 1)
        cells[mark] = (
            UNKNOWN_MARK,
            PILE_COLOURS[Pile.ACTIVATIONS],
            cells[mark][2] if top == 0 else None,
        )
    return cells


def _window(data: TimelineView, columns: int) -> range:
    """The last `columns` steps, moved back only if that would hide the cursor."""
    count = len(data.steps)
    cursor = _cursor_index(data)
    end = count
    if cursor is not None and cursor < count - columns:
        # The Session's window can be wider than the plot; never cut the cursor off the left.
        end = cursor + 1
    return range(max(0, end - columns), end)


def _cursor_index(data: TimelineView) -> int | None:
    if data.cursor_step is None:
        return None
    hits = [i for i, step in enumerate(data.steps) if step == data.cursor_step]
    return hits[-1] if hits else None


def _step_labels(
    steps: list[int], cursor: int | None, columns: int, alerts: tuple[int, ...] = ()
) -> str:
    """First step at the left, last at the right, the cursor's under it, then the step under
    each column in `alerts` (where a run of alert markers starts), each where nothing overlaps:
    a narrow chart still says which step its first ▲ is."""
    row = [" "] * columns
    taken: list[tuple[int, int]] = []

    def place(text: str, start: int) -> None:
        start = max(0, min(start, columns - len(text)))
        end = start + len(text)
        if end > columns or any(start <= b and a <= end for a, b in taken):
            return
        row[start:end] = text
        taken.append((start, end))

    place(str(steps[0]), 0)
    place(str(steps[-1]), len(steps) - len(str(steps[-1])))
    if cursor is not None and steps[cursor] not in (steps[0], steps[-1]):
        place(str(steps[cursor]), cursor - len(str(steps[cursor])) // 2)
    shown = {steps[0], steps[-1], *([steps[cursor]] if cursor is not None else [])}
    for column in alerts:
        if steps[column] not in shown:
            place(str(steps[column]), column - len(str(steps[column])) // 2)
    return "".join(row)


def _levels(data: TimelineView, index: int) -> tuple[int, ...]:
    """(allocated, reserved) of one step where the allocator reported them, else ()."""
    if index >= len(data.allocated) or index >= len(data.reserved):
        return ()
    allocated, reserved = data.allocated[index], data.reserved[index]
    return (allocated, reserved) if allocated is not None and reserved is not None else ()


def _with_levels(
    cells: list[Cell], levels: tuple[int, ...], scale: float, height: int
) -> list[Cell]:
    """Mark torch's allocated ("─") and reserved ("┄") levels in the empty cells above the
    stack: the gap between the piles and those lines is memory the piles do not explain."""
    if not levels or scale <= 0:
        return cells
    marked = list(cells)
    for level, char in zip(levels, (LEVEL_ALLOCATED, LEVEL_RESERVED), strict=True):
        # A negative counter (a damaged or hostile recording) sits on the bottom row.
        row = height - 1 - max(0, min(height - 1, int(level / scale * height)))
        if marked[row][0] == BLOCKS[0] and marked[row][2] is None:
            marked[row] = (char, LEVEL_COLOUR, None)
    return marked


def render_lines(
    data: TimelineView | None, width: int, height: int, max_repeat: int = MAX_REPEAT
) -> list[Text]:
    """The whole chart as `height` lines: plot rows, an alert-marker row, a step-label row.

    Tiny sizes and empty data give one line of explanation instead of a broken chart. When few
    steps are shown, each gets up to `max_repeat` columns.
    """
    if width < MIN_WIDTH or height < MIN_HEIGHT:
        return [Text("timeline: too small"[: max(width, 0)], style="dim")]
    if data is None or not data.steps:
        return [Text("no steps yet", style="dim")]
    window = _window(data, width - AXIS_WIDTH)
    steps = [data.steps[i] for i in window]
    piles = [data.piles[i] for i in window]
    cursor_index = _cursor_index(data)
    cursor = (
        cursor_index - window.start if cursor_index is not None and cursor_index in window else None
    )
    plot_height = height - 2
    levels = [_levels(data, i) for i in window]
    drawn = max(sum(value or 0 for _, value in pile_values(p)) for p in piles)  # the known piles
    top = max(drawn, max((max(lv) for lv in levels if lv), default=0))
    scale = nice_scale(top, data.binary)
    # Few steps get wider columns (up to MAX_REPEAT cells each) so a short run is readable.
    repeat = max(1, min(max_repeat, (width - AXIS_WIDTH) // len(piles)))
    columns = [
        _with_levels(
            column_cells(p, scale, plot_height, step in data.carried, step in data.unknown),
            lv,
            scale,
            plot_height,
        )
        for p, lv, step in zip(piles, levels, steps, strict=True)
        for _ in range(repeat)
    ]
    steps = [step for step in steps for _ in range(repeat)]
    first_of_step = [x % repeat == 0 for x in range(len(steps))]
    cursor_columns = (
        range(cursor * repeat, cursor * repeat + repeat) if cursor is not None else range(0)
    )

    axis = Style(dim=True)
    lines: list[Text] = []
    for row in range(plot_height):
        if row == 0:
            label = format_bytes(scale, data.binary).rjust(AXIS_WIDTH - 1) + "┤"
        elif row == plot_height - 1:
            label = "0".rjust(AXIS_WIDTH - 1) + "┤"
        else:
            label = " " * (AXIS_WIDTH - 1) + "│"
        line = Text(no_wrap=True, end="")
        line.append(label[-AXIS_WIDTH:], axis)
        for x, cells in enumerate(columns):
            char, fg, bg = cells[row]
            if x in cursor_columns and bg is None and char != BLOCKS[8]:
                bg = CURSOR_BG
            line.append(char, Style(color=fg, bgcolor=bg) if fg or bg else None)
        lines.append(line)

    markers = Text(no_wrap=True, end="")
    markers.append(" " * (AXIS_WIDTH - 1) + "└", axis)
    for x, step in enumerate(steps):
        alert = step in data.alerts and first_of_step[x]
        here = x in cursor_columns
        style = Style(color=ALERT_COLOUR if alert else None, bgcolor=CURSOR_BG if here else None)
        markers.append("▲" if alert else " ", style if alert or here else None)
    lines.append(markers)
    label_cursor = cursor_columns.start if cursor is not None else None
    runs = tuple(  # the first column of each run of steps with alerts
        x
        for x, step in enumerate(steps)
        if first_of_step[x] and step in data.alerts and (x == 0 or steps[x - 1] not in data.alerts)
    )
    labels = (
        "step".rjust(AXIS_WIDTH - 1) + " " + _step_labels(steps, label_cursor, len(steps), runs)
    )
    lines.append(Text(labels, style=axis, no_wrap=True, end=""))
    return lines


class PileTimeline(Widget):
    """The piles over steps: a passive view of one `TimelineView`, redrawn when it changes."""

    DEFAULT_CSS = """
    PileTimeline {
        height: 1fr;
        min-height: 6;
    }
    """

    view: reactive[TimelineView | None] = reactive(None)

    def render(self) -> Text:
        """Draw at exactly the widget's size, so resizing needs no state of its own."""
        lines = render_lines(self.view, self.size.width, self.size.height)
        return Text("\n", no_wrap=True, end="").join(lines)
