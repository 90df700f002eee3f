"""One step numbering everywhere: the job's own step numbers, live, in replay, the report and
`detach`.

An agent attached to a running job numbers its frames from the job's step count (the job's
optimizer has stepped 4 times: the first recorded step is 5). Every reader shows those numbers,
never positions in the recording: live said "step 28 of 28" while replay said "step 24 of 24"
and `detach` counted the job's steps where the report counted the recorded ones.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
from textual.pilot import Pilot

from memtui.model.recording import read_recording
from memtui.model.session import Session
from memtui.reports.report import build_report, render_text
from memtui.tui.app import MemtuiApp
from memtui.tui.widgets import JobHeader
from memtui_protocol import schema

ATTACHED_AFTER = 4
"""The job's steps before the attach: the first recorded step is step 5."""


def attached_messages(builder: ModuleType, with_end: bool = True) -> list[schema.Message]:
    """The fixture run as an agent attached after the job's 4th step records it: frames carry
    the job's numbers 5-28, the first with the `attached` alert."""
    messages: list[schema.Message] = []
    for message in builder.demo_messages(with_end=with_end):
        if isinstance(message, schema.Step):
            alerts = list(message.alerts)
            if message.step == 1:
                alerts.insert(
                    0,
                    schema.Alert(
                        kind=schema.AlertKind.ATTACHED,
                        message="attached at step 5: the job's steps 1-4 were not recorded",
                    ),
                )
            message = msgspec.structs.replace(
                message, step=message.step + ATTACHED_AFTER, alerts=alerts
            )
        elif isinstance(message, schema.End) and message.step is not None:
            message = msgspec.structs.replace(message, step=message.step + ATTACHED_AFTER)
        messages.append(message)
    return messages


@pytest.mark.parametrize("live", [True, False], ids=["live", "replay"])
def test_the_header_numbers_steps_as_the_job_does(builder: ModuleType, live: bool) -> None:
    session = Session(source_label="attached", live=live)
    session.ingest(attached_messages(builder, with_end=not live))
    header = session.view_state().header
    assert (header.step, header.steps_total, header.first_step) == (28, 28, 5)
    session.move(-3)
    assert session.view_state().header.step == 25
    session.home()
    assert session.view_state().header.step == 5


def test_live_and_replay_headers_read_alike(tui: Any, builder: ModuleType) -> None:
    """The words on screen: the job's numbers, and where the recording starts."""
    shown = {}
    for live in (True, False):
        app = MemtuiApp(tui.source(attached_messages(builder, with_end=not live), live=live))

        async def body(pilot: Pilot[Any], app: MemtuiApp = app, live: bool = live) -> None:
            await pilot.press("left")
            shown[live] = tui.plain(app.query_one(JobHeader))

        tui.drive(app, body)
    for text in shown.values():
        assert "step 27 of 28 (recorded from step 5)" in text
    # The fixture's loss goes NaN at step 21: the replay of a run that exited 0 says so.
    assert shown[False].lstrip().startswith("replay · ended: exit 0, NaN loss at step 21")
    assert shown[True].lstrip().startswith("live")


def test_a_job_recorded_from_its_first_step_says_no_more(builder: ModuleType) -> None:
    session = Session(source_label="fixture", live=False)
    session.ingest(builder.demo_messages())
    assert session.view_state().header.first_step is None


def test_the_report_counts_recorded_steps_by_the_jobs_numbers(
    tmp_path: Path, builder: ModuleType
) -> None:
    path = tmp_path / "attached.memtui"
    path.write_bytes(builder.encode_recording(attached_messages(builder)))
    recording = read_recording(path)
    text = render_text(recording)
    assert "steps: 24 recorded, the job's steps 5-28, 1 skipped" in text.splitlines()
    report = build_report(recording)
    assert report["steps"][0]["step"] == 5
    assert report["steps"][-1]["step"] == 28
    # A job recorded from its first step: the plain count, as before.
    plain = tmp_path / "plain.memtui"
    plain.write_bytes(builder.encode_recording(builder.demo_messages()))
    assert "steps: 24, 1 skipped" in render_text(read_recording(plain)).splitlines()


def test_detach_says_the_jobs_last_step_and_how_many_were_recorded() -> None:
    from memtui_agent.attach.inject import detached_message

    assert detached_message(49, 45) == "detached after step 49 (45 steps recorded)"
    assert detached_message(5, 1) == "detached after step 5 (1 step recorded)"
    assert detached_message(4, 0) == "detached before any step closed (nothing recorded)"


def test_the_window_counts_recorded_steps_apart_from_the_jobs_numbers() -> None:
    """What `detach` reads: an attached window goes on from the job's count (`closed`) and
    counts its own closes (`recorded`)."""
    from memtui_agent.job.optimizer_book import OptimizerRecord
    from memtui_agent.steps.activation_policy import Verdict
    from memtui_agent.steps.frame import CloseReading, StepInputs
    from memtui_agent.steps.window import OpenStep, StepWindow
    from memtui_protocol.schema import StepTrigger

    class Closer:
        def close(
            self, opened: OpenStep, step: int, skipped: bool, record: OptimizerRecord | None
        ) -> StepInputs:
            return StepInputs(
                step=step,
                t_start=opened.started,
                t_end=opened.started + 1.0,
                reading=CloseReading(step),
                verdict=Verdict(measured=True),
                skipped=skipped,
                closed_by=StepTrigger.OPTIMIZER,
            )

    class Stand:
        def step_opens(self, after: StepInputs) -> None: ...

        def reset_step(self, start_gradients: int | None = None) -> None: ...

    emitted: list[Any] = []
    window = StepWindow(Closer(), Stand(), Stand(), emitted.append, lambda: True)
    window.closed = ATTACHED_AFTER  # what the attach does
    for _ in range(3):
        window.optimizer_stepped(OptimizerRecord(kind="SGD", name="SGD#1", steps=1))
    assert [closed.inputs.step for closed in emitted] == [5, 6, 7]
    assert (window.closed, window.recorded) == (7, 3)
