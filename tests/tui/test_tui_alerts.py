"""The alerts panel as a user reads it: step, kind and message in the table at 160x48 and
80x24, the alert under the cursor whole under it, the whole of it one key away, and the
table's own keys while it has focus.

The job: the fixture run whose step 20 turns the gradients non-finite, with the parameter names
in `where` (long, as a transformer's are), and steps 21-24 repeating its alerts (grouped).
"""

from __future__ import annotations

import io
from types import ModuleType
from typing import Any

import msgspec
from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Static

from memtui.tui.app import MemtuiApp
from memtui.tui.screens import AlertScreen
from memtui.tui.widgets import CUT_HINT, AlertDetail, AlertsTable
from memtui_protocol import schema

NAN_FROM = 20
NAMES = ", ".join(f"transformer.h.{i}.attn.c_attn.weight" for i in range(5)) + " and 43 more"
GRADIENTS = "48 parameter gradient(s) are NaN or Inf under a finite loss"
FORECAST = (
    "the first AdamW#1.step() will allocate 75.09 KiB (76,896 bytes) of optimizer state, "
    "more than the 64.00 KiB left under --budget"
)


def nan_messages(builder: ModuleType) -> list[schema.Message]:
    """The fixture run: a long forecast at step 1, non-finite gradients from step 20."""
    messages: list[schema.Message] = []
    for message in builder.demo_messages():
        if isinstance(message, schema.Step) and message.step == 1:
            forecast = schema.Alert(kind="first_step_forecast", message=FORECAST)
            message = msgspec.structs.replace(message, alerts=[forecast, *message.alerts])
        if isinstance(message, schema.Step) and message.step >= NAN_FROM:
            group = NAN_FROM if message.step > NAN_FROM else None
            suffix = f" (the weights were poisoned by step {NAN_FROM}'s update)" if group else ""
            alert = schema.Alert(
                kind="nonfinite_gradient", message=GRADIENTS + suffix, where=NAMES, group=group
            )
            message = msgspec.structs.replace(message, alerts=[alert])
        messages.append(message)
    return messages


def table_rows(table: AlertsTable) -> list[list[str]]:
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def test_the_table_shows_step_kind_and_message_at_both_sizes(tui: Any, builder: ModuleType) -> None:
    """No `where` column pushing the message off-screen (a row read "20  grouped" and nothing
    more), and as much of each message as the panel holds, cut with an ellipsis."""
    app = MemtuiApp(tui.source(nan_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("o")  # the notes too (the folded row, the forecast)
        # At 80 columns the severity word (a column of 5, padded) leaves 33 for the message.
        for size, least in (((160, 48), 60), ((80, 24), 32)):
            await pilot.resize_terminal(*size)
            await pilot.pause()
            table = app.query_one(AlertsTable)
            assert [str(column.label) for column in table.columns.values()] == [
                "step",
                "level",
                "kind",
                "message",
            ]
            widths = [column.get_render_width(table) for column in table.columns.values()]
            assert sum(widths) <= table.scrollable_content_region.width, (size, widths)
            rows = table_rows(table)
            assert rows[0][:3] == ["20", "error", "nonfinite_gradient"]
            grouped = next(row for row in rows if row[2] == "grouped")
            assert grouped[:2] == ["20", "error"]  # the errors it folds, listed after them
            assert grouped[3].startswith("4 more alerts on steps 21-24")
            forecast = next(row for row in rows if row[2] == "first_step_forecast")
            for row in rows:
                shown = row[3]
                whole = shown.removesuffix("…")
                assert len(whole) >= least or not shown.endswith("…"), (size, row)
            assert forecast[3].endswith("…") and FORECAST.startswith(forecast[3][:-1])

    tui.drive(app, body)


def test_the_detail_line_is_the_alert_whole_or_says_where_the_rest_is(
    tui: Any, builder: ModuleType
) -> None:
    """Under the table: step, kind, `where` and message, wrapped; at 80x24 the parameter list
    is longer than its room, and its last line says how to read all of it."""
    app = MemtuiApp(tui.source(nan_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.pause()  # the newest error, on top: the step 20 alert, with its names
        detail = app.query_one(AlertDetail)
        text = " ".join(tui.plain(detail).split())
        assert text == f"error step 20 nonfinite_gradient [{NAMES}]: {GRADIENTS}"

        await pilot.resize_terminal(60, 24)
        await pilot.pause()
        lines = tui.plain(detail).rstrip("\n").splitlines()
        assert len(lines) == detail.size.height  # nothing cut off silently
        assert lines[-1].strip() == CUT_HINT
        assert " ".join(" ".join(lines[:-1]).split()).startswith(
            "error step 20 nonfinite_gradient ["
        )

    tui.drive(app, body)


def test_left_and_right_leave_the_step_alone_while_the_table_has_focus(
    tui: Any, builder: ModuleType
) -> None:
    app = MemtuiApp(tui.source(nan_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("left")
        assert app.session.cursor == 22  # the body has focus: the step moves
        app.query_one(AlertsTable).focus()
        await pilot.pause()
        await pilot.press("left", "left", "right")
        assert app.session.cursor == 22
        await pilot.press("home")  # the step keys that are not the table's still work
        assert app.session.cursor == 0

    tui.drive(app, body)


def test_enter_jumps_to_the_alert_and_shows_all_of_it(tui: Any, builder: ModuleType) -> None:
    app = MemtuiApp(tui.source(nan_messages(builder), live=False))

    def dialog_text() -> str:
        screen = app.screen
        assert isinstance(screen, AlertScreen)
        content = screen.query_one("#alert-text", Static).content
        out = io.StringIO()
        Console(width=70, file=out, color_system=None).print(content)
        return " ".join(out.getvalue().split())

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("home", "o")  # o: the notes (the forecast) listed too
        table = app.query_one(AlertsTable)
        table.focus()
        await pilot.press("enter")  # the first row: the newest error
        await pilot.pause()
        assert app.session.steps[app.session.cursor or 0].step == NAN_FROM
        text = dialog_text()
        assert text.startswith(f"error at step {NAN_FROM}: nonfinite_gradient")
        assert GRADIENTS in text and f"where: {NAMES}" in text
        await pilot.press("escape")
        assert not isinstance(app.screen, AlertScreen)
        assert table.has_focus

        # `a` does the same from anywhere, for the alert under the table's cursor.
        forecast = [row[2] for row in table_rows(table)].index("first_step_forecast")
        table.move_cursor(row=forecast)  # the forecast, at step 1
        app.query_one("#body").focus()
        await pilot.press("end", "a")
        await pilot.pause()
        assert app.session.steps[app.session.cursor or 0].step == 1
        assert FORECAST in dialog_text()
        await pilot.press("a")  # closes it again
        assert not isinstance(app.screen, AlertScreen)

    tui.drive(app, body)
