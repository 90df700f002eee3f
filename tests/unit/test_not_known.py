"""A step whose activations are not known (`activations_measured` false, `activations_from`
null) shows no activation figure anywhere: its frame's figures are partial, never the step's.

The recording is the fixture run where steps 13-24 carry step 12's figures except step 20,
which is not known and whose frame holds a partial activation figure larger than any real one
(as if it were a peak): no reader may present it as the step's, nor let it set a peak.
"""

from __future__ import annotations

import csv
import io
import json
from types import ModuleType

import msgspec
import pytest

from memtui.model.rank_rows import imbalance_line, rank_rows
from memtui.model.recording import Recording
from memtui.model.session import Session
from memtui.model.step_rows import Untracked
from memtui.reports.export import chrome_trace, render_csv
from memtui.reports.report import build_report, render_text
from memtui_protocol import schema
from memtui_protocol.schema import Pile

UNKNOWN = 20
PARTIAL = 999 * 1024 * 1024
"""The not-known step's partial activation figure: far above every real one."""


def _not_known(messages: list[schema.Message]) -> list[schema.Message]:
    out: list[schema.Message] = []
    for message in messages:
        if isinstance(message, schema.Step) and message.step > 12:
            source = None if message.step == UNKNOWN else 12
            message = msgspec.structs.replace(
                message, activations_measured=False, activations_from=source
            )
        if isinstance(message, schema.Step) and message.step == UNKNOWN:
            message = msgspec.structs.replace(
                message,
                end=msgspec.structs.replace(message.end, activations=PARTIAL),
                max=msgspec.structs.replace(message.max, activations=PARTIAL),
                peak=msgspec.structs.replace(message.peak, activations=PARTIAL),
            )
        out.append(message)
    return out


@pytest.fixture
def session(builder: ModuleType) -> Session:
    session = Session(source_label="fixture", live=False)
    session.ingest(_not_known(builder.demo_messages()))
    return session


@pytest.fixture
def recording(session: Session) -> Recording:
    assert session.recording is not None
    return session.recording


def test_the_panels_say_not_known_instead_of_a_figure(session: Session) -> None:
    session.jump_to_step(UNKNOWN)
    view = session.view_state()
    rows = {row.name: row for row in view.piles.rows}
    activations = rows[Pile.ACTIVATIONS]
    assert not activations.known and activations.at_peak is None and activations.step_max is None
    assert activations.share == 0.0 and all(
        row.known for row in view.piles.rows if row is not activations
    )
    assert not view.piles.activations_known
    tracked = view.gap.rows[0]
    assert (tracked.value, tracked.known) == (None, False)
    assert view.gap.rows[1].delta is None  # RSS minus an unknown total: unknown
    dtypes = [row for row in view.dtypes.rows if row.pile is Pile.ACTIVATIONS]
    assert [(row.bytes, row.storages) for row in dtypes] == [(None, None)]
    assert view.activations.rows == () and not view.activations.known
    index = view.timeline.steps.index(UNKNOWN)
    assert view.timeline.piles[index].activations is None
    assert view.timeline.unknown == frozenset({UNKNOWN})
    assert UNKNOWN not in view.timeline.carried and 19 in view.timeline.carried
    session.jump_to_step(19)  # a carried step keeps its figures
    view = session.view_state()
    assert {row.name: row for row in view.piles.rows}[Pile.ACTIVATIONS].at_peak
    assert view.piles.activations_known and view.activations.rows and view.gap.rows[0].value


def test_on_a_gpu_the_allocators_rest_is_not_known_either(builder: ModuleType) -> None:
    """`other` is the allocator's peak minus the piles: without the activations, not known."""
    messages = _not_known(builder.demo_messages())
    gpu = [
        msgspec.structs.replace(
            m, allocator=schema.Allocator(allocated=1 << 30, peak_allocated=1 << 31)
        )
        if isinstance(m, schema.Step)
        else m
        for m in messages
    ]
    session = Session(source_label="fixture", live=False)
    session.ingest(gpu)
    session.jump_to_step(UNKNOWN)
    rows = {row.name: row for row in session.view_state().piles.rows}
    assert not rows[Untracked.OTHER].known and rows[Untracked.OTHER].at_peak is None
    session.jump_to_step(19)
    assert {row.name: row for row in session.view_state().piles.rows}[Untracked.OTHER].at_peak


def test_the_text_report_counts_them_and_shows_no_figure_of_theirs(recording: Recording) -> None:
    text = render_text(recording)
    assert "not known on 1 (step " in text and "no activation figures are shown for them" in text
    assert "999" not in text
    assert (
        "peak (piles + DDP/FSDP buffers): 28.25 MiB at step 5 "
        "(of the steps whose activations are known)" in text
    )


def test_the_json_states_null_for_an_older_agents_partial_figure(recording: Recording) -> None:
    """An older agent's frame held what it saw of activations that are not known: the report
    (version 2) states null for them in `end`, `max`, `peak.piles` and `peak.total`, with the
    flags; the other piles keep the frame's figures, and the run-wide peaks leave the step
    out."""
    document = json.loads(json.dumps(build_report(recording)))
    assert document["version"] == 2
    step = document["steps"][UNKNOWN - 1]
    assert (step["activations_measured"], step["activations_from"]) == (False, None)
    for piles in (step["end"], step["max"], step["peak"]["piles"]):
        assert piles["activations"] is None and piles["weights"] > 0
    assert step["peak"]["total"] is None
    assert step["dtypes"]["activations"] == {} and step["top_activations"] == []
    carried = document["steps"][UNKNOWN - 2]
    assert carried["max"]["activations"] > 0 and carried["peak"]["total"] > 0
    assert "999" not in json.dumps(step)
    assert document["peaks"]["steady"] < PARTIAL


def test_the_csv_leaves_their_cells_empty(recording: Recording) -> None:
    rows = list(csv.DictReader(io.StringIO(render_csv(recording))))
    unknown, carried = rows[UNKNOWN - 1], rows[UNKNOWN - 2]
    for column in ("end_activations", "max_activations", "peak_activations", "peak_total"):
        assert unknown[column] == "", column
        assert carried[column] != "", column
    assert (unknown["activations_measured"], unknown["activations_from"]) == ("0", "")
    assert (carried["activations_measured"], carried["activations_from"]) == ("0", "12")
    assert unknown["max_weights"] == carried["max_weights"] != ""


def test_the_trace_draws_no_activations_for_them(recording: Recording) -> None:
    events = chrome_trace(recording)["traceEvents"]
    span = next(e for e in events if e.get("name") == f"step {UNKNOWN}")
    assert span["args"]["activations_known"] is False
    counters = [e for e in events if e["ph"] == "C" and e["ts"] == span["ts"] + span["dur"]]
    assert counters and all(Pile.ACTIVATIONS.value not in e["args"] for e in counters)
    assert any(Pile.WEIGHTS.value in e["args"] for e in counters)


def test_the_ranks_table_and_imbalance_do_not_compare_them(builder: ModuleType) -> None:
    steps = [m for m in _not_known(builder.demo_messages()) if isinstance(m, schema.Step)]
    latest: dict[str, schema.Step | None] = {"0": steps[UNKNOWN - 1], "1": steps[UNKNOWN - 2]}
    rows = {row.label: dict(row.piles) for row in rank_rows(latest, {})}
    assert rows["0"][Pile.ACTIVATIONS] is None and rows["1"][Pile.ACTIVATIONS]
    line = imbalance_line(latest)
    assert line is not None and "activations not known" in line and "weights equal" in line


# ----- this version's frames: null where the step does not know ----------------------------------


def _null_frames(messages: list[schema.Message]) -> list[schema.Message]:
    """The fixture as this version's agent writes a step not known (step 20): null activations
    in `end`, `max` and `peak`, and, its gradients counted at the close only, null gradients
    in `max` and `peak` (the weights and optimizer state were steady: known at the peak)."""
    out: list[schema.Message] = []
    for message in _not_known(messages):
        if isinstance(message, schema.Step) and message.step == UNKNOWN:
            end, high = message.end, message.max
            message = msgspec.structs.replace(
                message,
                end=schema.Piles(end.weights, end.gradients, end.optimizer_state, None),
                max=schema.Piles(high.weights, None, high.optimizer_state, None),
                peak=schema.Piles(end.weights, None, end.optimizer_state, None),
                dtypes={k: v for k, v in message.dtypes.items() if k != Pile.ACTIVATIONS},
                top_activations=[],
            )
        out.append(message)
    return out


@pytest.fixture
def null_session(builder: ModuleType) -> Session:
    session = Session(source_label="fixture", live=False)
    session.ingest(_null_frames(builder.demo_messages()))
    return session


def test_null_figures_read_as_not_known_in_every_panel(null_session: Session) -> None:
    null_session.jump_to_step(UNKNOWN)
    view = null_session.view_state()
    rows = {row.name: row for row in view.piles.rows}
    step = null_session.steps[UNKNOWN - 1]
    assert step.end.gradients is not None and step.end.gradients > 0
    gradients = rows[Pile.GRADIENTS]
    assert not gradients.known and gradients.at_peak is None and gradients.step_max is None
    weights = rows[Pile.WEIGHTS]
    assert weights.known and weights.at_peak == weights.step_max == step.end.weights
    assert not rows[Pile.ACTIVATIONS].known
    # The dtype panel lists the gradients the close counted: the frame's end, not a high.
    grads = [row for row in view.dtypes.rows if row.pile is Pile.GRADIENTS]
    assert sum(row.bytes or 0 for row in grads) == step.end.gradients
    index = view.timeline.steps.index(UNKNOWN)
    assert view.timeline.piles[index] == step.peak and UNKNOWN in view.timeline.unknown


def test_null_figures_in_the_json_csv_and_tensorboard_scalars(null_session: Session) -> None:
    from memtui.reports.tensorboard_export import step_scalars

    recording = null_session.recording
    assert recording is not None
    document = json.loads(json.dumps(build_report(recording)))
    step = document["steps"][UNKNOWN - 1]
    assert step["end"]["activations"] is None and step["end"]["gradients"] > 0
    assert step["max"]["gradients"] is None and step["max"]["activations"] is None
    assert step["peak"]["total"] is None and step["peak"]["piles"]["gradients"] is None
    rows = list(csv.DictReader(io.StringIO(render_csv(recording))))
    row = rows[UNKNOWN - 1]
    for column in ("max_gradients", "peak_gradients", "peak_total", "end_activations"):
        assert row[column] == "", column
    assert row["end_gradients"] != "" and row["peak_weights"] != ""
    scalars = step_scalars(recording.steps[UNKNOWN - 1])
    assert "piles/peak_total" not in scalars and "piles/max/gradients" not in scalars
    assert not any(tag.endswith("/activations") for tag in scalars)
    assert scalars["piles/end/gradients"] == recording.steps[UNKNOWN - 1].end.gradients
    assert "piles/peak_total" in step_scalars(recording.steps[UNKNOWN - 2])
    text = render_text(recording)
    assert "peak (piles + DDP/FSDP buffers): 28.25 MiB at step 5" in text
