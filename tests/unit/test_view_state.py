"""The view state's slices, built by pure functions: one per panel, rows keyed by identities,
and equal whenever the panel's data did not move (so the app skips that widget)."""

from __future__ import annotations

import dataclasses
from types import ModuleType

import msgspec

from memtui.model.session import Session
from memtui.model.step_rows import module_rows
from memtui.model.view_state import ViewState, activations_view
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, Severity

SLICES = [field.name for field in dataclasses.fields(ViewState)]


def changed(before: ViewState, after: ViewState) -> set[str]:
    """The slices that differ: the widgets a redraw would touch."""
    return {name for name in SLICES if getattr(before, name) != getattr(after, name)}


def ingested(messages: list[schema.Message], live: bool = True) -> Session:
    session = Session(source_label="fixture", live=live)
    session.ingest(messages)
    return session


def test_an_unchanged_session_gives_equal_slices(demo_messages: list[schema.Message]) -> None:
    session = ingested(demo_messages, live=False)
    assert changed(session.view_state(), session.view_state()) == set()


def test_a_new_step_while_paused_moves_only_the_header_and_the_chart(
    live_messages: list[schema.Message], make_step: object
) -> None:
    session = ingested(live_messages)
    session.toggle_pause()
    before = session.view_state()
    session.ingest([make_step(25)])  # type: ignore[operator]
    assert changed(before, session.view_state()) == {"header", "timeline"}


def test_moving_the_cursor_moves_only_what_differs(demo_messages: list[schema.Message]) -> None:
    """Steps 23 and 24 of the fixture close with the same piles and host memory: the gap panel
    stays as it is, the panels of the step's own peak and activations move."""
    session = ingested(demo_messages, live=False)
    before = session.view_state()
    session.move(-1)
    assert changed(before, session.view_state()) == {
        "header",
        "piles",
        "timeline",
        "dtypes",
        "activations",
    }


def test_the_units_key_moves_every_slice_that_shows_bytes(
    demo_messages: list[schema.Message],
) -> None:
    session = ingested(demo_messages, live=False)
    before = session.view_state()
    session.toggle_units()
    assert changed(before, session.view_state()) == {
        "piles",
        "gap",
        "timeline",
        "dtypes",
        "activations",
        "allocations",
    }


def test_two_modules_of_one_name_are_two_rows_keyed_by_id(builder: ModuleType) -> None:
    session = ingested(builder.two_models_messages(), live=False)
    for cursor in range(len(session.steps)):
        session.cursor = cursor
        rows = session.view_state().activations.rows
        assert sorted(row.label for row in rows) == ["Net", "Net", "fc1", "fc1", "fc2", "fc2"]
        assert sorted(row.module for row in rows) == [0, 1, 2, 3, 4, 5]
        assert len({row.key for row in rows}) == len(rows)


def test_a_module_listed_twice_still_gets_unique_keys(make_step: object) -> None:
    """A damaged or hostile recording may list one id twice: never a crash."""
    step = msgspec.structs.replace(
        make_step(1),  # type: ignore[operator]
        top_activations=[schema.ModuleBytes(3, 10), schema.ModuleBytes(3, 5)],
    )
    rows = module_rows(step, {3: "fc1"})
    assert [row.key for row in rows] == ["module-3", "module-3-2"]
    assert activations_view(None, {}, True).rows == ()


def test_alert_rows_carry_the_kind_converted_once(live_messages: list[schema.Message]) -> None:
    """Kinds become `AlertKind` members at the fold; a newer agent's kind stays its string."""
    session = ingested(live_messages)
    session.ingest(
        [
            schema.AlertNow(time=0.0, step=3, alert=schema.Alert(kind="oom", message="x")),
            schema.AlertNow(time=0.0, step=4, alert=schema.Alert(kind="hbm_ecc", message="y")),
        ]
    )
    rows = session.view_state().alerts.rows
    kinds = [row.kind for row in rows]
    # The OOM (an error) leads the newer kind (a warning by default), though it came first.
    assert kinds.index(AlertKind.OOM) < kinds.index("hbm_ecc")
    oom, newer = rows[kinds.index(AlertKind.OOM)], rows[kinds.index("hbm_ecc")]
    assert oom.kind is AlertKind.OOM and oom.severity is Severity.ERROR
    assert not isinstance(newer.kind, AlertKind) and newer.severity is Severity.WARNING
    assert len({row.key for row in rows}) == len(rows)
    assert session.view_state().alerts.step_of(oom.key) == 3
