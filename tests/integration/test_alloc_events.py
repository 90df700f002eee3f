"""`--alloc-events` through the code a GPU run uses, on ring entries in torch's documented format.

No GPU here. The entries are dicts shaped as `torch.cuda.memory._snapshot()["device_traces"]`
holds them (see `_snapshot`'s docstring and `torch/cuda/_memory_viz.py`): `action`, `addr`,
`size`, `stream`, `frames` (innermost first, `filename`/`line`/`name`), `time_us` in newer torch,
`device_free` instead of `addr` on an "oom". Torch itself is replaced by a stand-in with the
calls the recorder makes, and one job runs the real agent with `torch.cuda` patched to serve
the same entries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from textual.pilot import Pilot

from memtui.model.alloc_rows import AllocKind, alloc_rows, events_dict, events_text
from memtui.model.recording import Recording, read_recording
from memtui.model.session import Session
from memtui.reports.report import build_report, render_text
from memtui.tui.allocations import AllocationsTable
from memtui.tui.app import MemtuiApp
from memtui_agent.memory.alloc_events import MAX_ENTRIES, AllocEventsRecorder
from memtui_agent.memory.alloc_trace import (
    TOP,
    WHERE_CHARS,
    Cursor,
    Drained,
    new_entries,
    summarize,
)
from memtui_agent.steps.activation_policy import Verdict
from memtui_agent.steps.frame import CloseReading, HostValues, StepInputs, build_step
from memtui_protocol import schema, wire

MIB = 2**20
TORCH = "/venv/lib/python3.11/site-packages/torch"
LINEAR = {"filename": f"{TORCH}/nn/modules/linear.py", "line": 125, "name": "forward"}
CALL_IMPL = {"filename": f"{TORCH}/nn/modules/module.py", "line": 1784, "name": "_call_impl"}
ADAMW = {"filename": f"{TORCH}/optim/adamw.py", "line": 240, "name": "_init_group"}
MODEL = {"filename": "/work/job/model.py", "line": 42, "name": "forward"}
TRAIN = {"filename": "/work/job/train.py", "line": 88, "name": "main"}
CPP = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"}
AGENT = {"filename": "/src/agent/tracker.py", "line": 300, "name": "backward"}
IN_MODEL = [CPP, LINEAR, CALL_IMPL, MODEL, CALL_IMPL, TRAIN]
IN_OPTIMIZER = [ADAMW, TRAIN]


def entry(
    action: str, size: int, time_us: int | None = None, frames: Any = None, **extra: Any
) -> dict[str, Any]:
    """One trace entry as `_snapshot()` returns it."""
    item: dict[str, Any] = {"action": action, "size": size, "stream": 0}
    if action == "oom":
        item["device_free"] = extra.pop("device_free", 0)
    else:
        item["addr"] = extra.pop("addr", 0x7F0000000000)
    if frames is not None:
        item["frames"] = frames
    if time_us is not None:
        item["time_us"] = time_us
    item.update(extra)
    return item


# ----- which entries are new --------------------------------------------------------------------


def test_first_read_takes_the_ring_and_later_reads_only_what_is_new() -> None:
    ring = [entry("alloc", MIB, 10, IN_MODEL), entry("free_requested", MIB, 11)]
    new, overflowed, cursor = new_entries(ring, Cursor(), MAX_ENTRIES)
    assert new == ring and not overflowed
    assert (cursor.time_us, cursor.at_time) == (11, 1)
    # The read leaves a "snapshot" mark; then the next step allocates.
    ring += [entry("snapshot", 0, 12), entry("alloc", 2 * MIB, 13, IN_MODEL)]
    new, overflowed, cursor = new_entries(ring, cursor, MAX_ENTRIES)
    assert [item["action"] for item in new] == ["snapshot", "alloc"] and not overflowed
    # Nothing happened since: nothing is new.
    assert new_entries(ring, cursor, MAX_ENTRIES)[0] == []


def test_entries_sharing_the_cursors_microsecond_are_not_read_twice() -> None:
    ring = [entry("alloc", 1, 5), entry("alloc", 2, 7), entry("alloc", 3, 7)]
    _, _, cursor = new_entries(ring, Cursor(), MAX_ENTRIES)
    assert (cursor.time_us, cursor.at_time) == (7, 2)
    ring.append(entry("alloc", 4, 7))  # same microsecond, after the read
    ring.append(entry("alloc", 5, 8))
    new, _, _ = new_entries(ring, cursor, MAX_ENTRIES)
    assert [item["size"] for item in new] == [4, 5]


def test_a_ring_that_wrapped_past_the_cursor_is_flagged() -> None:
    _, _, cursor = new_entries([entry("alloc", 1, 100)], Cursor(), 4)
    # Four newer entries in a ring of four: the entry at the cursor, and maybe more, fell off.
    ring = [entry("alloc", size, 200 + size) for size in range(4)]
    new, overflowed, _ = new_entries(ring, cursor, 4)
    assert len(new) == 4 and overflowed
    # A ring that is full but still holds the cursor lost nothing of this step.
    ring = [entry("alloc", 1, 100), *(entry("alloc", size, 200 + size) for size in range(3))]
    new, overflowed, _ = new_entries(ring, cursor, 4)
    assert len(new) == 3 and not overflowed
    # Nor one whose oldest entry is the mark the previous read left right after the cursor.
    ring = [entry("snapshot", 0, 150), *(entry("alloc", size, 200 + size) for size in range(3))]
    new, overflowed, _ = new_entries(ring, cursor, 4)
    assert len(new) == 4 and not overflowed


def test_older_format_without_time_us_reads_after_the_last_snapshot_mark() -> None:
    ring = [entry("alloc", 1, frames=IN_MODEL), entry("free_completed", 1)]
    new, _, cursor = new_entries(ring, Cursor(), MAX_ENTRIES)
    assert len(new) == 2 and cursor.drained and cursor.time_us is None
    ring += [entry("snapshot", 0), entry("alloc", 2), entry("segment_alloc", 20 * MIB)]
    new, overflowed, cursor = new_entries(ring, cursor, MAX_ENTRIES)
    assert [item["size"] for item in new] == [2, 20 * MIB] and not overflowed
    # The mark fell off a full ring: everything left is new, and some of it may be lost.
    new, overflowed, _ = new_entries([entry("alloc", 3), entry("alloc", 4)], cursor, 2)
    assert len(new) == 2 and overflowed


# ----- the summary ------------------------------------------------------------------------------


def test_summary_names_the_users_line_not_torchs() -> None:
    entries = [
        entry("snapshot", 0, 1),
        entry("alloc", 64 * MIB, 2, IN_MODEL),
        entry("alloc", 64 * MIB, 3, IN_MODEL),
        entry("alloc", 8 * MIB, 4, IN_OPTIMIZER),
        entry("free_requested", 64 * MIB, 5, IN_MODEL),
        entry("free_completed", 64 * MIB, 6, IN_MODEL),
        entry("alloc", 4 * MIB, 7, [AGENT, MODEL]),
        entry("alloc", 2 * MIB, 8, [LINEAR, CALL_IMPL]),  # nothing outside torch
        entry("alloc", MIB, 9),  # no stack recorded
        entry("segment_alloc", 80 * MIB, 10, IN_MODEL),
        entry("segment_map", 2 * MIB, 11, IN_OPTIMIZER),
        entry("segment_free", 80 * MIB, 12),
    ]
    events = summarize(entries, skip_prefixes=("/src/agent/",), cwd="/work/job")
    assert [(row.size, row.count, row.where) for row in events.largest] == [
        (64 * MIB, 2, "model.py:42 forward"),
        (8 * MIB, 1, "train.py:88 main"),
        (4 * MIB, 1, "model.py:42 forward"),
        (2 * MIB, 1, f"{TORCH}/nn/modules/linear.py:125 forward"),
        (MIB, 1, ""),
    ]
    assert (events.allocations, events.alloc_bytes) == (6, 143 * MIB)
    assert [(row.size, row.where) for row in events.segments] == [
        (80 * MIB, "model.py:42 forward"),
        (2 * MIB, "train.py:88 main"),
    ]
    assert (events.segment_allocs, events.segment_bytes) == (2, 82 * MIB)
    assert events.oom is None and events.lost == 0 and not events.overflowed


def test_oom_event_and_allocations_the_ring_lost() -> None:
    entries = [
        entry("alloc", MIB, 1, IN_MODEL),
        entry("oom", 6 * 2**30, 2, IN_MODEL, device_free=512 * MIB),
    ]
    events = summarize(entries, expected_allocations=40, overflowed=True, cwd="/work/job")
    assert events.oom == schema.AllocEvent(6 * 2**30, 1, "model.py:42 forward")
    assert events.oom_free == 512 * MIB
    assert events.lost == 39 and events.overflowed


def test_malformed_entries_are_skipped_not_fatal() -> None:
    entries = [
        "not a dict",
        {"action": "alloc"},  # no size
        {"action": "alloc", "size": True},
        {"action": "alloc", "size": -5},
        {"action": "alloc", "size": 7, "frames": "garbage"},
        {"action": "alloc", "size": 9, "frames": [None, {"filename": 3}, MODEL]},
        {"action": "oom", "size": 11, "device_free": "?"},
    ]
    events = summarize(entries)
    assert [(row.size, row.where) for row in events.largest] == [
        (9, "/work/job/model.py:42 forward"),
        (7, ""),
    ]
    assert events.oom is not None and events.oom.size == 11 and events.oom_free is None


def test_summary_is_bounded_however_busy_the_step() -> None:
    deep = [{"filename": "/x/" + "d" * 400 + ".py", "line": 1, "name": "f"}]
    entries = [entry("alloc", size, size, deep) for size in range(1, 5001)]
    entries += [entry("segment_alloc", size, 6000 + size, deep) for size in range(1, 501)]
    events = summarize(entries)
    assert len(events.largest) == TOP and len(events.segments) == TOP
    assert events.largest[0].size == 5000 and events.allocations == 5000
    assert all(len(row.where) <= WHERE_CHARS for row in events.largest)
    assert events.largest[0].where.endswith(".py:1 f")
    assert len(wire.encode(_step(1, events))) < 6000


def _step(number: int, events: Any) -> schema.Step:
    """An otherwise empty step carrying `events`."""
    empty = schema.Piles()
    return schema.Step(
        step=number, t_start=0, t_end=1, end=empty, max=empty, peak=empty, alloc_events=events
    )


def test_alloc_events_round_trip_the_wire() -> None:
    events = summarize(
        [entry("alloc", 3 * MIB, 1, IN_MODEL), entry("oom", 9 * MIB, 2, IN_MODEL)],
        expected_allocations=5,
        cwd="/work/job",
    )
    step = _step(3, events)
    end = schema.End(time=2.0, status="error", oom=True, alloc_events=events)
    decoder = wire.FrameDecoder()
    decoded = list(decoder.feed(wire.preamble() + wire.encode(step) + wire.encode(end)))
    assert decoded == [step, end]
    # A frame without events decodes as before: the field is optional and omitted.
    plain = msgspec.structs.replace(step, alloc_events=None)
    assert b"alloc_events" not in wire.encode(plain)


# ----- the recorder, over a stand-in for torch --------------------------------------------------


class FakeCudaMemory:
    """The calls `AllocEventsRecorder` makes, over a ring the test fills."""

    def __init__(self, available: bool = True, lazy: bool = True, clear: bool = True) -> None:
        self.available = available
        self.lazy = lazy
        self.clear = clear
        self.queued: list[Any] = []
        self.history_calls: list[dict[str, Any]] = []
        self.stopped = False
        self.ring: list[dict[str, Any]] = []
        self.fail_with: Exception | None = None
        self.snapshot_value: Any = None

    def is_available(self) -> bool:
        return self.available

    def lazy_call(self, callback: Any) -> bool:
        if not self.lazy:
            return False
        self.queued.append(callback)
        return True

    def init_cuda(self) -> None:
        """What torch's `_lazy_init` does with queued calls."""
        for callback in self.queued:
            callback()

    def parameters(self) -> set[str]:
        names = {"enabled", "context", "stacks", "max_entries", "skip_actions"}
        return names | ({"clear_history"} if self.clear else set())

    def record_history(self, **kwargs: Any) -> None:
        self.history_calls.append(kwargs)
        if kwargs.get("clear_history"):
            self.ring.clear()

    def stop_history(self) -> None:
        self.stopped = True

    def snapshot(self) -> Any:
        if self.fail_with is not None:
            raise self.fail_with
        if self.snapshot_value is not None:
            return self.snapshot_value
        ring = list(self.ring)
        self.ring.append(entry("snapshot", 0, (ring[-1]["time_us"] + 1) if ring else 0))
        return {"segments": [], "device_traces": [ring]}

    def skip_prefixes(self) -> tuple[str, ...]:
        return (TORCH + "/",)


class Reports:
    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []
        self.notes: list[tuple[str, str]] = []

    def fail(self, component: str, exc: BaseException) -> None:
        self.failures.append((component, f"{type(exc).__name__}: {exc}"))

    def note(self, component: str, message: str) -> None:
        self.notes.append((component, message))


def recorder(api: FakeCudaMemory, reports: Reports, **options: Any) -> AllocEventsRecorder:
    return AllocEventsRecorder(fail=reports.fail, note=reports.note, api=api, **options)


def test_recording_starts_when_the_job_initialises_cuda_and_each_close_drains_its_step() -> None:
    api, reports = FakeCudaMemory(), Reports()
    rec = recorder(api, reports)
    assert rec.arm() is True
    assert api.history_calls == []  # armed, but no CUDA context created by the agent
    assert rec.never_started()  # a job that ends now never used CUDA: the agent says so
    api.init_cuda()
    assert not rec.never_started()
    assert api.history_calls == [
        {
            "context": "alloc",
            "stacks": "python",
            "max_entries": MAX_ENTRIES,
            "skip_actions": ["free_requested", "free_completed"],
        }
    ]
    api.ring += [entry("alloc", 5 * MIB, 1, IN_MODEL), entry("alloc", MIB, 2, IN_OPTIMIZER)]
    drained = rec.drain(expected_allocations=2)
    assert isinstance(drained, Drained) and len(drained.entries) == 2
    # The ring is cleared after the read, with the same settings.
    assert api.history_calls[-1] == {**api.history_calls[0], "clear_history": True}
    assert api.ring == []
    events = drained.summary()
    assert events is not None and events.largest[0].size == 5 * MIB and events.lost == 0
    api.ring += [entry("alloc", 7 * MIB, 10, IN_MODEL)]
    second = rec.drain(expected_allocations=3)
    assert second is not None and [item["size"] for item in second.entries] == [7 * MIB]
    assert second.summary().lost == 2  # type: ignore[union-attr]
    assert reports.failures == [] and reports.notes == []


def test_without_clear_history_the_cursor_still_reads_only_the_new_step() -> None:
    api, reports = FakeCudaMemory(clear=False), Reports()
    rec = recorder(api, reports)
    rec.arm()
    api.init_cuda()
    api.ring += [entry("alloc", MIB, 1, IN_MODEL)]
    assert len(rec.drain(1).entries) == 1  # type: ignore[union-attr]
    api.ring += [entry("alloc", 2 * MIB, 5, IN_MODEL)]
    entries = rec.drain(1).entries  # type: ignore[union-attr]
    assert [item["action"] for item in entries] == ["snapshot", "alloc"]
    assert all(not call.get("clear_history") for call in api.history_calls)


def test_with_snapshot_on_oom_the_history_keeps_frees_and_is_never_cleared() -> None:
    api, reports = FakeCudaMemory(), Reports()
    rec = recorder(api, reports, keep_frees=True)
    rec.arm()
    api.init_cuda()
    assert api.history_calls == [{"context": "all", "stacks": "python", "max_entries": 100_000}]
    api.ring += [entry("alloc", MIB, 1, IN_MODEL)]
    rec.drain(1)
    assert len(api.history_calls) == 1 and api.ring  # not cleared


def test_without_the_lazy_hook_recording_starts_at_the_first_close() -> None:
    api, reports = FakeCudaMemory(lazy=False), Reports()
    rec = recorder(api, reports)
    assert rec.arm() is True and api.history_calls == []
    assert rec.drain(expected_allocations=50) is None  # starts now; step 1 was not recorded
    assert len(api.history_calls) == 1
    api.ring += [entry("alloc", MIB, 1, IN_MODEL)]
    drained = rec.drain(expected_allocations=50)
    # The first window began mid-step: the counter cannot say what the ring lost.
    assert drained is not None and drained.expected_allocations is None
    assert rec.drain(expected_allocations=4).expected_allocations == 4  # type: ignore[union-attr]


def test_a_cpu_job_gets_one_note_and_no_recording() -> None:
    api, reports = FakeCudaMemory(available=False), Reports()
    rec = recorder(api, reports)
    assert rec.arm() is False
    assert reports.notes and "has no effect" in reports.notes[0][1]
    assert rec.drain(3) is None and rec.unfinished() is None
    assert not rec.never_started()  # the note is already said; no second one at the end
    assert api.history_calls == [] and reports.failures == []


def test_a_failing_read_turns_the_feature_off_once() -> None:
    api, reports = FakeCudaMemory(), Reports()
    rec = recorder(api, reports)
    rec.arm()
    api.init_cuda()
    api.fail_with = RuntimeError("Calling snapshot with backend:cudaMallocAsync is not meaningful")
    assert rec.drain(1) is None
    assert rec.drain(1) is None
    assert reports.failures == [
        (
            "alloc-events",
            "RuntimeError: Calling snapshot with backend:cudaMallocAsync is not meaningful",
        )
    ]
    assert api.stopped  # nobody reads the ring any more: stop paying for it


def test_a_snapshot_without_device_traces_turns_the_feature_off() -> None:
    api, reports = FakeCudaMemory(), Reports()
    rec = recorder(api, reports)
    rec.arm()
    api.init_cuda()
    api.snapshot_value = [{"segments": "the pre-2.0 list format"}]
    assert rec.drain(1) is None
    assert reports.failures and "device_traces" in reports.failures[0][1]


def test_a_failing_start_inside_cuda_init_never_raises_into_torch() -> None:
    api, reports = FakeCudaMemory(), Reports()

    def refuse(**kwargs: Any) -> None:
        raise TypeError("unexpected keyword argument 'stacks'")

    api.record_history = refuse  # type: ignore[method-assign]
    rec = recorder(api, reports)
    rec.arm()
    api.init_cuda()  # would raise DeferredCudaCallError in the job if the callback raised
    assert reports.failures[0][0] == "alloc-events" and rec.drain(1) is None


def test_the_unfinished_step_holds_the_oom_that_ended_the_job() -> None:
    api, reports = FakeCudaMemory(), Reports()
    rec = recorder(api, reports)
    rec.arm()
    api.init_cuda()
    rec.drain(0)
    api.ring += [
        entry("alloc", 2 * MIB, 5, IN_MODEL),
        entry("oom", 3 * 2**30, 6, IN_MODEL, device_free=100 * MIB),
    ]
    events = rec.unfinished()
    assert events is not None and events.oom is not None
    assert events.oom.size == 3 * 2**30 and events.oom_free == 100 * MIB
    assert rec.unfinished() is None  # nothing new since


def test_the_frame_builder_summarises_the_drained_events() -> None:
    drained = Drained([entry("alloc", 9 * MIB, 1, IN_MODEL)], False, 1, (), "/work/job")
    inputs = StepInputs(1, 0.0, 1.0, CloseReading(1), Verdict(measured=True), alloc_events=drained)
    step = build_step(inputs, HostValues())
    assert step.alloc_events is not None
    assert step.alloc_events.largest == [schema.AllocEvent(9 * MIB, 1, "model.py:42 forward")]


# ----- the viewer -------------------------------------------------------------------------------


def gpu_events(step: int) -> schema.AllocEvents:
    """A step's events as a GPU job would record them (sizes grow with the step number)."""
    return schema.AllocEvents(
        largest=[
            schema.AllocEvent(step * 64 * MIB, 12, "model.py:42 forward"),
            schema.AllocEvent(16 * MIB, 3, "train.py:88 main"),
        ],
        segments=[schema.AllocEvent(80 * MIB, 1, "model.py:42 forward")] if step == 2 else [],
        allocations=400 + step,
        alloc_bytes=step * 900 * MIB,
        segment_allocs=1 if step == 2 else 0,
        segment_bytes=80 * MIB if step == 2 else 0,
        lost=7 if step == 4 else 0,
    )


OOM_EVENTS = schema.AllocEvents(
    largest=[schema.AllocEvent(2 * 2**30, 1, "model.py:42 forward")],
    allocations=30,
    alloc_bytes=3 * 2**30,
    oom=schema.AllocEvent(6 * 2**30, 1, "model.py:57 forward"),
    oom_free=512 * MIB,
)


def recorded_messages(builder: Any, with_events: bool = True) -> list[schema.Message]:
    """The fixture run with events on steps 1-4, ended by an OOM in step 5."""
    # hello, names, steps 1-4
    messages: list[schema.Message] = builder.demo_messages(with_end=False)[:6]
    if with_events:
        messages = [
            msgspec.structs.replace(m, alloc_events=gpu_events(m.step))
            if isinstance(m, schema.Step)
            else m
            for m in messages
        ]
    messages.append(
        schema.End(
            time=messages[-1].t_end + 1,  # type: ignore[union-attr]
            status="error",
            code=1,
            error_type="OutOfMemoryError",
            error="CUDA out of memory",
            step=5,
            phase="forward",
            oom=True,
            alloc_events=OOM_EVENTS if with_events else None,
        )
    )
    return messages


def test_session_lists_the_cursor_steps_events_and_the_unfinished_step(builder: Any) -> None:
    session = Session(live=False)
    session.ingest(recorded_messages(builder))
    rows = session.view_state().allocations.rows
    labels = [row.label for row in rows]
    # The newest step, then the step the job died in, OOM first among its rows.
    assert labels[:4] == ["step", "alloc", "alloc", "ring full"]
    assert labels[4:7] == ["step 5 (never closed)", "OOM", "alloc"]
    assert [row.kind for row in rows[:7]] == [
        AllocKind.HEADING,
        AllocKind.ALLOC,
        AllocKind.ALLOC,
        AllocKind.RING_FULL,
        AllocKind.HEADING,
        AllocKind.OOM,
        AllocKind.ALLOC,
    ]
    oom = rows[5]
    assert oom.size == 6 * 2**30 and "model.py:57 forward" in oom.where
    assert "512.00 MiB free on the device" in oom.where
    session.move(-2)
    rows = session.view_state().allocations.rows
    assert [row.label for row in rows] == ["step", "alloc", "alloc", "segment +"]
    assert rows[-1].kind is AllocKind.SEGMENT
    assert rows[1].size == 2 * 64 * MIB and rows[1].count == 12


def test_session_without_events_has_no_allocation_rows(builder: Any) -> None:
    session = Session(live=False)
    session.ingest(recorded_messages(builder, with_events=False))
    snap = session.view_state().allocations
    assert not snap.recorded and snap.rows == ()


def test_rows_say_when_a_step_has_no_history() -> None:
    assert [(row.kind, row.label) for row in alloc_rows(None)] == [(AllocKind.NONE, "none")]
    assert [row.label for row in alloc_rows(None, unfinished=OOM_EVENTS, has_step=False)][:2] == [
        "last step (never closed)",
        "OOM",
    ]


def test_pilot_lists_the_events_of_the_cursor_step(tui: Any, builder: Any) -> None:
    app = MemtuiApp(tui.source(recorded_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        box = app.query_one("#allocations-box")
        assert box.display
        table = app.query_one(AllocationsTable)
        cells = [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]
        assert cells[0][0] == "step" and cells[0][2] == "x404"
        assert ["alloc", "256.00 MiB", "x12", "model.py:42 forward"] in cells
        assert any(row[0] == "OOM" and row[1] == "6.00 GiB" for row in cells)
        await pilot.press("left", "left")
        cells = [[str(cell) for cell in table.get_row_at(i)] for i in range(table.row_count)]
        assert ["alloc", "128.00 MiB", "x12", "model.py:42 forward"] in cells
        assert ["segment +", "80.00 MiB", "x1", "model.py:42 forward"] in cells
        assert not any(row[0] == "OOM" for row in cells)  # only on the newest step

    tui.drive(app, body)


def test_pilot_hides_the_table_without_events(tui: Any, demo_messages: Any) -> None:
    app = MemtuiApp(tui.source(demo_messages, live=False))

    async def body(pilot: Pilot[Any]) -> None:
        assert not app.query_one("#allocations-box").display

    tui.drive(app, body)


def test_report_adds_alloc_events_per_step_and_for_the_unfinished_step(builder: Any) -> None:
    messages = recorded_messages(builder)
    recording = Recording(path=Path("rec.memtui"), hello=messages[0])  # type: ignore[arg-type]
    recording.steps = [m for m in messages if isinstance(m, schema.Step)]
    recording.end = messages[-1]  # type: ignore[assignment]
    report = build_report(recording)
    assert report["steps"][1]["alloc_events"] == events_dict(gpu_events(2))
    assert report["steps"][0]["alloc_events"]["largest"][0] == {
        "size": 64 * MIB,
        "count": 12,
        "where": "model.py:42 forward",
    }
    assert report["exit"]["alloc_events"]["oom"] == {
        "size": 6 * 2**30,
        "count": 1,
        "where": "model.py:57 forward",
        "device_free": 512 * MIB,
    }
    json.dumps(report)
    text = render_text(recording)
    assert "allocator events (--alloc-events): 5 step(s) recorded" in text
    assert "out of memory at step 5: 6.00 GiB requested, 512.00 MiB free" in text
    assert events_text([], None) == []


def test_report_of_a_recording_without_events_has_no_new_keys(builder: Any) -> None:
    messages = recorded_messages(builder, with_events=False)
    recording = Recording(path=Path("rec.memtui"), hello=messages[0])  # type: ignore[arg-type]
    recording.steps = [m for m in messages if isinstance(m, schema.Step)]
    recording.end = messages[-1]  # type: ignore[assignment]
    report = build_report(recording)
    assert all("alloc_events" not in step for step in report["steps"])
    assert "alloc_events" not in report["exit"]
    assert "allocator events" not in render_text(recording)


# ----- the real agent in a job ------------------------------------------------------------------


def _job_env(tmp_path: Path) -> dict[str, str]:
    """This environment without any MEMTUI_ setting, with a private runtime folder."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEMTUI_")}
    env["MEMTUI_RUNTIME_DIR"] = str(tmp_path / "rt")
    return env


CPU_JOB = """
import torch
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
"""


@pytest.mark.slow
def test_cli_flag_on_a_cpu_job_runs_and_records_one_note(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(CPU_JOB)
    env = _job_env(tmp_path)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "memtui",
            "run",
            "--headless",
            "--alloc-events",
            "-o",
            "rec.memtui",
            "train.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if "--alloc-events" in line]
    assert len(notes) == 1 and "has no effect" in notes[0]
    recording = read_recording(tmp_path / "rec.memtui")
    assert len(recording.steps) == 3
    assert [e.component for e in recording.agent_errors] == ["alloc-events"]
    assert all(step.alloc_events is None for step in recording.steps)
    assert recording.end is not None and recording.end.status == "ok"


# What a CUDA job looks like to the agent, on a CPU build: torch.cuda answers as if a device were
# in use, and the allocator's ring holds entries the "job" appends as it goes.
FAKE_CUDA_JOB = r"""
import torch, memtui_agent
import torch.cuda.memory as cuda_memory

state = {"init": False, "allocations": 0, "time": 0}
ring, queued = [], []
cuda = torch.cuda
cuda.is_available = lambda: True
cuda.is_initialized = lambda: state["init"]
cuda.current_device = lambda: 0
cuda.mem_get_info = lambda device=None: (70 * 2**30, 80 * 2**30)
cuda.memory_reserved = lambda device=None: 0
cuda.memory_allocated = lambda device=None: 0
cuda._lazy_call = lambda fn, **kw: fn() if state["init"] else queued.append(fn)
cuda.memory_stats = lambda device=None: {
    "allocated_bytes.all.current": 2**30, "reserved_bytes.all.current": 2 * 2**30,
    "allocated_bytes.all.peak": 2**30, "allocation.all.allocated": state["allocations"],
}

def record(enabled="all", **kwargs):
    if kwargs.get("clear_history"):
        ring.clear()

cuda_memory._record_memory_history = record
cuda_memory._snapshot = lambda *a, **k: {"segments": [], "device_traces": [list(ring)]}

def allocate(action, size, **extra):
    # What the caching allocator appends to its ring, stack innermost first.
    state["time"] += 1
    state["allocations"] += action == "alloc"
    frames = [{"filename": torch.__file__, "line": 1, "name": "inner"},
              {"filename": __file__, "line": 77, "name": "train_step"}]
    ring.append({"action": action, "addr": 1, "size": size, "stream": 0,
                 "time_us": state["time"], "frames": frames, **extra})

memtui_agent.start("rec.memtui", socket=False, alloc_events=True)
try:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state["init"] = True  # the job's first CUDA call: torch runs the queued callbacks
    for fn in queued:
        fn()
    for step in range(1, 4):
        opt.zero_grad()
        model(torch.randn(2, 8)).sum().backward()
        allocate("alloc", step * 2**20)
        allocate("segment_alloc", 20 * 2**20)
        opt.step()
    allocate("alloc", 5 * 2**20)
    allocate("oom", 6 * 2**30, device_free=2**29)
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")
except BaseException as exc:
    memtui_agent.stop(exit_code=1, error=exc)
    raise
"""


@pytest.mark.slow
def test_agent_records_each_steps_events_and_the_oom_through_the_real_closer(
    tmp_path: Path,
) -> None:
    (tmp_path / "job.py").write_text(FAKE_CUDA_JOB)
    env = _job_env(tmp_path)
    result = subprocess.run(
        [sys.executable, "job.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "alloc-events" not in result.stderr
    recording = read_recording(tmp_path / "rec.memtui")
    assert [e.component for e in recording.agent_errors if e.component == "alloc-events"] == []
    assert len(recording.steps) == 3
    for number, step in enumerate(recording.steps, start=1):
        events = step.alloc_events
        assert events is not None, f"step {number} has no events"
        assert events.largest == [schema.AllocEvent(number * 2**20, 1, "job.py:77 train_step")]
        assert events.segment_allocs == 1 and events.lost == 0 and not events.overflowed
    end = recording.end
    assert end is not None and end.oom and end.alloc_events is not None
    assert end.alloc_events.oom == schema.AllocEvent(6 * 2**30, 1, "job.py:77 train_step")
    assert end.alloc_events.oom_free == 2**29
