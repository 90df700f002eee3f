"""The small things a first hour with memtui trips over: `n` that says why it did not move, the
help whole at 80x24, "? Help" in a narrow footer, no Pause where nothing arrives, free memory
that does not read like growth, the alert's step under a narrow chart, and a `-- COMMAND`
folder of one process reported as that process, not as ranks.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import Static
from textual.widgets._footer import FooterKey

from memtui.model.recording import read_recording
from memtui.model.session import AlertMiss, Session
from memtui.model.view_state import TimelineView
from memtui.reports.rank_report import render_session_text
from memtui.reports.report import render_text
from memtui.tui.app import MemtuiApp
from memtui.tui.screens import HelpScreen
from memtui.tui.timeline import render_lines
from memtui.tui.widgets import GapPanel
from memtui_protocol import schema

NAN_FROM = 20


def grouped_messages(builder: ModuleType) -> list[schema.Message]:
    """The fixture run, non-finite from step 20: steps 21-24 repeat its alert, grouped."""
    out: list[schema.Message] = []
    for message in builder.demo_messages():
        if isinstance(message, schema.Step) and message.step >= NAN_FROM:
            group = NAN_FROM if message.step > NAN_FROM else None
            alert = schema.Alert(kind="nonfinite_loss", message="the loss is NaN", group=group)
            message = msgspec.structs.replace(message, alerts=[alert])
        out.append(message)
    return out


def test_next_alert_says_why_it_stays(builder: ModuleType) -> None:
    session = Session(live=False)
    session.ingest(grouped_messages(builder))
    session.jump_to_step(NAN_FROM)
    assert session.next_alert(1) == AlertMiss(
        NAN_FROM, True, grouped=4, grouped_steps=(21, 24), group=NAN_FROM
    )
    assert session.steps[session.cursor or 0].step == NAN_FROM  # it stayed
    session.home()
    assert session.next_alert(-1) == AlertMiss(1, False)
    assert session.next_alert(1) is None  # moved, to the skipped step 9
    assert session.steps[session.cursor or 0].step == 9


def test_n_on_grouped_alerts_tells_the_user(tui: Any, builder: ModuleType) -> None:
    app = MemtuiApp(tui.source(grouped_messages(builder), live=False))
    said: list[str] = []

    async def body(pilot: Pilot[Any]) -> None:
        app.notify = lambda message, **options: said.append(str(message))  # type: ignore[method-assign]
        await pilot.press("N")  # from step 24 back to step 20, the group's first alert
        assert said == []
        await pilot.press("n")
        assert said == [
            "no alert of its own after step 20: the 4 alerts on steps 21-24 follow from "
            "step 20's (one folded row in the alerts table)"
        ]

    tui.drive(app, body)


def help_lines(app: MemtuiApp) -> list[str]:
    text = app.screen.query_one("#help-text", Static)
    out = io.StringIO()
    Console(width=text.size.width, file=out, color_system=None).print(text.content)
    return [line.rstrip() for line in out.getvalue().splitlines()]


def test_the_help_is_whole_at_80x24_and_names_the_scroll_keys(
    tui: Any, builder: ModuleType
) -> None:
    app = MemtuiApp(tui.source(builder.demo_messages(), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        dialog = app.screen.query_one("#help-dialog")
        lines = help_lines(app)
        assert dialog.max_scroll_y == 0  # nothing below the dialog's edge
        assert dialog.content_region.height >= len(lines)
        assert any("PgUp PgDn" in line for line in lines)
        assert lines[-1].strip().endswith("its figures.")

    tui.drive(app, body, size=(80, 24))


def test_a_help_longer_than_the_terminal_scrolls(tui: Any, builder: ModuleType) -> None:
    app = MemtuiApp(tui.source(builder.demo_messages(), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("question_mark")
        await pilot.pause()
        dialog = app.screen.query_one("#help-dialog")
        assert dialog.max_scroll_y > 0
        dialog.scroll_end(animate=False)
        await pilot.pause()
        assert dialog.scroll_y == dialog.max_scroll_y

    tui.drive(app, body, size=(60, 16))


def footer_keys(app: MemtuiApp) -> dict[str, FooterKey]:
    return {key.description: key for key in app.query(FooterKey)}


def test_the_footer_keeps_help_below_60_columns(tui: Any, builder: ModuleType) -> None:
    app = MemtuiApp(tui.source(builder.demo_messages(), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.pause()
        help_key = footer_keys(app)["Help"]
        assert help_key.region.right <= 56 and help_key.region.width > 0

    tui.drive(app, body, size=(56, 24))


def test_pause_is_offered_only_while_frames_arrive(
    tui: Any, builder: ModuleType, live_messages: list[schema.Message]
) -> None:
    replay = MemtuiApp(tui.source(builder.demo_messages(), live=False))

    async def in_replay(pilot: Pilot[Any]) -> None:
        await pilot.pause()
        assert "Pause" not in footer_keys(replay)
        await pilot.press("space")
        assert not replay.session.paused

    tui.drive(replay, in_replay)

    source = tui.source(live_messages, live=True)
    live = MemtuiApp(source)

    async def live_then_ended(pilot: Pilot[Any]) -> None:
        await pilot.pause()
        assert "Pause" in footer_keys(live)
        source.feed([builder.demo_messages()[-1]]).wait(5)  # the job's End
        live.refresh_view()
        await pilot.pause()
        assert "Pause" not in footer_keys(live)

    tui.drive(live, live_then_ended)


def test_free_memory_reads_as_free_not_as_growth(tui: Any, builder: ModuleType) -> None:
    app = MemtuiApp(tui.source(builder.demo_messages(), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        lines = tui.plain(app.query_one(GapPanel)).splitlines()
        total = next(line for line in lines if line.lstrip().startswith("system total"))
        assert " ".join(total.split()) == "system total 16.00 GiB 10.00 GiB free on the machine"
        used = next(line for line in lines if line.lstrip().startswith("system used"))
        assert "+5.43 GiB" in used  # a difference some use holds keeps its sign

    tui.drive(app, body)


def test_a_narrow_chart_names_the_step_of_its_first_alert(builder: ModuleType) -> None:
    """At 80x24 the chart holds 62 steps: 39-100, markers from step 60 on; the labels said
    only 39 and 100."""
    piles = builder.make_step(1).peak
    steps = tuple(range(39, 101))
    view = TimelineView(
        steps=steps,
        piles=(piles,) * len(steps),
        alerts=frozenset(range(60, 101)),
        cursor_step=100,
        binary=True,
    )
    lines = render_lines(view, width=12 + len(steps), height=10)
    markers, labels = lines[-2].plain, lines[-1].plain
    first = markers.index("▲")
    assert labels[first - 1 : first + 1] == "60"
    assert labels.split() == ["step", "39", "60", "100"]


def test_a_command_folder_of_one_process_is_that_process(
    tmp_path: Path, builder: ModuleType
) -> None:
    folder = tmp_path / "session"
    folder.mkdir()
    (folder / "proc-0.memtui").write_bytes(builder.encode_recording(builder.demo_messages()))
    recording = read_recording(folder / "proc-0.memtui")
    text = render_session_text({"proc-0": recording})
    assert text.splitlines()[0] == "one process recorded (proc-0.memtui)"
    assert text.split("\n", 1)[1] == render_text(recording)
    assert "rank" not in text and "imbalance" not in text

    two = render_session_text({"proc-0": recording, "proc-1": recording})
    assert two.splitlines()[0] == "2 processes of one command"
    assert "imbalance" not in two and "rank" not in two
    ranks = render_session_text({"0": recording, "1": recording})
    assert ranks.splitlines()[0] == "session of 2 rank(s)" and "imbalance" in ranks
