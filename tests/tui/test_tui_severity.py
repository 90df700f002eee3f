"""Alerts a user can act on (issue 36): each row says its severity in a word, errors lead, the
line under the table follows the newest alert of the highest severity, the notes a healthy run
raises are counted rather than listed; and the rough edges a first hour trips over: the footer
whole at 80x24, the focused panel marked by its border, GPU rows on a CPU job that say why.
"""

from __future__ import annotations

from typing import Any

from textual.pilot import Pilot
from textual.widgets._footer import FooterKey

from memtui.tui.app import MemtuiApp
from memtui.tui.widgets import AlertDetail, AlertsTable, GapPanel, JobHeader
from memtui_protocol import schema

Messages = list[schema.Message]


def alert_now(step: int, kind: str, message: str) -> schema.AlertNow:
    return schema.AlertNow(time=0.0, step=step, alert=schema.Alert(kind=kind, message=message))


def rows(table: AlertsTable) -> list[list[str]]:
    return [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]


def test_the_detail_follows_the_newest_alert_of_the_highest_severity(
    tui: Any, live_messages: Messages
) -> None:
    """A first-step note, then a skipped step, then a NaN loss: the line under the table moves
    to each worse one as it arrives (it stayed on the first alert forever), and a warning that
    comes after the error does not take its place."""
    source = tui.source(
        [*live_messages[:3], alert_now(1, "first_step_forecast", "the first step will add")],
        live=True,
    )
    app = MemtuiApp(source)

    def detail() -> str:
        return " ".join(tui.plain(app.query_one(AlertDetail)).split())

    async def feed(*messages: schema.Message) -> None:
        assert source.feed(list(messages)).wait(5)
        for _ in range(3):
            await pilot_ref[0].pause(0.05)
            app.refresh_view()
        await pilot_ref[0].pause()

    pilot_ref: list[Pilot[Any]] = []

    async def body(pilot: Pilot[Any]) -> None:
        pilot_ref.append(pilot)
        table = app.query_one(AlertsTable)
        assert table.row_count == 0  # the forecast and the growth of step 1 are notes: counted
        assert "notes: 2 (o: list)" in str(app.query_one("#alerts-box").border_title)
        await feed(alert_now(3, "skipped_step", "GradScaler skipped the update"))
        assert detail().startswith("warn step 3 skipped_step")
        await feed(alert_now(5, "nonfinite_loss", "the loss is nan at this step"))
        assert detail().startswith("error step 5 nonfinite_loss")
        assert rows(table)[0][:3] == ["5", "error", "nonfinite_loss"]
        await feed(alert_now(6, "skipped_step", "GradScaler skipped the update"))
        assert detail().startswith("error step 5 nonfinite_loss")  # errors stay on top
        assert [row[1] for row in rows(table)] == ["error", "warn", "warn"]
        title = str(app.query_one("#alerts-box").border_title)
        assert title == "Alerts: 1 error · 2 warnings · notes: 2 (o: list)"
        await pilot.press("o")
        await pilot.pause()
        assert [row[1] for row in rows(table)] == ["error", "warn", "warn", "note", "note"]
        assert "notes: 2 (o: hide)" in str(app.query_one("#alerts-box").border_title)

    tui.drive(app, body)


def test_an_ended_run_that_went_nan_says_so_in_the_header(
    tui: Any, demo_messages: Messages
) -> None:
    """The demo exits 0 after its loss went NaN at step 17: not "ended: ok"."""
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        header = tui.plain(app.query_one(JobHeader))
        assert "ended: exit 0, NaN loss at step 17" in header
        assert "ended: ok" not in header
        state = app.query_one(JobHeader).render().spans[0].style
        assert "red" in str(state)

    tui.drive(app, body)


def test_the_footer_is_whole_at_80x24_on_a_live_job(tui: Any, live_messages: Messages) -> None:
    """Every key the footer offers ends inside 80 columns (it read `u▏^p palette`), with the
    rank key of a job of several ranks too."""
    one = MemtuiApp(tui.source(live_messages, live=True))
    first, second = tui.source(live_messages, live=True), tui.source(live_messages, live=True)
    two = MemtuiApp(first, ranks={"0": first, "1": second})
    for app, extra in ((one, set()), (two, {"Rank"})):

        async def body(pilot: Pilot[Any], app: MemtuiApp = app, extra: set[str] = extra) -> None:
            await pilot.pause()
            keys = list(app.query(FooterKey))
            described = {key.description for key in keys}
            shown = {"Quit", "Help", "Pause", "Next alert", "Alert", "Notes", "GiB/GB", *extra}
            assert shown <= described
            for key in keys:
                assert key.region.width > 0 and key.region.right <= 80, (
                    key.description,
                    key.region,
                )

        tui.drive(app, body, size=(80, 24))


def test_the_focused_panel_is_marked_by_its_border(tui: Any, demo_messages: Messages) -> None:
    """Tab to a table: its box's border turns heavy (a shape, not a colour alone), the others
    stay round."""
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        alerts_box, dtypes_box = app.query_one("#alerts-box"), app.query_one("#dtypes-box")

        def border(box: Any) -> str:
            return str(box.styles.border_top[0])

        assert border(alerts_box) == "round"
        app.query_one(AlertsTable).focus()
        await pilot.pause()
        assert border(alerts_box) == "heavy"
        assert border(dtypes_box) == "round"

    tui.drive(app, body)


def test_gpu_rows_on_a_cpu_job_say_why(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        text = tui.plain(app.query_one(GapPanel))
        gpu = [line for line in text.splitlines() if "torch allocated" in line]
        assert gpu and "n/a" in gpu[0] and "no GPU: a CPU job" in gpu[0]

    tui.drive(app, body)
