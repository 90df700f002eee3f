"""The Session model without an app: cursor, alerts, units, pause, state line, gap and pile rows.

Everything the screen shows is computed here, so these tests pin the behaviour the pilot and
snapshot tests only sample. They feed the fixture run's messages exactly as a source would.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import msgspec
import pytest

import memtui.session as session_module
from memtui.session import GAP_MEANINGS, Session, gap_rows, pile_rows
from memtui_agent import schema

StepFactory = Callable[[int], schema.Step]


def ingested(messages: list[schema.Message], *, live: bool = False) -> Session:
    session = Session(source_label="fixture", live=live)
    session.ingest(messages)
    return session


def cursor_step(session: Session) -> int:
    assert session.cursor is not None
    return session.steps[session.cursor].step


def test_ingest_puts_the_cursor_on_the_last_step(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages)
    assert session.hello is not None and session.hello.pid == 4242
    assert len(session.steps) == 24
    assert session.cursor == 23
    assert session.module_names[5] == "blocks.0.mlp"
    assert session.end is not None and session.end.status == "ok"
    assert [(alert.step, alert.kind) for alert in session.alerts] == [
        (1, "first_step_growth"),
        (9, "skipped_step"),
        (17, "nonfinite_loss"),
    ]
    snap = session.snapshot()
    assert (snap.step, snap.steps_total, snap.cursor_step) == (24, 24, 24)
    assert snap.job == "python train.py"
    assert snap.title == "pid 4242 · cpu · torch 2.13.0+cpu"
    assert snap.steps_per_second == pytest.approx(4.0)
    assert snap.top_activations[0][0] == "blocks.0.mlp"
    assert snap.microbatches == 2


def test_version_moves_only_when_something_changed(demo_messages: list[schema.Message]) -> None:
    """The app skips redraws on an unchanged version, so an empty batch must not bump it."""
    session = ingested(demo_messages)
    before = session.version
    session.ingest([])
    assert session.version == before
    session.move(-1)
    assert session.version > before


def test_move_home_end_and_jump(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages)
    session.move(-2)
    assert cursor_step(session) == 22
    assert not session.follow
    session.move(-100)
    assert cursor_step(session) == 1
    session.move(+100)
    assert cursor_step(session) == 24
    assert session.follow
    session.home()
    assert cursor_step(session) == 1
    session.end_key()
    assert cursor_step(session) == 24
    session.jump_to_step(13)
    assert cursor_step(session) == 13
    session.jump_to_step(999)  # no such step: the cursor stays
    assert cursor_step(session) == 13


def test_moving_without_steps_is_harmless() -> None:
    session = Session(live=True)
    session.move(-1)
    session.home()
    session.end_key()
    session.next_alert(1)
    assert session.cursor is None
    snap = session.snapshot()
    assert snap.step is None and snap.piles == () and snap.gap == ()


def test_alert_navigation_lands_on_alert_steps(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages)
    visited = []
    for _ in range(4):
        session.next_alert(-1)
        visited.append(cursor_step(session))
    assert visited == [17, 9, 1, 1]
    visited = []
    for _ in range(3):
        session.next_alert(1)
        visited.append(cursor_step(session))
    assert visited == [9, 17, 17]


def test_alert_steps_carry_their_flags(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages)
    session.jump_to_step(9)
    assert session.snapshot().skipped
    session.jump_to_step(17)
    loss = session.snapshot().loss
    assert loss is not None and math.isnan(loss)


def test_toggle_units_flips_binary(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages)
    assert session.snapshot().binary
    session.toggle_units()
    assert not session.snapshot().binary
    session.toggle_units()
    assert session.snapshot().binary


def test_pause_freezes_the_cursor_and_resume_jumps_to_newest(
    live_messages: list[schema.Message], make_step: StepFactory
) -> None:
    session = ingested(live_messages, live=True)
    assert session.state_text() == "live"
    session.toggle_pause()
    assert session.state_text() == "paused"
    session.ingest([make_step(25), make_step(26)])
    assert len(session.steps) == 26
    assert cursor_step(session) == 24
    assert session.snapshot().steps_total == 26
    session.toggle_pause()
    assert session.state_text() == "live"
    assert cursor_step(session) == 26
    session.ingest([make_step(27)])
    assert cursor_step(session) == 27


def test_moving_back_stops_following_live_frames(
    live_messages: list[schema.Message], make_step: StepFactory
) -> None:
    session = ingested(live_messages, live=True)
    session.move(-3)
    session.ingest([make_step(25)])
    assert cursor_step(session) == 21
    session.end_key()
    session.ingest([make_step(26)])
    assert cursor_step(session) == 26


def test_state_text_live_and_waiting(live_messages: list[schema.Message]) -> None:
    assert Session(live=True).state_text() == "waiting for the job"
    assert ingested(live_messages, live=True).state_text() == "live"


def test_state_text_replay(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages)
    assert session.state_text() == "replay step 24 of 24 · ended: ok (exit 0)"
    session.home()
    assert session.state_text() == "replay step 1 of 24 · ended: ok (exit 0)"


def test_state_text_replay_of_a_recording_without_end(live_messages: list[schema.Message]) -> None:
    """DESIGN: a recording without its final frame reports `killed`."""
    session = ingested(live_messages)
    assert session.state_text() == "replay step 24 of 24 · killed (no final frame)"


def test_state_text_ended_ok(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages, live=True)
    assert session.state_text() == "ended: ok (exit 0)"


def test_state_text_ended_with_error(live_messages: list[schema.Message]) -> None:
    session = ingested(live_messages, live=True)
    session.ingest(
        [
            schema.End(
                time=0.0,
                status="error",
                code=1,
                error_type="RuntimeError",
                error="CUDA error: device-side assert triggered",
                step=25,
                phase="backward",
            )
        ]
    )
    assert session.state_text() == (
        "ended: error (exit 1) at step 25 in backward: "
        "RuntimeError: CUDA error: device-side assert triggered"
    )


def test_end_alerts_are_listed_under_their_step(live_messages: list[schema.Message]) -> None:
    oom = schema.Alert(kind="oom", message="out of memory in forward of step 25", where="head")
    session = ingested(live_messages, live=True)
    session.ingest([schema.End(time=0.0, status="error", code=1, step=25, alerts=[oom])])
    assert session.alerts[-1].step == 25
    assert session.snapshot().alerts[0].kind == "oom"


def test_state_text_killed_live_job(live_messages: list[schema.Message]) -> None:
    """A live stream that stops without an End: the reason is shown, as an ending.

    The word "killed" only appears for replays (see the report): here the line is the
    disconnect reason, which is what `mark_disconnected` was given.
    """
    session = ingested(live_messages, live=True)
    session.mark_disconnected("the job closed its socket")
    assert session.state_text() == "ended: the job closed its socket"
    assert session.end is None


def test_gap_rows_on_cpu_mark_gpu_levels_not_applicable(
    demo_messages: list[schema.Message],
) -> None:
    session = ingested(demo_messages)
    rows = session.snapshot().gap
    assert [row.label for row in rows] == [
        "tracked at step end",
        "process RSS",
        "system used",
        "system total",
        "torch allocated",
        "torch reserved",
        "process GPU (NVML)",
        "device used",
        "device total",
    ]
    step = session.steps[-1]
    assert rows[0].value == step.end.total
    assert rows[1].delta == step.host.rss - step.end.total
    gpu_rows = rows[4:]
    assert all(not row.applicable for row in gpu_rows)
    assert all(row.value is None and row.delta is None for row in gpu_rows)
    assert all("not applicable" in row.meaning for row in gpu_rows)
    assert not any(row.value == 0 or row.delta == 0 for row in rows)


def test_gap_rows_on_gpu_give_ordered_deltas_and_meanings(make_step: StepFactory) -> None:
    step = make_step(5)
    tracked = step.end.total
    allocator = schema.Allocator(
        allocated=tracked + 100,
        reserved=tracked + 1_100,
        peak_allocated=step.peak.total + 5_000,
        process_gpu=tracked + 501_100,
        device_used=tracked + 2_501_100,
        device_total=tracked + 12_501_100,
    )
    rows = gap_rows(msgspec.structs.replace(step, allocator=allocator))
    assert [(row.label, row.delta) for row in rows] == [
        ("tracked at step end", None),
        ("torch allocated", 100),
        ("torch reserved", 1_000),
        ("process GPU (NVML)", 500_000),
        ("device used", 2_000_000),
        ("device total", 10_000_000),
    ]
    assert [row.meaning for row in rows[1:]] == [
        GAP_MEANINGS[key]
        for key in ("allocated", "reserved", "process_gpu", "device_used", "device_total")
    ]
    assert all(row.applicable for row in rows)


def test_gap_rows_on_gpu_skip_a_missing_level(make_step: StepFactory) -> None:
    """Without NVML the process level is unknown; the next delta is taken from reserved."""
    step = make_step(5)
    tracked = step.end.total
    allocator = schema.Allocator(
        allocated=tracked, reserved=tracked + 10, device_total=tracked + 30
    )
    rows = gap_rows(msgspec.structs.replace(step, allocator=allocator))
    by_label = {row.label: row for row in rows}
    assert by_label["process GPU (NVML)"].value is None
    assert by_label["process GPU (NVML)"].delta is None
    assert by_label["device total"].delta == 20


def test_pile_rows_shares_sum_to_one(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages)
    for index in (0, 8, 12, 23):
        session.cursor = index
        rows = session.snapshot().piles
        assert [row.name for row in rows] == [
            "weights",
            "gradients",
            "optimizer_state",
            "activations",
            "other",
        ]
        assert sum(row.share for row in rows) == pytest.approx(1.0)
        other = rows[-1]
        assert other.at_peak is None and other.share == 0.0  # CPU: no allocator counter


def test_pile_rows_on_gpu_derive_other_from_the_allocator_peak(make_step: StepFactory) -> None:
    step = make_step(3)
    step = msgspec.structs.replace(
        step, allocator=schema.Allocator(peak_allocated=step.peak.total + 1_000_000)
    )
    rows = pile_rows(step)
    assert rows[-1].name == "other" and rows[-1].at_peak == 1_000_000
    assert sum(row.share for row in rows) == pytest.approx(1.0)


def test_first_step_peak_has_no_optimizer_state(demo_messages: list[schema.Message]) -> None:
    """The state appears when step 1 closes: in `end` and `max`, not at the step's peak."""
    session = ingested(demo_messages)
    session.home()
    rows = {row.name: row for row in session.snapshot().piles}
    assert rows["optimizer_state"].at_peak == 0
    assert rows["optimizer_state"].step_max == session.steps[0].end.optimizer_state > 0


def test_bf16_phase_shows_in_dtypes(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages)
    session.jump_to_step(12)
    assert ("activations", "bfloat16") not in {row[:2] for row in session.snapshot().dtypes}
    session.jump_to_step(13)
    dtypes = session.snapshot().dtypes
    assert ("activations", "bfloat16") in {row[:2] for row in dtypes}
    activations = [row for row in dtypes if row[0] == "activations"]
    assert [row[2] for row in activations] == sorted((row[2] for row in activations), reverse=True)


def test_history_is_bounded(
    monkeypatch: pytest.MonkeyPatch, live_messages: list[schema.Message], make_step: StepFactory
) -> None:
    """Past MAX_STEPS the oldest tenth goes at once; a cursor on an older step stays on it."""
    monkeypatch.setattr(session_module, "MAX_STEPS", 20)
    session = ingested(live_messages, live=True)  # 24 steps: cut by 2 at the 21st and 23rd
    assert [step.step for step in session.steps] == list(range(5, 25))
    assert session.dropped_steps == 4
    assert cursor_step(session) == 24
    assert "4 oldest steps dropped from the view" in session.snapshot().notes

    session.jump_to_step(10)
    session.ingest([make_step(number) for number in (25, 26, 27)])
    assert [step.step for step in session.steps] == list(range(9, 28))
    assert cursor_step(session) == 10
    session.ingest([make_step(number) for number in (28, 29)])  # step 10 itself is cut
    assert session.steps[0].step == 11
    assert session.cursor == 0


def test_thousand_steps_in_one_batch(
    live_messages: list[schema.Message], make_step: StepFactory
) -> None:
    session = ingested(live_messages[:2], live=True)
    session.ingest([make_step(number) for number in range(1, 1001)])
    assert len(session.steps) == 1000
    assert cursor_step(session) == 1000
    snap = session.snapshot(timeline_width=100)
    assert len(snap.timeline_steps) == 100
    assert snap.timeline_steps[-1] == 1000
    assert snap.steps_per_second == pytest.approx(4.0)
    assert len(session._step_times) <= 256
