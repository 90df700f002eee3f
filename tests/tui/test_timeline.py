"""The piles-over-steps chart: exact cells from pure functions, then one pilot run in an app."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from rich.console import Console
from rich.style import Style
from rich.text import Text
from textual.app import App, ComposeResult

from memtui.model.session import Session
from memtui.model.view_state import TimelineView
from memtui.tui.palette import CARRIED_ACTIVATIONS, PILE_COLOURS
from memtui.tui.timeline import (
    ALERT_COLOUR,
    AXIS_WIDTH,
    BLOCKS,
    CURSOR_BG,
    PileTimeline,
    column_cells,
    nice_scale,
    render_lines,
)
from memtui_protocol import schema
from memtui_protocol.schema import Pile, Piles
from memtui_protocol.units import format_bytes

W = PILE_COLOURS[Pile.WEIGHTS]
G = PILE_COLOURS[Pile.GRADIENTS]
OPT = PILE_COLOURS[Pile.OPTIMIZER_STATE]
GIB = 2**30


def styled(line: Text) -> list[tuple[str, Style]]:
    """Each character of a line with the style it is drawn in."""
    console = Console(width=400, color_system="truecolor")
    out: list[tuple[str, Style]] = []
    for segment in line.render(console):
        style = segment.style or Style()
        out.extend((char, style) for char in segment.text)
    return out


def bg(style: Style) -> str | None:
    return style.bgcolor.name if style.bgcolor else None


def fg(style: Style) -> str | None:
    return style.color.name if style.color else None


def small_data(**changes: Any) -> TimelineView:
    """Three steps: a full column, a half column, an empty one; cursor on the last."""
    data = TimelineView(
        steps=(1, 2, 3),
        piles=(Piles(GIB), Piles(GIB // 2), Piles()),
        alerts=frozenset({2}),
        cursor_step=3,
        binary=True,
    )
    return dataclasses.replace(data, **changes)


# ----- column_cells ------------------------------------------------------------------------


def test_boundary_inside_a_cell_draws_lower_pile_over_upper_background() -> None:
    assert column_cells(Piles(4, 4, 0, 0), 8, 1) == [("▄", W, G)]


def test_single_pile_full_and_half() -> None:
    assert column_cells(Piles(8, 0, 0, 0), 8, 1) == [("█", W, None)]
    assert column_cells(Piles(4, 0, 0, 0), 8, 1) == [("▄", W, None)]


def test_rows_are_top_to_bottom() -> None:
    assert column_cells(Piles(12, 4, 0, 0), 16, 2) == [("▄", W, G), ("█", W, None)]
    assert column_cells(Piles(0, 0, 3, 0), 8, 2) == [(" ", None, None), ("▆", OPT, None)]


def test_a_third_pile_in_one_cell_is_skipped_deterministically() -> None:
    assert column_cells(Piles(2, 2, 2, 2), 8, 1) == [("▂", W, G)]


def test_empty_and_zero_scale() -> None:
    assert column_cells(Piles(0, 0, 0, 0), 8, 2) == [(" ", None, None)] * 2
    assert column_cells(Piles(5, 5, 5, 5), 0, 1) == [(" ", None, None)]


def test_values_above_scale_are_clipped() -> None:
    assert column_cells(Piles(100, 0, 0, 0), 8, 2) == [("█", W, None)] * 2


def test_nice_scale_rounds_up_in_the_display_unit() -> None:
    assert nice_scale(GIB) == GIB
    assert nice_scale(14.9 * GIB) == 15 * GIB
    assert nice_scale(1010 * 2**20) == GIB
    assert nice_scale(1.4e9, binary=False) == 1.5e9
    assert nice_scale(0) == 1


# ----- render_lines ------------------------------------------------------------------------


def test_exact_plain_text_of_a_small_chart() -> None:
    lines = render_lines(small_data(), 20, 4, max_repeat=1)
    assert [line.plain for line in lines] == [
        "   1.00 GiB┤█  ",
        "          0┤██ ",
        "           └ ▲ ",
        "       step 1 3",
    ]


def test_axis_label_is_format_bytes_of_the_scale() -> None:
    data = small_data(piles=(Piles(1_400_000_000),) * 3, binary=False)
    top = render_lines(data, 30, 6)[0].plain
    assert top.startswith(format_bytes(1.5e9, False).rjust(AXIS_WIDTH - 1) + "┤")


def test_alert_marker_is_red_and_under_its_step() -> None:
    markers = styled(render_lines(small_data(), 20, 4, max_repeat=1)[2])
    char, style = markers[AXIS_WIDTH + 1]
    assert char == "▲"
    assert fg(style) == ALERT_COLOUR
    assert [c for c, _ in markers].count("▲") == 1


def test_cursor_column_empty_cells_are_highlighted() -> None:
    lines = render_lines(small_data(), 20, 4, max_repeat=1)
    top = styled(lines[0])
    assert bg(top[AXIS_WIDTH + 2][1]) == CURSOR_BG
    assert bg(top[AXIS_WIDTH + 1][1]) is None  # not the cursor column
    assert bg(styled(lines[2])[AXIS_WIDTH + 2][1]) == CURSOR_BG
    # Full blocks keep their own colour; the marker row still shows where the cursor is.
    moved = render_lines(small_data(cursor_step=1), 20, 4)
    assert fg(styled(moved[0])[AXIS_WIDTH][1]) == W
    assert bg(styled(moved[2])[AXIS_WIDTH][1]) == CURSOR_BG


def test_stacked_cell_colours_in_a_rendered_line() -> None:
    data = small_data(piles=(Piles(GIB // 2, GIB // 2),) * 3)
    bottom = styled(render_lines(data, 20, 3)[0])
    char, style = bottom[AXIS_WIDTH]
    assert (char, fg(style), bg(style)) == ("▄", W, G)


def test_only_the_last_steps_that_fit_and_the_cursor_label() -> None:
    steps = tuple(range(1, 101))
    data = TimelineView(steps, (Piles(GIB),) * 100, frozenset(), 100, True)
    lines = render_lines(data, 40, 5)
    assert len(lines[0].plain) == 40
    labels = lines[-1].plain[AXIS_WIDTH:]
    assert labels.startswith("73") and labels.endswith("100")
    earlier = render_lines(dataclasses.replace(data, cursor_step=50), 40, 5)[-1].plain
    assert earlier[AXIS_WIDTH:].startswith("23") and earlier.endswith("50")
    middle = render_lines(dataclasses.replace(data, cursor_step=86), 40, 5)[-1].plain
    assert middle.endswith("100") and "86" in middle[AXIS_WIDTH + 3 : -4]


def test_tiny_sizes_and_empty_data_give_one_line() -> None:
    assert [line.plain for line in render_lines(small_data(), 14, 10)] == ["timeline: too sm"[:14]]
    assert len(render_lines(small_data(), 40, 2)) == 1
    assert [line.plain for line in render_lines(None, 40, 10)] == ["no steps yet"]
    empty = small_data(steps=(), piles=(), cursor_step=None)
    assert [line.plain for line in render_lines(empty, 40, 10)] == ["no steps yet"]


def test_the_timeline_slice_is_the_window_around_the_cursor(
    demo_messages: list[schema.Message],
) -> None:
    """The Session cuts the window; the slice carries each step's peak as the wire's `Piles`,
    the steps with alerts and the carried ones, so the chart needs nothing else."""
    session = Session(live=False)
    session.ingest(demo_messages)
    session.jump_to_step(20)
    view = session.view_state(timeline_width=10).timeline
    assert view.steps == tuple(range(11, 21))
    assert view.piles == tuple(step.peak for step in session.steps[10:20])
    assert view.cursor_step == 20 and view.binary
    assert view.alerts == frozenset({9, 17})  # step 1's note is marked only while listed (o)
    assert view.carried == frozenset()
    assert view.allocated == (None,) * 10  # CPU: no allocator levels


def test_carried_activations_are_drawn_lighter() -> None:
    activations_only = Piles(0, 0, 0, 100)
    assert column_cells(activations_only, 100, 2, carried=True)[0][1] == CARRIED_ACTIVATIONS
    assert column_cells(activations_only, 100, 2)[0][1] == PILE_COLOURS[Pile.ACTIVATIONS]
    assert column_cells(Piles(100), 100, 2, carried=True)[0][1] == W


# ----- pilot ---------------------------------------------------------------------------------


class TimelineApp(App[None]):
    def compose(self) -> ComposeResult:
        yield PileTimeline()


def test_widget_renders_in_an_app() -> None:
    async def scenario() -> str:
        app = TimelineApp()
        async with app.run_test(size=(60, 12)) as pilot:
            widget = app.query_one(PileTimeline)
            await pilot.pause()
            assert "no steps yet" in widget.render_line(0).text
            widget.view = small_data()
            await pilot.pause()
            assert widget.size.width == 60 and widget.size.height == 12
            return "\n".join(widget.render_line(y).text for y in range(widget.size.height))

    text = asyncio.run(scenario())
    assert "▲" in text
    assert "1.00 GiB┤" in text
    assert "step 1" in text


def test_few_steps_get_wider_columns_with_one_marker_each() -> None:
    """Three steps in a 24-wide chart: four columns per step, one alert marker per step."""
    lines = render_lines(small_data(), AXIS_WIDTH + 12, 4)
    plot = lines[0].plain[AXIS_WIDTH:]
    assert len(plot) == 12
    assert plot[:4] == plot[0] * 4  # the first step's column repeated
    assert lines[2].plain.count("▲") == 1
    labels = lines[3].plain
    assert labels.rstrip().endswith("3")


def test_gpu_steps_show_allocated_and_reserved_levels_above_the_piles() -> None:
    """On a GPU, torch's allocated and reserved lines sit above the stack: the gap is visible."""
    from memtui.tui.timeline import LEVEL_ALLOCATED, LEVEL_RESERVED

    gib = 2**30
    data = TimelineView(
        steps=(1, 2),
        piles=(Piles(gib), Piles(gib)),
        alerts=frozenset(),
        cursor_step=None,
        binary=True,
        allocated=(2 * gib, 2 * gib),
        reserved=(4 * gib, 4 * gib),
    )
    lines = render_lines(data, AXIS_WIDTH + 4, 6, max_repeat=1)  # 4 plot rows of 1 GiB each
    plot = [line.plain[AXIS_WIDTH : AXIS_WIDTH + 2] for line in lines[:4]]
    assert plot[0] == LEVEL_RESERVED * 2  # the 4 GiB line, at the top
    assert plot[1] == LEVEL_ALLOCATED * 2  # the 2 GiB line
    assert plot[2] == BLOCKS[0] * 2  # between the piles and the allocated line: "other"
    assert plot[3] == BLOCKS[8] * 2  # the piles (1 GiB) fill the bottom row
    cpu = TimelineView(data.steps, data.piles, frozenset(), None, True)
    assert all(LEVEL_ALLOCATED not in line.plain for line in render_lines(cpu, AXIS_WIDTH + 4, 6))
