"""The frame builder (`steps.frame.build_step`): a close's gathered inputs -> one `Step`.

Pure: no hooks, no training job, no torch tensors. Each test builds inputs by hand and checks
what the frame says, so the rules (gradients counted outside the ledger, carried activations,
the alerts' order, the skip's alert) are pinned where they are made.
"""

from __future__ import annotations

from typing import Any

import msgspec

from memtui_agent.memory.alloc_trace import Drained
from memtui_agent.steps.activation_policy import Figures, Verdict
from memtui_agent.steps.frame import (
    CloseReading,
    HostValues,
    LedgerReading,
    StepInputs,
    build_step,
)
from memtui_protocol import schema, wire
from memtui_protocol.schema import AlertKind, Pile

F32 = "float32"
END = schema.Piles(weights=1000, gradients=400, optimizer_state=800, activations=50)
HIGH = schema.Piles(weights=1000, gradients=400, optimizer_state=800, activations=3000)
PEAK = schema.Piles(weights=1000, gradients=0, optimizer_state=800, activations=3000)
DTYPES = {
    Pile.WEIGHTS: {F32: schema.DtypeStat(1000, 4)},
    Pile.GRADIENTS: {F32: schema.DtypeStat(400, 2)},
    Pile.OPTIMIZER_STATE: {F32: schema.DtypeStat(800, 8)},
    Pile.ACTIVATIONS: {F32: schema.DtypeStat(3000, 12)},
}
TOP = [schema.ModuleBytes(module=1, bytes=2000), schema.ModuleBytes(module=2, bytes=1000)]


def alert(kind: AlertKind, message: str = "m") -> schema.Alert:
    return schema.Alert(kind=kind, message=message)


def inputs(**changes: Any) -> StepInputs:
    """A measured optimizer step 7 as a close gathers it; `changes` replace fields."""
    ledger = LedgerReading(END, HIGH, PEAK, {k: dict(v) for k, v in DTYPES.items()}, list(TOP))
    base = StepInputs(
        step=7,
        t_start=10.0,
        t_end=10.5,
        reading=CloseReading(7, ledger, schema.Allocator(allocated=9000, reserved=12000)),
        verdict=Verdict(measured=True),
        microbatches=2,
        optimizer="AdamW#1",
        optimizer_step=7,
        host=schema.Host(rss=123),
    )
    return msgspec.structs.replace(base, **changes)


def carried_figures() -> Figures:
    """What measured step 3 said about its activations (a repeat carries these)."""
    return Figures(
        step=3,
        end_activations=0,
        high=schema.Piles(1000, 400, 800, 2500),
        peak=schema.Piles(1000, 0, 800, 2500),
        dtypes={"bfloat16": schema.DtypeStat(2500, 10)},
        top=(schema.ModuleBytes(module=5, bytes=2500),),
    )


def test_a_measured_step_says_what_the_ledger_read() -> None:
    step = build_step(inputs(), HostValues(loss=1.5))
    assert (step.step, step.t_start, step.t_end, step.microbatches) == (7, 10.0, 10.5, 2)
    assert (step.end, step.max, step.peak) == (END, HIGH, PEAK)
    assert step.dtypes == DTYPES
    assert step.top_activations == TOP
    assert step.activations_measured and step.activations_from is None
    assert step.allocator.allocated == 9000 and step.host.rss == 123
    assert step.loss == 1.5 and step.scale is None
    assert (step.optimizer, step.optimizer_step) == ("AdamW#1", 7)
    assert step.closed_by is schema.StepTrigger.OPTIMIZER and not step.skipped


COUNTED = (640, {"bfloat16": schema.DtypeStat(640, 3)})
"""The gradients an unarmed close counted beside the ledger (whose gradients pile is empty)."""


def test_gradients_counted_outside_the_ledger_replace_its_gradients() -> None:
    step = build_step(inputs(gradients=COUNTED, verdict=Verdict(measured=False)), HostValues())
    assert step.end == schema.Piles(1000, 640, 800, None)
    assert step.dtypes[Pile.GRADIENTS] == COUNTED[1]
    assert step.dtypes[Pile.WEIGHTS] == DTYPES[Pile.WEIGHTS]


def test_an_unarmed_step_not_known_states_no_high_or_peak_it_did_not_watch() -> None:
    """The issue's step: gradients counted at the close only (340,008 B there, `max` said 0).
    Their high and their value at the unknown peak moment are not known; the weights and the
    optimizer state, steady through the step, are known at every moment."""
    ledger = LedgerReading(
        schema.Piles(1000, 0, 800, 50),
        schema.Piles(1000, 0, 800, 3000),
        schema.Piles(1000, 0, 800, 3000),
        gradients_watched=False,
    )
    reading = CloseReading(7, ledger)
    step = build_step(
        inputs(reading=reading, gradients=COUNTED, verdict=Verdict(measured=False)), HostValues()
    )
    assert step.end == schema.Piles(1000, 640, 800, None)
    assert step.max == schema.Piles(1000, None, 800, None)
    assert step.peak == schema.Piles(1000, None, 800, None)
    assert step.peak.total is None and step.end.total is None
    assert Pile.ACTIVATIONS not in step.dtypes and step.top_activations == []


def test_a_pile_that_moved_in_a_step_not_known_has_no_value_at_its_peak() -> None:
    """The weights changed during the step (a recount at the close found new ones): at the
    peak's unknown moment they may have been either; their high is the ledger's."""
    ledger = LedgerReading(END, HIGH, PEAK, steady=frozenset({Pile.OPTIMIZER_STATE}))
    step = build_step(
        inputs(reading=CloseReading(7, ledger), verdict=Verdict(measured=False)), HostValues()
    )
    assert step.peak == schema.Piles(None, None, 800, None)
    assert step.max == schema.Piles(1000, 400, 800, None)


def test_gradients_watched_from_the_opening_keep_their_high_when_not_known() -> None:
    """Armed from the step's opening, but the job's own saved-tensor hooks hid its activations:
    the gradient hooks still kept the gradients in the ledger, whose high is exact; steady
    gradients are known at the peak's moment too."""
    step = build_step(inputs(verdict=Verdict(measured=False)), HostValues())
    assert step.max == schema.Piles(1000, 400, 800, None)
    assert step.peak == schema.Piles(1000, 400, 800, None)


def test_a_high_below_the_steps_own_end_is_not_stated() -> None:
    """A measured high below the close's own count (gradients counted beside the ledger) or a
    twin whose gradients ended lower than this step's: not the step's high."""
    step = build_step(inputs(gradients=COUNTED), HostValues())
    assert step.end.gradients == 640 and step.max.gradients is None
    assert step.max.weights == 1000 and step.max.activations == 3000
    carried = Verdict(measured=False, carried=carried_figures())
    step = build_step(inputs(gradients=COUNTED, verdict=carried), HostValues())
    assert step.max == schema.Piles(1000, None, 800, 2500)


def test_a_repeat_carries_the_measured_steps_activation_figures() -> None:
    figures = carried_figures()
    verdict = Verdict(measured=False, carried=figures)
    step = build_step(inputs(verdict=verdict), HostValues())
    assert not step.activations_measured and step.activations_from == 3
    assert step.end == schema.Piles(1000, 400, 800, 0)
    assert (step.max, step.peak) == (figures.high, figures.peak)
    assert step.dtypes[Pile.ACTIVATIONS] == figures.dtypes
    assert step.dtypes[Pile.GRADIENTS] == DTYPES[Pile.GRADIENTS]
    assert step.top_activations == list(figures.top)


def test_activations_not_known_are_null_and_say_so() -> None:
    step = build_step(inputs(verdict=Verdict(measured=False)), HostValues())
    assert not step.activations_measured and step.activations_from is None
    assert step.end == schema.Piles(1000, 400, 800, None)
    assert step.max.activations is None and step.peak.activations is None
    assert step.peak.total is None
    # null on the wire, read back as None
    (decoded,) = wire.FrameDecoder().feed(wire.preamble() + wire.encode(step))
    assert isinstance(decoded, schema.Step) and decoded.end == step.end


def test_alerts_in_one_list_in_the_order_they_were_gathered() -> None:
    raised = (alert(AlertKind.STEP_RULE), alert(AlertKind.FIRST_STEP_GROWTH))
    health = (alert(AlertKind.NONFINITE_LOSS),)
    vary = alert(AlertKind.ACTIVATIONS_VARY)
    step = build_step(
        inputs(
            raised=raised,
            fragmentation=alert(AlertKind.FRAGMENTATION),
            health=health,
            verdict=Verdict(measured=True, alert=vary),
            over_budget=alert(AlertKind.OVER_BUDGET),
        ),
        HostValues(),
    )
    assert [a.kind for a in step.alerts] == [
        AlertKind.STEP_RULE,
        AlertKind.FIRST_STEP_GROWTH,
        AlertKind.FRAGMENTATION,
        AlertKind.NONFINITE_LOSS,
        AlertKind.ACTIVATIONS_VARY,
        AlertKind.OVER_BUDGET,
    ]


def test_a_skip_leads_its_alerts_with_the_scale_change() -> None:
    step = build_step(
        inputs(skipped=True, health=(alert(AlertKind.NONFINITE_LOSS),)),
        HostValues(scale=65536.0, scale_after=32768.0),
    )
    assert step.skipped and step.scale == 65536.0
    assert [a.kind for a in step.alerts] == [AlertKind.SKIPPED_STEP, AlertKind.NONFINITE_LOSS]
    assert step.alerts[0].message.endswith("; scale 65536 -> 32768")
    travelling = build_step(inputs(skipped=True), HostValues())  # scales still on the device
    assert travelling.alerts[0].message.endswith("(non-finite gradients)")


def test_late_values_of_earlier_steps_come_first_then_the_closes_own() -> None:
    earlier = schema.StepLate(step=5, loss=2.0)
    found = schema.StepLate(step=6, alerts=[alert(AlertKind.NONFINITE_GRADIENT)])
    step = build_step(inputs(late=(found,)), HostValues(), late=[earlier], dropped=4)
    assert step.late == [earlier, found]
    assert step.dropped == 4


def test_drained_allocator_events_are_summarised_into_the_frame() -> None:
    frames = [{"filename": "/job/train.py", "line": 9, "name": "step"}]
    entry = {"action": "alloc", "size": 4096, "stream": 0, "frames": frames}
    drained = Drained([entry], False, 1, (), "/job")
    step = build_step(inputs(alloc_events=drained), HostValues())
    assert step.alloc_events is not None
    assert step.alloc_events.largest == [schema.AllocEvent(4096, 1, "train.py:9 step")]
    assert build_step(inputs(), HostValues()).alloc_events is None


def test_building_is_pure_and_the_frame_is_a_wire_message() -> None:
    given = inputs(gradients=(640, {F32: schema.DtypeStat(640, 3)}))
    first = build_step(given, HostValues(loss=0.25))
    again = build_step(given, HostValues(loss=0.25))
    assert first == again
    assert given.reading.ledger.dtypes == DTYPES  # the ledger's reading is not written to
    decoded = list(wire.FrameDecoder().feed(wire.preamble() + wire.encode(first)))
    assert decoded == [first]


def test_the_next_step_starts_from_the_persistent_piles_counted_at_the_close() -> None:
    assert inputs().start_of_next() == schema.Piles(1000, 400, 800, 0)
    counted = inputs(gradients=(640, {}))
    assert counted.start_of_next() == schema.Piles(1000, 640, 800, 0)


def test_the_ledgers_pile_indices_are_the_schemas_piles_in_order() -> None:
    from memtui_agent.memory.ledger import PileIndex

    assert [index.pile for index in PileIndex] == list(Pile)
    assert [int(index) for index in PileIndex] == list(range(len(Pile)))
