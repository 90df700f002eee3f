"""The app driven by keys through Textual's pilot, fed by a fake source (no sockets, no jobs).

Assertions read the Session and the view state each widget was handed, plus the text a panel
renders where the point is what the user sees (units, the ended state).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
from repo_paths import FIXTURES
from rich.text import Text
from textual.app import App
from textual.pilot import Pilot
from textual.widgets import DataTable, RichLog

from memtui.tui.app import MemtuiApp
from memtui.tui.screens import AttachScreen, ConfirmQuit, HelpScreen
from memtui.tui.timeline import AXIS_WIDTH, PileTimeline
from memtui.tui.widgets import (
    AlertDetail,
    AlertsTable,
    DtypeTable,
    GapPanel,
    JobHeader,
    NotesLine,
    PilesPanel,
    TopActivations,
)
from memtui_protocol import schema
from memtui_protocol.schema import Pile

Messages = list[schema.Message]


def cursor_step(app: MemtuiApp) -> int:
    session = app.session
    assert session.cursor is not None
    return session.steps[session.cursor].step


def shown_step(app: MemtuiApp) -> int | None:
    """The step every view shows: each widget holds exactly its slice of the view state the
    model builds for the cursor now (so none lags behind), and the header and the chart agree
    on which step that is."""
    width = app.query_one(PileTimeline).size.width
    view = app.model.view_state(timeline_width=max(width - AXIS_WIDTH, 20))
    held = {
        "header": app.query_one(JobHeader).view,
        "notes": app.query_one(NotesLine).view,
        "piles": app.query_one(PilesPanel).view,
        "gap": app.query_one(GapPanel).view,
        "timeline": app.query_one(PileTimeline).view,
        "alerts": app.query_one(AlertsTable).view,
        "dtypes": app.query_one(DtypeTable).view,
        "activations": app.query_one(TopActivations).view,
    }
    for name, slice_ in held.items():
        assert slice_ == getattr(view, name), f"the {name} widget lags behind the model"
    assert view.header.step == view.timeline.cursor_step
    return view.header.step


def test_replay_opens_on_the_last_step(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        assert app.session.cursor == 23
        assert shown_step(app) == 24
        header = tui.plain(app.query_one(JobHeader))
        # The demo's loss went NaN at step 17: exit 0, not "ok".
        assert "replay · ended: exit 0, NaN loss at step 17   step 24 of 24 · 4.0 steps/s" in header
        assert "4.0 steps/s · pid 4242 · cpu · torch 2.13.0+cpu" in header
        assert "python train.py" in header

    tui.drive(app, body)


def test_step_keys_move_every_view(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        gap, alerts = app.query_one(GapPanel).view, app.query_one(AlertsTable).view
        await pilot.press("left")
        # Steps 23 and 24 close alike and no alert moved: those widgets kept their slice
        # (the one they held, not an equal copy), so they were not redrawn.
        assert app.query_one(GapPanel).view is gap and app.query_one(AlertsTable).view is alerts
        await pilot.press("left")
        assert cursor_step(app) == 22
        assert shown_step(app) == 22
        peak = app.session.steps[21].peak
        piles = app.query_one(PilesPanel).view
        assert piles is not None
        at_peak = {row.name: row.at_peak for row in piles.rows}
        assert at_peak[Pile.ACTIVATIONS] == peak.activations
        assert "step 22 of 24" in tui.plain(app.query_one(JobHeader))
        await pilot.press("home")
        assert shown_step(app) == 1
        await pilot.press("right")
        assert shown_step(app) == 2
        await pilot.press("end")
        assert shown_step(app) == 24

    tui.drive(app, body)


def test_alert_keys_visit_alert_steps(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        visited = []
        for key in ("N", "N", "N", "n", "o", "N", "N", "n"):
            await pilot.press(key)
            visited.append(shown_step(app))
        # Step 1's first-step growth is a note: a stop only once `o` lists the notes.
        assert visited == [17, 9, 9, 17, 17, 9, 1, 9]
        await pilot.press("n")
        assert "loss nan" in tui.plain(app.query_one(PilesPanel))
        await pilot.press("N")
        assert "SKIPPED by GradScaler" in tui.plain(app.query_one(PilesPanel))

    tui.drive(app, body)


def test_units_key_switches_binary_to_decimal(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        panels = (app.query_one(GapPanel), app.query_one(PilesPanel))
        for panel in panels:
            text = tui.plain(panel)
            assert "MiB" in text and " MB" not in text
        await pilot.press("u")
        assert not app.session.binary
        for panel in panels:
            text = tui.plain(panel)
            assert " MB" in text and "MiB" not in text
        await pilot.press("u")
        assert "MiB" in tui.plain(panels[0])

    tui.drive(app, body)


def test_enter_on_an_alert_row_jumps_to_its_step(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        table = app.query_one(AlertsTable)
        steps = [str(table.get_row_at(row)[0]) for row in range(table.row_count)]
        assert steps == ["17", "17", "9"]  # step 1's first-step growth is a note: counted
        table.focus()
        await pilot.pause()
        await pilot.press("down", "down", "enter")
        await pilot.pause()
        assert shown_step(app) == 9
        await pilot.press("escape", "o", "down", "enter")  # o lists the notes, after the rest
        await pilot.pause()
        assert shown_step(app) == 1

    tui.drive(app, body)


def test_end_message_shows_the_worst_error_of_a_run_that_exited_0(
    tui: Any, demo_messages: Messages
) -> None:
    """The demo exits 0 after a NaN loss at step 17: the header says the NaN, not "ok"."""
    app = MemtuiApp(tui.source(demo_messages, live=True))

    async def body(pilot: Pilot[Any]) -> None:
        assert app.session.state_text() == "ended: exit 0, NaN loss at step 17"
        header = tui.plain(app.query_one(JobHeader))
        assert "ended: exit 0, NaN loss at step 17" in header and "ended: ok" not in header

    tui.drive(app, body)


def test_stream_closed_without_end_shows_killed(tui: Any, live_messages: Messages) -> None:
    app = MemtuiApp(tui.source(live_messages, live=True))

    async def body(pilot: Pilot[Any]) -> None:
        assert app.session.state_text() == "live"
        app._source_ended("the job closed its socket", app.selected)
        await pilot.pause()
        assert app.session.state_text() == "killed, no final frame: the job closed its socket"
        assert "killed, no final frame" in tui.plain(app.query_one(JobHeader))

    tui.drive(app, body)


def test_source_closing_by_itself_reaches_the_header(tui: Any, live_messages: Messages) -> None:
    source = tui.source(live_messages, live=True)
    app = MemtuiApp(source)

    async def body(pilot: Pilot[Any]) -> None:
        source.close()
        await app.workers.wait_for_complete()
        await pilot.pause()
        assert app.session.disconnected == "the job closed its socket"
        assert "killed" in tui.plain(app.query_one(JobHeader))

    tui.drive(app, body)


def test_space_pauses_a_live_view(tui: Any, live_messages: Messages, make_step: Any) -> None:
    source = tui.source(live_messages, live=True)
    app = MemtuiApp(source)

    async def arrive(pilot: Pilot[Any], numbers: range) -> None:
        """New steps from the job, drawn as the next tick would."""
        done = source.feed([make_step(number) for number in numbers])
        while not done.is_set():
            await pilot.pause(0.01)
        app.refresh_view()

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("space")
        assert app.session.state_text() == "paused"
        await arrive(pilot, range(25, 28))
        assert len(app.session.steps) == 27
        assert shown_step(app) == 24
        header = app.query_one(JobHeader).view
        assert header is not None and header.steps_total == 27
        assert " paused " in tui.plain(app.query_one(JobHeader))
        await pilot.press("space")
        assert app.session.state_text() == "live"
        assert shown_step(app) == 27
        await arrive(pilot, range(28, 29))
        assert shown_step(app) == 28

    tui.drive(app, body)


def test_space_does_nothing_in_a_replay(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("space")
        assert not app.session.paused

    tui.drive(app, body)


def test_help_opens_and_closes(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("left")
        assert cursor_step(app) == 23

    tui.drive(app, body)


SIDECARS = [
    {
        "pid": 1111,
        "argv": ["python", "train.py", "--lr", "3e-4"],
        "started_unix": 1000.0,
        "socket": "/run/memtui/1111.sock",
        "recording": "runs/a.memtui",
    },
    {
        "pid": 2222,
        "argv": ["torchrun", "pretrain.py"],
        "started_unix": 400.0,
        "socket": "/run/memtui/2222.sock",
        "recording": None,
    },
]


def test_attach_screen_lists_jobs_and_returns_the_chosen_one() -> None:
    chosen: list[dict[str, Any] | None] = []

    class Chooser(App[None]):
        def on_mount(self) -> None:
            self.push_screen(AttachScreen(SIDECARS, now=1100.0), chosen.append)

    async def scenario() -> None:
        app = Chooser()
        async with app.run_test(size=(120, 30)) as pilot:
            await pilot.pause()
            table = app.screen.query_one(DataTable)
            rows = [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]
            assert rows == [
                ["1111", "python train.py --lr 3e-4", "1m40s", "runs/a.memtui"],
                ["2222", "torchrun pretrain.py", "11m40s", "(not recording)"],
            ]
            await pilot.press("down", "enter")
            await pilot.pause()

    asyncio.run(scenario())
    assert chosen == [SIDECARS[1]]


def test_attach_screen_escape_returns_nothing() -> None:
    chosen: list[dict[str, Any] | None] = []

    class Chooser(App[None]):
        def on_mount(self) -> None:
            self.push_screen(AttachScreen(SIDECARS, now=1100.0), chosen.append)

    async def scenario() -> None:
        async with Chooser().run_test() as pilot:
            await pilot.pause()
            await pilot.press("escape")
            await pilot.pause()

    asyncio.run(scenario())
    assert chosen == [None]


def test_quit_while_the_job_runs_asks_first(tui: Any, live_messages: Messages) -> None:
    job = tui.FakeJob(["epoch 1", "epoch 2"])
    app = MemtuiApp(tui.source(live_messages, live=True), job=job)

    async def body(pilot: Pilot[Any]) -> None:
        assert len(app.query_one("#output", RichLog).lines) == 2
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmQuit)
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmQuit)
        assert not job.terminated
        assert app.is_running
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmQuit)
        await pilot.press("y")
        await pilot.pause()
        assert job.terminated

    tui.drive(app, body)
    assert app.return_value == 143


def test_quit_after_the_job_ended_does_not_ask(tui: Any, demo_messages: Messages) -> None:
    job = tui.FakeJob()
    job.code = 0
    source = tui.source(demo_messages, live=True)
    app = MemtuiApp(source, job=job)

    async def body(pilot: Pilot[Any]) -> None:
        assert app.session.exit_code == 0
        await pilot.press("q")
        await pilot.pause()
        assert not job.terminated

    tui.drive(app, body)
    assert app.return_value == 0


def test_q_stops_the_source_thread(tui: Any, live_messages: Messages) -> None:
    # The lifetime is only a net for a source the app never stops (then the test fails after
    # it): with 3 s, a loaded machine let the source end by itself before `q` (issue 33).
    source = tui.source(live_messages, live=True, lifetime=60.0)
    app = MemtuiApp(source)

    async def scenario() -> None:
        async with app.run_test() as pilot:
            await tui.settle(pilot)
            await pilot.press("q")
            await pilot.pause()

    asyncio.run(scenario())
    assert source.stopped_by_app


def test_ctrl_q_stops_the_source_thread(tui: Any, live_messages: Messages) -> None:
    # Long enough that the source cannot end by itself before ctrl+q on a loaded machine (with
    # 1 s it did, under a full suite beside other work, and the app then stopped nothing).
    source = tui.source(live_messages, live=True, lifetime=60.0)
    app = MemtuiApp(source)

    async def scenario() -> None:
        async with app.run_test() as pilot:
            await tui.settle(pilot)
            await pilot.press("ctrl+q")
            await pilot.pause()

    asyncio.run(scenario())
    assert source.stopped_by_app


def test_home_and_end_move_steps_on_a_small_terminal(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("home")
        assert cursor_step(app) == 1
        await pilot.press("end")
        assert cursor_step(app) == 24

    tui.drive(app, body, size=(80, 24))


def test_step_keys_still_work_after_choosing_an_alert(tui: Any, demo_messages: Messages) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        app.query_one(AlertsTable).focus()
        await pilot.press("down", "down", "enter")
        assert cursor_step(app) == 9
        await pilot.press("escape", "end")
        assert cursor_step(app) == 24
        # ←/→ are the table's while it has focus (test_tui_alerts.py); elsewhere the step's.
        await pilot.press("tab", "left")
        assert cursor_step(app) == 23

    tui.drive(app, body)


def test_timeline_window_follows_a_wider_terminal(
    tui: Any, live_messages: Messages, make_step: Any
) -> None:
    steps = [make_step(number) for number in range(1, 301)]
    app = MemtuiApp(tui.source([*live_messages[:2], *steps], live=False))

    async def body(pilot: Pilot[Any]) -> None:
        timeline = app.query_one(PileTimeline)
        assert timeline.view is not None
        narrow = len(timeline.view.steps)
        assert narrow < 100
        await pilot.resize_terminal(200, 48)
        await pilot.pause()
        app.refresh_view()
        await pilot.pause()
        room = timeline.size.width - AXIS_WIDTH
        assert room > narrow
        assert len(timeline.view.steps) >= room

    tui.drive(app, body, size=(100, 40))


def test_five_thousand_steps_in_batches_of_fifty(
    tui: Any, live_messages: Messages, make_step: Any
) -> None:
    """A fast job: the 2 Hz tick drains everything, and what the UI keeps stays bounded."""
    alert = schema.Alert(kind="skipped_step", message="GradScaler skipped the optimizer update")
    steps = [
        msgspec.structs.replace(make_step(number), alerts=[alert]) for number in range(1, 5001)
    ]
    source = tui.source([*live_messages[:2], *steps], live=True, batch_size=50)
    app = MemtuiApp(source)

    async def scenario() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            try:
                while not source.delivered.is_set():
                    await pilot.pause(0.01)
                for _ in range(20):  # let the app's own timer do the draining
                    if not app.inboxes[app.selected]:
                        break
                    await pilot.pause(0.1)
                assert not app.inboxes[app.selected]
                await pilot.pause()
                assert len(app.session.steps) == 5000
                assert shown_step(app) == 5000
                timeline = app.query_one(PileTimeline)
                assert timeline.view is not None
                assert len(timeline.view.steps) <= timeline.size.width
                assert app.query_one(AlertsTable).row_count == 500
                assert len(app.session._step_times) <= 256
            finally:
                await tui.close_source(pilot)

    asyncio.run(scenario())


def test_replay_of_a_torn_recording_shows_what_was_read_and_a_warning(tmp_path: Path) -> None:
    """Opening reads only the head; the damage found later becomes a note, not a blank screen."""
    from memtui.input.sources import ReplaySource

    data = (FIXTURES / "demo.memtui").read_bytes()
    torn = tmp_path / "torn.memtui"
    torn.write_bytes(data[:-7])
    source = ReplaySource(torn)
    source.check()
    app = MemtuiApp(source)

    async def scenario() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            for _ in range(10):
                await pilot.pause(0.05)
                app.refresh_view()
            assert app.session.steps and app.session.steps[-1].step == 24
            notes = app.query_one(NotesLine).view
            assert notes is not None and any("partial frame" in note for note in notes.notes)

    asyncio.run(scenario())


def test_the_alerts_table_keeps_its_cursor_while_alerts_arrive(
    tui: Any, live_messages: Messages
) -> None:
    """Each new alert lands on top; the row under the cursor stays under it, on screen too."""

    def alerts(first: int, count: int) -> Messages:
        return [
            schema.AlertNow(
                time=0.0,
                step=number,
                alert=schema.Alert(kind="over_budget", message=f"alert {number}"),
            )
            for number in range(first, first + count)
        ]

    source = tui.source([*live_messages, *alerts(100, 30)], live=True)
    app = MemtuiApp(source)

    async def body(pilot: Pilot[Any]) -> None:
        table = app.query_one(AlertsTable)
        table.focus()
        await pilot.press("down")
        table.move_cursor(row=32)  # past the table's height (about 18 rows): it scrolls
        await pilot.pause(0.1)
        held = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        row, scroll = table.cursor_row, table.scroll_y
        assert row == 32 and scroll > 0, (row, scroll)
        assert table.step_of_row(held or "") == 9  # the fixture's skipped step: the warning, last
        assert source.feed(alerts(200, 5)).wait(5)
        for _ in range(3):
            await pilot.pause(0.05)
            app.refresh_view()
        await pilot.pause()
        assert table.row_count == 33 + 5  # the fixture's first-step growth: a note, not listed
        assert table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value == held
        assert table.cursor_row == row + 5
        assert table.scroll_y == scroll + 5  # the same rows stay in view
        await pilot.press("enter")
        assert cursor_step(app) == 9

    tui.drive(app, body)


def test_the_alerts_where_is_on_screen_at_normal_widths(tui: Any, demo_messages: Messages) -> None:
    """The module or parameter names an alert points at are on screen without scrolling
    sideways: in the line under the table, for the alert under its cursor."""
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        table = app.query_one(AlertsTable)
        table.focus()
        for size in ((160, 48), (100, 30)):
            await pilot.resize_terminal(*size)
            table.move_cursor(row=0)  # the newest alert: step 17's, in blocks.1.attn
            await pilot.pause()
            detail = " ".join(tui.plain(app.query_one(AlertDetail)).split())
            assert detail.startswith("error step 17 nonfinite_activation [blocks.1.attn]: "), size

    tui.drive(app, body)


def test_the_help_wraps_at_phrase_boundaries_in_a_small_terminal(
    tui: Any, demo_messages: Messages
) -> None:
    """At 60 columns the dialog is narrower than the longest key line: a description wraps
    under itself, never under the keys, and a note's lines are filled, not cut at a hard
    break. (At 80x24 every key fits on its line: tests/tui/test_tui_small_things.py.)"""
    import io

    from rich.console import Console
    from textual.widgets import Static

    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("question_mark")
        await pilot.pause()
        text = app.screen.query_one("#help-text", Static)
        width = text.size.width
        out = io.StringIO()
        Console(width=width, file=out, color_system=None).print(text.content)
        lines = [line.rstrip() for line in out.getvalue().splitlines()]
        keys = lines[2 : lines.index("", 2)]
        column = min(len(line) - len(line.lstrip()) for line in keys if line.startswith(" "))
        assert column >= 6  # continuation lines sit under the descriptions
        assert any(line.startswith(" ") for line in keys), "expected one description to wrap"
        notes = lines[lines.index("", 2) + 1 :]
        paragraphs = [[]]  # type: ignore[var-annotated]
        for line in notes:
            paragraphs[-1].append(line)
            if line.endswith("."):
                paragraphs.append([])
        for paragraph in paragraphs:
            for line in paragraph[:-1]:
                assert len(line) >= width - 15, (line, width)

    tui.drive(app, body, size=(60, 30))


def test_carried_activations_are_marked(tui: Any, demo_messages: Messages) -> None:
    """A step that carries a measured step's activations says so by the activations row and
    is drawn lighter in the timeline; a step whose activations are not known shows no figure
    for them; a measured step is not marked."""

    def carried(message: schema.Message) -> schema.Message:
        if isinstance(message, schema.Step) and message.step > 12:
            source = 12 if message.step < 24 else None  # 24: not measured at all
            return msgspec.structs.replace(
                message, activations_measured=False, activations_from=source
            )
        return message

    app = MemtuiApp(tui.source([carried(m) for m in demo_messages], live=False))

    async def body(pilot: Pilot[Any]) -> None:
        piles = app.query_one(PilesPanel)
        text = tui.plain(piles)
        assert "activations not known: this step was not measured" in text, text
        assert "≈" not in text
        await pilot.press("left")
        await pilot.pause()
        text = tui.plain(piles)
        assert "activations ≈" in text and "≈ activations from step 12" in text, text
        # The panel's height follows its lines (the layout runs only when their count changes).
        carried_height = piles.size.height
        data = app.query_one(PileTimeline).view
        assert data is not None and data.carried == frozenset(range(13, 24))
        assert data.unknown == frozenset({24})
        app.session.jump_to_step(13)  # the steps between are alike: skip their redraws
        await pilot.press("left")
        assert cursor_step(app) == 12
        text = tui.plain(piles)
        assert "≈" not in text and "not measured" not in text and "not known" not in text
        await pilot.pause()
        assert piles.size.height == carried_height - 1
        await pilot.press("right")
        await pilot.pause()
        assert piles.size.height == carried_height

    tui.drive(app, body)


def test_a_tick_with_equal_rows_updates_no_cell(tui: Any, demo_messages: Messages) -> None:
    """Any cell update re-renders a whole table, so a redraw whose rows are unchanged (the
    dtypes of a step like the last) must not touch one; a changed value still shows."""
    from memtui.tui.widgets import sync_rows

    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        table = app.query_one(DtypeTable)
        rows = [(str(key.value), tuple(table.get_row(key))) for key in table.rows]
        assert rows
        updates: list[Any] = []
        original = table.update_cell

        def counted(*args: Any, **kwargs: Any) -> None:
            updates.append(args)
            original(*args, **kwargs)

        table.update_cell = counted  # type: ignore[method-assign]
        sync_rows(table, rows)
        assert updates == []
        key, cells = rows[0]
        sync_rows(table, [(key, (*cells[:-1], Text("999"))), *rows[1:]])
        assert len(updates) == 1
        assert str(table.get_row(key)[-1]) == "999"

    tui.drive(app, body)
