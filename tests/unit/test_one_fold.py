"""One fold of the frame stream: the TUI's Session, `memtui report` and `export` read the same
Recording, built by `recording.apply` from one read loop (`frame_stream.pump`)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import ModuleType

import msgspec

from memtui.input.sources import ReplaySource, TailSource
from memtui.model.recording import read_recording
from memtui.model.session import Session
from memtui.reports.report import report_of
from memtui_protocol import schema, wire


def _messages(builder: ModuleType) -> list[schema.Message]:
    """The fixture run, then an early alert, a late NaN loss for step 24 and a fatal End."""
    messages = builder.demo_messages(with_end=False)
    last = messages[-1]
    assert isinstance(last, schema.Step)
    nan = schema.Alert(kind="nonfinite_loss", message="loss is nan (arrived late)")
    step_25 = msgspec.structs.replace(
        builder.make_step(25), late=[schema.StepLate(step=24, loss=float("nan"), alerts=[nan])]
    )
    return [
        *messages,
        schema.AlertNow(
            time=last.t_end, step=25, alert=schema.Alert(kind="over_budget", message="soon")
        ),
        step_25,
        schema.End(
            time=step_25.t_end + 1,
            status="error",
            step=26,
            oom=True,
            alerts=[schema.Alert(kind="oom", message="out of memory")],
        ),
    ]


def test_the_screen_and_the_report_list_the_same_alerts(
    tmp_path: Path, builder: ModuleType
) -> None:
    messages = _messages(builder)
    session = Session(source_label="fixture", live=False)
    session.ingest(messages)
    assert session.recording is not None
    shown = [(row.step, row.kind) for row in session.alerts]
    reported = [(alert.step, alert.kind) for alert in report_of(session.recording).alerts]
    assert sorted(shown) == sorted(reported)
    assert (24, "nonfinite_loss") in shown and (26, "oom") in shown and (25, "over_budget") in shown

    path = tmp_path / "run.memtui"
    path.write_bytes(builder.encode_recording(messages))
    from_file = read_recording(path)
    assert from_file.alerts == session.recording.alerts
    from_file.path = session.recording.path  # the Session's path is its source label
    # Compared encoded: the late NaN loss is never equal to itself.
    assert msgspec.json.encode(report_of(from_file)) == msgspec.json.encode(
        report_of(session.recording)
    )


def test_every_source_words_a_bad_frame_the_same_way(tmp_path: Path, builder: ModuleType) -> None:
    """A frame that cannot be read ends the file source and the tail source with one wording."""
    messages = builder.demo_messages(with_end=False)
    good = wire.preamble() + b"".join(wire.encode(message) for message in messages[:5])
    newer = bytearray(wire.encode(messages[5]))
    newer[-1] ^= 0xFF  # a bad checksum: the tail (no resync) must stop there
    path = tmp_path / "run.memtui"
    path.write_bytes(good + bytes(newer))
    batches: list[list[schema.Message]] = []
    reason = TailSource(path, job_exited=lambda: True).run(batches.append, threading.Event())
    assert reason is not None and reason.endswith("; showing the 5 frames before it")
    assert sum(len(batch) for batch in batches) == 5

    replayed: list[list[schema.Message]] = []
    warning = ReplaySource(path).run(replayed.append, threading.Event())
    assert warning == read_recording(path).warning
    assert warning is not None and "skipped" in warning
