"""The piles panel names what the job keeps outside every pile (an EMA kept as a list of
tensors: part of `other`), as the latest census at or before the cursor step counted it, and a
step whose activations are not known points at the alert that says why.

The recording is `make_fixture.leaking_messages` with a `Kept` count at steps 8 and 20 and
step 10 made "not known" (its reason said by the alert of step 4).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import msgspec
from textual.pilot import Pilot

from memtui.reports.leak_report import kept_line
from memtui.tui.app import MemtuiApp
from memtui.tui.widgets import PilesPanel
from memtui_protocol import schema

NOT_KNOWN_STEP = 10
WHY_AT = 4
KEPT = {
    8: schema.Kept(
        bytes=548_864,
        tensors=7,
        holders=[
            schema.KeptHolder("ema", 535 * 1024, 6),
            schema.KeptHolder("batch (local of train)", 4_096, 1),
        ],
    ),
    15: schema.Kept(bytes=0, tensors=0, holders=[]),  # a census that found nothing
    20: schema.Kept(bytes=None, tensors=9, holders=[schema.KeptHolder("ema", 600 * 1024, 8)]),
}


def _messages(builder: ModuleType) -> list[schema.Message]:
    found: list[schema.Message] = []
    for message in builder.leaking_messages():
        if isinstance(message, schema.Step) and message.step == NOT_KNOWN_STEP:
            message = msgspec.structs.replace(
                message,
                activations_measured=False,
                activations_from=None,
                activations_why_at=WHY_AT,
            )
        if isinstance(message, schema.Step) and message.step in KEPT:
            message = msgspec.structs.replace(message, kept=KEPT[message.step])
        found.append(message)
    return found


def _text(tui: Any, app: MemtuiApp, step: int | None) -> str:
    """The piles panel at `step` (None: the last), as one line of single-spaced words (its lines
    wrap at the panel's width)."""
    if step is None:
        app.session.end_key()
    else:
        app.session.jump_to_step(step)
    app.refresh_view()
    return " ".join(tui.plain(app.query_one(PilesPanel)).split())


def test_the_piles_panel_names_what_the_job_keeps_as_of_the_cursor_step(
    tui: Any, builder: ModuleType
) -> None:
    app = MemtuiApp(tui.source(_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        assert "kept outside" not in _text(tui, app, 7)
        await pilot.pause()
        at_9 = _text(tui, app, 9)
        assert (
            "kept outside the piles at step 8 (its census): 536.00 KiB in 7 tensors; "
            "ema 535.00 KiB, batch (local of train) 4.00 KiB"
        ) in at_9
        await pilot.pause()
        # Step 15's census found nothing: no "0 B in 0 tensors" line, nor step 8's old one.
        assert "kept outside" not in _text(tui, app, 16)
        await pilot.pause()
        last = _text(tui, app, None)
        assert (
            "kept outside the piles at step 20 (its census): a total not known (its census "
            "stopped at its bound); ema 600.00 KiB"
        ) in last
        assert app.session.recording is not None
        line = kept_line(app.session.recording)
        assert line is not None and last.endswith(line)

    tui.drive(app, body)


def test_a_step_not_known_points_at_the_alert_that_says_why(tui: Any, builder: ModuleType) -> None:
    app = MemtuiApp(tui.source(_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        lines = _text(tui, app, NOT_KNOWN_STEP)
        assert (
            "activations not known: this step was not measured, nor confirmed as a repeat of a "
            f"measured step (why: the alert of step {WHY_AT})"
        ) in lines
        await pilot.pause()

    tui.drive(app, body)
