"""The screen, driven by keys through Textual's pilot: leaks in "Where the bytes are" as of the
cursor step, the leak alert on the alerts panel, and a step whose activations are not known.

The recording is `make_fixture.leaking_messages` (censuses at steps 8, 12 and 20, the End's
final count) with step 10 made "not known".
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import msgspec
from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.pilot import Pilot

from memtui.reports.report import build_report
from memtui.tui.app import MemtuiApp
from memtui.tui.palette import ERROR_STYLE, alert_style
from memtui.tui.widgets import (
    AlertDetail,
    AlertsTable,
    DtypeTable,
    GapPanel,
    PilesPanel,
    TopActivations,
)
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind

NOT_KNOWN_STEP = 10


def _messages(builder: ModuleType) -> list[schema.Message]:
    return [
        msgspec.structs.replace(m, activations_measured=False, activations_from=None)
        if isinstance(m, schema.Step) and m.step == NOT_KNOWN_STEP
        else m
        for m in builder.leaking_messages()
    ]


def _cursor(app: MemtuiApp, step: int) -> None:
    app.session.jump_to_step(step)
    app.refresh_view()


def _lines(tui: Any, widget: Any) -> list[str]:
    return [" ".join(line.split()) for line in tui.plain(widget).splitlines()]


def test_the_gap_panel_lists_the_leaks_as_of_the_cursor_step(tui: Any, builder: ModuleType) -> None:
    """On the last step: the job's final count, the very figures of `report --json`; back at
    step 12, its census; before it, no leak rows. The panel grows and shrinks with them."""
    app = MemtuiApp(tui.source(_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        gap = app.query_one(GapPanel)
        lines = _lines(tui, gap)
        start = lines.index("Leaks at the job's end: memory no pile holds, by holder")
        assert lines[start + 1 : start + 4] == [
            "holder held per step since holds",
            f"{builder.GRAPH_HOLDER} 288.00 KiB +32.00 KiB step 5 1 tensor + graph",
            "history 88.00 KiB +4.00 KiB step 3 22 tensors",
        ]
        assert app.session.recording is not None
        report = build_report(app.session.recording)["leaks"]
        assert gap.view is not None
        assert [
            (row.holder, row.bytes, row.per_step, row.first_step) for row in gap.view.leaks
        ] == [
            (leak["holder"], leak["bytes"], leak["per_step"], leak["first_step"]) for leak in report
        ]
        with_leaks = gap.size.height

        _cursor(app, 12)
        await pilot.pause()
        lines = _lines(tui, gap)
        start = lines.index(
            "Leaks as the census at step 12 counted them: memory no pile holds, by holder"
        )
        assert lines[start + 2 : start + 4] == [
            f"{builder.GRAPH_HOLDER} 256.00 KiB +32.00 KiB step 5 1 tensor + graph",
            "history 40.00 KiB +4.00 KiB step 3 10 tensors",
        ]

        _cursor(app, 20)
        await pilot.pause()
        assert (
            "Leaks, each holder's latest census up to this step: memory no pile holds, by holder"
            in _lines(tui, gap)
        )

        _cursor(app, 11)
        await pilot.pause()
        assert not any("Leaks" in line or "history" in line for line in _lines(tui, gap))
        assert gap.size.height == with_leaks - 4  # the heading, the columns and two holders

    tui.drive(app, body)


def test_the_leak_alert_reads_at_both_sizes(tui: Any, builder: ModuleType) -> None:
    """At 160x48 and 80x24 the leak alerts' step, kind and holder are in the table, and the one
    under the cursor is under it whole: its figures and its fix."""
    app = MemtuiApp(tui.source(_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        for size in ((160, 48), (80, 24)):
            await pilot.resize_terminal(*size)
            await pilot.pause()
            table = app.query_one(AlertsTable)
            widths = [column.get_render_width(table) for column in table.columns.values()]
            assert sum(widths) <= table.size.width, (size, widths, table.size.width)
            rows = [
                [str(cell).strip() for cell in table.get_row_at(i)]
                for i in range(min(5, table.row_count))
            ]
            # A leak's message starts with its holder: step, kind and holder are in the table,
            # led by its severity (a leak is an error).
            at = next(
                i
                for i, row in enumerate(rows)
                if row[:3] == ["12", "error", "leak"]
                and row[3].startswith(builder.GRAPH_HOLDER + " ")
            )
            assert rows[at + 1][:3] == ["12", "error", "leak"]
            assert rows[at + 1][3].startswith("history ")
            table.move_cursor(row=at)
            await pilot.pause()
            detail = app.query_one(AlertDetail)
            text = " ".join(tui.plain(detail).split())
            assert text == (
                f"error step 12 leak: {builder.GRAPH_HOLDER} keeps 256.00 KiB alive in 1 tensor "
                f"and grows 32.00 KiB per step since step 5: {builder.GRAPH_FIX}"
            )
            assert detail.size.height == len(tui.plain(detail).splitlines())  # none cut off
        table.focus()
        await pilot.press("down")
        await pilot.pause()
        assert "history keeps 40.00 KiB alive in 10 tensors" in " ".join(
            tui.plain(app.query_one(AlertDetail)).split()
        )

    tui.drive(app, body)


def test_a_step_whose_activations_are_not_known_shows_no_figure_for_them(
    tui: Any, builder: ModuleType
) -> None:
    """The piles panel, the gap panel, the dtypes and the top modules say "not known"; the step
    before shows its figures again."""
    app = MemtuiApp(tui.source(_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        _cursor(app, NOT_KNOWN_STEP)
        await pilot.pause()
        piles = _lines(tui, app.query_one(PilesPanel))
        assert "■ activations not known" in piles
        assert "peak (+DDP/FSDP) not known" in piles
        assert any(
            line.startswith("activations not known: this step was not measured") for line in piles
        )
        gap = _lines(tui, app.query_one(GapPanel))
        assert "tracked at step end not known this step's activations are not known" in gap
        dtypes = app.query_one(DtypeTable)
        cells = [[str(cell) for cell in dtypes.get_row_at(i)] for i in range(dtypes.row_count)]
        assert ["■ activations", "", "not known", ""] in cells
        top = app.query_one(TopActivations)
        assert top.row_count == 1 and str(top.get_row_at(0)[0]) == "not known at this step"

        _cursor(app, NOT_KNOWN_STEP - 1)
        await pilot.pause()
        assert not any("not known" in line for line in _lines(tui, app.query_one(PilesPanel)))
        assert top.row_count == 5

    tui.drive(app, body)


def test_a_step_not_known_as_this_agent_writes_it_shows_what_it_knows(
    tui: Any, builder: ModuleType
) -> None:
    """This version's frame of a step not known: null activations, and null gradients in `max`
    and `peak` (counted at the close only). The piles panel says "not known" for both at the
    peak, with no high for them; the steady weights keep their figures; the dtype panel lists
    the gradients the close counted (the frame's `end`)."""
    messages = []
    for message in _messages(builder):
        if isinstance(message, schema.Step) and message.step == NOT_KNOWN_STEP:
            end = message.end
            message = msgspec.structs.replace(
                message,
                end=schema.Piles(end.weights, end.gradients, end.optimizer_state, None),
                max=schema.Piles(end.weights, None, end.optimizer_state, None),
                peak=schema.Piles(end.weights, None, end.optimizer_state, None),
            )
        messages.append(message)
    app = MemtuiApp(tui.source(messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        _cursor(app, NOT_KNOWN_STEP)
        await pilot.pause()
        piles = _lines(tui, app.query_one(PilesPanel))
        assert "■ activations not known" in piles and "■ gradients not known" in piles
        assert "peak (+DDP/FSDP) not known" in piles
        assert not any(line.startswith("■ gradients") and "B" in line for line in piles)
        assert any(line.startswith("■ weights") and "%" in line for line in piles), piles
        dtypes = app.query_one(DtypeTable)
        cells = [[str(cell) for cell in dtypes.get_row_at(i)] for i in range(dtypes.row_count)]
        gradients = [row for row in cells if row[0] == "■ gradients"]
        assert gradients and all(row[2] != "not known" for row in gradients)

    tui.drive(app, body)


def test_leaks_are_errors_largest_and_oldest_first_with_their_cadence(
    tui: Any, builder: ModuleType
) -> None:
    """The End names three holders: two of the same size, the one that began growing first
    above; one grows by steps (`every` 5). On the last step the gap panel's leak rows are in
    that order, drawn as errors (red, as an out-of-memory), with the cadence; the leak alerts'
    kind is drawn the same way."""
    messages = _messages(builder)
    end = messages[-1]
    assert isinstance(end, schema.End)
    size = 64 * 1024
    leaks = [
        schema.Leak("late", "tensors", size, 4, 512, first_step=9, every=5),
        schema.Leak("early", "tensors", size, 4, 512, first_step=2, every=1),
        schema.Leak("biggest", "tensors", 4 * size, 4, 512, first_step=12),
    ]
    messages[-1] = msgspec.structs.replace(end, leaks=leaks)
    for index, message in enumerate(messages):  # a holder the End counts was named by a census
        if isinstance(message, schema.Step) and message.step == 12:
            messages[index] = msgspec.structs.replace(message, leaks=[*message.leaks, *leaks])
    app = MemtuiApp(tui.source(messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.pause()
        gap = app.query_one(GapPanel)
        assert gap.view is not None
        ours = ("biggest", "early", "late")
        holders = [row.holder for row in gap.view.leaks if row.holder in ours]
        assert holders == list(ours), holders
        lines = [line for line in _lines(tui, gap) if line.split(" ")[0] in ours]
        assert lines == [
            "biggest 256.00 KiB +512 B step 12 4 tensors",
            "early 64.00 KiB +512 B step 2 at every step 4 tensors",
            "late 64.00 KiB +512 B step 9 every 5 steps 4 tensors",
        ]
        table = gap.render()
        assert isinstance(table, Group)
        heading, rows = table.renderables[-2], table.renderables[-1]
        assert isinstance(heading, Text) and heading.style == ERROR_STYLE
        assert isinstance(rows, Table)
        holder_cells = list(rows.columns[0].cells)[1:]
        assert all(isinstance(cell, Text) and cell.style == ERROR_STYLE for cell in holder_cells)
        assert alert_style(AlertKind.LEAK) == ERROR_STYLE == alert_style(AlertKind.OOM)

    tui.drive(app, body)
