"""`memtui replay` of a recording its job is still writing: followed as it grows, like live.

The job here is this test process itself (its pid, host and start time in the hello), so the
recording is "still being written" by the same rule `memtui report` says `job running` by;
the test appends frames to the file as a job would.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
from textual.pilot import Pilot

from memtui.input.recording_file import writer_alive
from memtui.input.sources import GrowingRecordingSource, ReplaySource, replay_source
from memtui.model.job_state import JobState
from memtui.model.recording import read_recording
from memtui.reports.report import render_text
from memtui.tui.app import MemtuiApp
from memtui.tui.widgets import JobHeader
from memtui_protocol import schema, wire
from memtui_protocol.runtime_dir import process_create_time
from memtui_protocol.schema import ExitStatus


def this_process(hello: schema.Hello) -> schema.Hello:
    """The fixture's hello as if this test process were the job writing the recording."""
    return msgspec.structs.replace(
        hello,
        pid=os.getpid(),
        hostname=os.uname().nodename,
        process_create_time=process_create_time(os.getpid()),
    )


def growing_file(tmp_path: Path, builder: ModuleType, steps: int) -> tuple[Path, list[Any]]:
    """A recording holding the hello, the names and the first `steps` steps, no End; and the
    messages still to come (the remaining steps, then the End)."""
    messages = builder.demo_messages()
    messages[0] = this_process(messages[0])
    head, rest = messages[: 2 + steps], messages[2 + steps :]
    path = tmp_path / "job.memtui"
    path.write_bytes(builder.encode_recording(head))
    return path, rest


def append(path: Path, messages: list[Any]) -> None:
    with open(path, "ab") as handle:
        handle.write(b"".join(wire.encode(message) for message in messages))


def test_report_and_replay_agree_a_recording_is_still_written(
    tmp_path: Path, builder: ModuleType
) -> None:
    path, _ = growing_file(tmp_path, builder, 5)
    assert writer_alive(read_recording(path).hello)
    assert read_recording(path).how_it_ended() is ExitStatus.RUNNING
    assert render_text(read_recording(path)).startswith("job running")
    assert isinstance(replay_source(path), GrowingRecordingSource)

    gone = tmp_path / "gone.memtui"  # the fixture's job: another host, so not this one's
    gone.write_bytes(builder.encode_recording(builder.demo_messages(with_end=False)))
    assert read_recording(gone).how_it_ended() is ExitStatus.KILLED
    assert isinstance(replay_source(gone), ReplaySource)


async def until(pilot: Pilot[Any], done: Any) -> None:
    """Let the app's tick drain the source until `done()` holds (a few seconds at most)."""
    app: Any = pilot.app
    for _ in range(500):
        app.refresh_view()
        if done():
            return
        await pilot.pause(0.01)
    raise AssertionError("the app never got there")


def test_replay_of_a_growing_recording_is_live(tmp_path: Path, builder: ModuleType) -> None:
    """The header says running, new steps arrive and the cursor follows the newest, unless the
    user moved it; the End ends it as the job's own words say."""
    path, rest = growing_file(tmp_path, builder, 5)
    source = replay_source(path)
    source.check()
    app = MemtuiApp(source)

    def header() -> Any:
        return app.query_one(JobHeader).view

    async def scenario() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            await until(pilot, lambda: header() is not None and header().step == 5)
            assert header().status is JobState.LIVE
            assert header().state == "running"
            assert not header().replay
            assert "step 5 of 5" in str(app.query_one(JobHeader).render())
            assert "still writing it" in header().source

            append(path, rest[:5])  # steps 6-10 arrive: the cursor follows
            await until(pilot, lambda: header().steps_total == 10)
            assert header().step == 10

            await pilot.press("left")  # the user moves: the cursor stays where they put it
            append(path, rest[5:10])
            await until(pilot, lambda: header().steps_total == 15)
            assert header().step == 9

            await pilot.press("end")  # End follows again
            append(path, rest[10:])  # steps 16-24 and the job's End
            await until(pilot, lambda: header().status is JobState.ENDED)
            assert header().step == 24
            assert header().ending is ExitStatus.OK
            assert header().state == "ended: exit 0, NaN loss at step 17"  # the demo's NaN
            assert header().source == str(path)

    asyncio.run(scenario())
