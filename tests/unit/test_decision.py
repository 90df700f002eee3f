"""The measure/carry decision (`steps.decision.decide`) on its own: readings and states in,
decisions out, one row per case; every cause and every mode transition (issue 33).

No hooks, no job, no interpreter: a close is described by its figures, the policy's match and
the flags the gate gathers. The alerts' words are `activation_wording`'s, said once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from memtui_agent.steps.activation_cause import Cause
from memtui_agent.steps.activation_policy import FIRST_STEPS, ActivationPolicy, Figures, Match
from memtui_agent.steps.activation_wording import (
    CLAUSES,
    LEADS,
    TEMPLATES,
    SaidOnce,
    clause,
    message,
)
from memtui_agent.steps.decision import (
    MEASURE_WHILE_HELD,
    RECENT_CARRIES,
    ActivationReading,
    Decision,
    DecisionState,
    decide,
)
from memtui_agent.steps.step_signature import MEMORY_TOLERANCE, Difference, Mismatch, Signature
from memtui_protocol import schema
from memtui_protocol.schema import ActivationMode

AUTO, EVERY, OFF = ActivationMode.AUTO, ActivationMode.EVERY, ActivationMode.OFF
OPS = (5, 0)
"""Autograd nodes before and after the one backward: the same ops."""


def figures(
    step: int,
    high: int = 100,
    end: int = 0,
    start: int = 0,
    nodes: tuple[int, ...] = OPS,
    memory: tuple[int, ...] | None = None,
    exact: bool = False,
    signature: bool = True,
    weights: int = 10,
) -> Figures:
    piles = schema.Piles(weights=weights, activations=high)
    counters = Signature(nodes, memory, exact) if signature else None
    return Figures(step, end, piles, piles, {}, (), signature=counters, start_activations=start)


TWIN = figures(2)
NOW = figures(7)
MEASURED_WHOLE = Match(armed_throughout=True)
REPEATS = Match(twin=TWIN)


@dataclass(frozen=True)
class Case:
    """One close: the state and reading, and the decision expected."""

    name: str
    state: DecisionState
    match: Match
    now: Figures = NOW
    reading: dict[str, Any] = field(default_factory=dict)
    """`ActivationReading`'s other fields."""
    measured: bool = False
    carried: bool = False
    cause: Cause = Cause.MEASURED
    mode: ActivationMode = AUTO
    measure_next: int = 0
    also: Cause | None = None
    recent: tuple[bool, ...] | None = None
    crossings: int | None = None
    measure_why: Cause | None = None
    compiled: bool = False
    """`auto` turned into `every` because the job compiles."""


def auto(**history: Any) -> DecisionState:
    return DecisionState(AUTO, **history)


def not_empty(why: str, now: Figures, **reading: Any) -> Case:
    """An unarmed step that repeats nothing and is not proven empty: measured in part, not
    known, as before (a graph held also measures the next steps while held)."""
    held = bool(reading.get("graphs_held"))
    return Case(
        f"not empty: {why}",
        auto(),
        Match(partial=True),
        now=now,
        reading=reading,
        cause=Cause.PARTIAL,
        measure_next=MEASURE_WHILE_HELD if held else 1,
        measure_why=Cause.GRAPHS_HELD if held else None,
    )


ARMED_FOR = [
    Cause.NEW_SIGNATURE,
    Cause.FIRST_STEPS,
    Cause.AFTER_ALERT,
    Cause.GRAPHS_HELD,
    Cause.AFTER_NOT_KNOWN,
    Cause.MUST_MEASURE,
    Cause.AUDIT,
    Cause.WHOLE_AFTER_PARTIAL,
]
"""Why the policy armed a step from its first root call: the cause of its measured verdict."""


CASES = [
    # --activations off: nothing measured, nothing measured next, whatever the close held.
    Case("off", DecisionState(OFF), MEASURED_WHOLE, mode=OFF, cause=Cause.OFF),
    Case(
        "off, graphs held",
        DecisionState(OFF),
        Match(),
        reading={"graphs_held": 2, "unarmed_held": 1, "new_unarmed": 1, "blind": True},
        mode=OFF,
        cause=Cause.OFF,
    ),
    # Measured whole.
    Case("measured", auto(), MEASURED_WHOLE, measured=True),
    *[
        Case(
            f"measured: {why.value}",
            auto(),
            Match(armed_throughout=True, twin=TWIN, armed_for=why),
            measured=True,
            cause=why,
        )
        for why in ARMED_FOR
    ],
    Case("measured, every", DecisionState(EVERY), MEASURED_WHOLE, measured=True, mode=EVERY),
    Case(
        "measured like its twin",
        auto(),
        Match(armed_throughout=True, twin=figures(2, high=100)),
        measured=True,
    ),
    Case(
        "measured, graphs held",
        auto(),
        MEASURED_WHOLE,
        reading={"graphs_held": 1},
        measured=True,
        measure_next=MEASURE_WHILE_HELD,
        measure_why=Cause.GRAPHS_HELD,
    ),
    # A measured repeat that measured other activations: the data decides.
    Case(
        "data dependent, max",
        auto(),
        Match(armed_throughout=True, twin=figures(2, high=80)),
        measured=True,
        cause=Cause.DATA_DEPENDENT,
        mode=EVERY,
    ),
    Case(
        "data dependent, at the close",
        auto(),
        Match(armed_throughout=True, twin=figures(2, end=8)),
        measured=True,
        cause=Cause.DATA_DEPENDENT,
        mode=EVERY,
    ),
    Case(
        "data dependent in every: said already",
        DecisionState(EVERY),
        Match(armed_throughout=True, twin=figures(2, high=80)),
        measured=True,
        mode=EVERY,
    ),
    Case(
        "other activations from other ops: something else",
        auto(),
        Match(armed_throughout=True, twin=figures(2, high=80, nodes=(6, 0))),
        measured=True,
    ),
    Case(
        "other activations from other held graphs: something else",
        auto(),
        Match(armed_throughout=True, twin=figures(2, high=80, start=4)),
        measured=True,
    ),
    Case(
        "other activations, no counters: something else",
        auto(),
        Match(armed_throughout=True, twin=figures(2, high=80, signature=False)),
        measured=True,
    ),
    # A repeat: carried when its counters confirm it.
    Case("repeat", auto(), REPEATS, carried=True, cause=Cause.REPEAT, recent=(True,)),
    # Unarmed, but nothing could be saved: no autograd node, no backward, nothing held.
    Case(
        "nothing saved: a second optimizer's close",
        auto(),
        Match(partial=True),
        now=figures(7, high=0, nodes=(0,)),
        measured=True,
        cause=Cause.NOTHING_SAVED,
    ),
    not_empty("a node recorded", figures(7, high=0, nodes=(1,))),
    not_empty("a backward ran", figures(7, high=0, nodes=(0, 0))),
    not_empty("held at its start", figures(7, high=0, nodes=(0,), start=8)),
    not_empty("no counter", figures(7, high=0, nodes=(0,)), counter=False),
    not_empty("a graph held", figures(7, high=0, nodes=(0,)), graphs_held=1),
    # The job has compiled: the close stands as it would, and no hook moves again (dynamo's
    # guards read them), so every step is measured from the next one on.
    Case(
        "compiled, measured",
        auto(),
        MEASURED_WHOLE,
        reading={"compiled": True},
        measured=True,
        mode=EVERY,
        compiled=True,
    ),
    Case(
        "compiled, a repeat",
        auto(),
        REPEATS,
        reading={"compiled": True},
        carried=True,
        cause=Cause.REPEAT,
        recent=(True,),
        mode=EVERY,
        compiled=True,
    ),
    Case(
        "compiled, every already",
        DecisionState(EVERY),
        MEASURED_WHOLE,
        reading={"compiled": True},
        measured=True,
        mode=EVERY,
    ),
    Case(
        "compiled, off",
        DecisionState(OFF),
        MEASURED_WHOLE,
        reading={"compiled": True},
        cause=Cause.OFF,
        mode=OFF,
    ),
    Case(
        "repeat, graphs held",
        auto(),
        REPEATS,
        reading={"graphs_held": 3},
        carried=True,
        cause=Cause.REPEAT,
        measure_next=MEASURE_WHILE_HELD,
    ),
    Case(
        "repeat on a GPU",
        auto(),
        Match(twin=figures(2, memory=(4096, 12), exact=True)),
        now=figures(7, memory=(4096, 12), exact=True),
        carried=True,
        cause=Cause.REPEAT,
    ),
    Case(
        "repeat, heap within the tolerance",
        auto(),
        Match(twin=figures(2, memory=(50_000,))),
        now=figures(7, memory=(50_000 + MEMORY_TOLERANCE,)),
        carried=True,
        cause=Cause.REPEAT,
    ),
    Case(
        "repeat, the window slides",
        auto(recent=(False, False) + (True,) * (RECENT_CARRIES - 2)),
        REPEATS,
        carried=True,
        cause=Cause.REPEAT,
        recent=(False,) + (True,) * (RECENT_CARRIES - 1),
    ),
    Case(
        "measured in part",
        auto(),
        Match(partial=True),
        cause=Cause.PARTIAL,
        measure_next=1,
        measure_why=Cause.AFTER_NOT_KNOWN,
    ),
    Case(
        "measured in part, graphs held",
        auto(),
        Match(partial=True),
        reading={"graphs_held": 1},
        cause=Cause.PARTIAL,
        measure_next=MEASURE_WHILE_HELD,
        measure_why=Cause.GRAPHS_HELD,
    ),
    # A forward the agent did not see.
    Case("job hooks", auto(), Match(), reading={"blind": True}, cause=Cause.JOB_HOOKS),
    Case(
        "hooks disabled by torch.func",
        auto(),
        Match(),
        reading={"disabled": True},
        cause=Cause.HOOKS_DISABLED,
    ),
    Case(
        "hooks disabled, a thread moved too: the move is said",
        auto(),
        Match(),
        reading={"disabled": True, "moved": True},
        cause=Cause.THREAD_MOVED,
    ),
    Case(
        "job hooks, graphs held",
        auto(),
        Match(),
        reading={"blind": True, "graphs_held": 1, "unarmed_held": 1},
        cause=Cause.JOB_HOOKS,
        measure_next=MEASURE_WHILE_HELD,
        measure_why=Cause.GRAPHS_HELD,
    ),
    Case(
        "thread moved",
        auto(),
        Match(),
        reading={"moved": True, "blind": True},
        cause=Cause.THREAD_MOVED,
    ),
    # Graphs built unarmed, still held.
    Case(
        "held unarmed",
        auto(),
        REPEATS,
        reading={"graphs_held": 1, "unarmed_held": 1, "new_unarmed": 1},
        cause=Cause.HELD_UNARMED,
        measure_next=FIRST_STEPS,
        crossings=1,
        recent=(),
        measure_why=Cause.GRAPHS_HELD,
    ),
    Case(
        "held unarmed, the same graphs again",
        auto(crossings=1),
        MEASURED_WHOLE,
        reading={"graphs_held": 1, "unarmed_held": 1},
        cause=Cause.HELD_UNARMED,
        measure_next=FIRST_STEPS,
        crossings=1,
    ),
    Case(
        "held unarmed, crossing again",
        auto(crossings=1),
        MEASURED_WHOLE,
        reading={"graphs_held": 2, "unarmed_held": 2, "new_unarmed": 1},
        cause=Cause.HELD_CROSSING,
        mode=EVERY,
        measure_next=FIRST_STEPS,
        crossings=2,
    ),
    Case(
        "held unarmed, crossing again in every",
        DecisionState(EVERY, crossings=1),
        MEASURED_WHOLE,
        reading={"graphs_held": 1, "unarmed_held": 1, "new_unarmed": 1},
        cause=Cause.HELD_UNARMED,
        mode=EVERY,
        measure_next=FIRST_STEPS,
        crossings=2,
    ),
    Case(
        "held unarmed at a data-dependent close",
        auto(),
        Match(armed_throughout=True, twin=figures(2, high=80)),
        reading={"graphs_held": 1, "unarmed_held": 1, "new_unarmed": 1},
        cause=Cause.HELD_UNARMED,
        also=Cause.DATA_DEPENDENT,
        mode=EVERY,
        measure_next=FIRST_STEPS,
    ),
    # A repeat its counters do not confirm: not known, the next step measured.
    Case(
        "other nodes",
        auto(),
        REPEATS,
        now=figures(7, nodes=(4, 0)),
        cause=Cause.NODES,
        measure_next=1,
        recent=(False,),
        measure_why=Cause.AFTER_NOT_KNOWN,
    ),
    Case(
        "other backward passes",
        auto(),
        REPEATS,
        now=figures(7, nodes=(5, 5, 0)),
        cause=Cause.BACKWARDS,
        measure_next=1,
    ),
    Case(
        "other allocations",
        auto(),
        Match(twin=figures(2, memory=(4096, 12), exact=True)),
        now=figures(7, memory=(8192, 12), exact=True),
        cause=Cause.DEVICE,
        measure_next=1,
    ),
    Case(
        "other memory readers",
        auto(),
        Match(twin=figures(2, memory=(4096, 12), exact=True)),
        now=figures(7, memory=(4096,)),
        cause=Cause.READERS,
        measure_next=1,
    ),
    Case(
        "heap moved",
        auto(),
        Match(twin=figures(2, memory=(50_000,))),
        now=figures(7, memory=(50_001 + MEMORY_TOLERANCE,)),
        cause=Cause.HEAP,
        measure_next=1,
    ),
    Case(
        "held activations changed",
        auto(),
        REPEATS,
        now=figures(7, start=64, end=64),
        cause=Cause.HELD,
        measure_next=1,
    ),
    Case(
        "weights moved in the step",  # an AveragedModel deep-copied in it: the twin's peak
        auto(),  # holds other weights
        REPEATS,
        now=figures(7, weights=30),
        cause=Cause.PILES,
        measure_next=1,
    ),
    Case(
        "two unconfirmed in the window (one slid out): still one at a time",
        auto(recent=(False, False) + (True,) * (RECENT_CARRIES - 2)),
        REPEATS,
        now=figures(7, nodes=(4, 0)),
        cause=Cause.NODES,
        measure_next=1,
    ),
    # ... and every step measured when it cannot be confirmed, or keeps happening.
    Case(
        "no node counter",
        auto(),
        REPEATS,
        reading={"counter": False},
        cause=Cause.NO_COUNTER,
        mode=EVERY,
        measure_next=1,
        recent=(False,),
    ),
    Case(
        "no counters read",
        auto(),
        REPEATS,
        now=figures(7, signature=False),
        cause=Cause.NO_COUNTER,
        mode=EVERY,
        measure_next=1,
    ),
    Case(
        "keeps varying",
        auto(recent=(True, False, False)),
        REPEATS,
        now=figures(7, nodes=(4, 0)),
        cause=Cause.KEEPS_VARYING,
        mode=EVERY,
        measure_next=1,
        recent=(True, False, False, False),
    ),
    Case(
        "keeps holding other graphs",
        auto(recent=(False, False)),
        REPEATS,
        now=figures(7, start=64, end=64),
        cause=Cause.KEEPS_VARYING,
        mode=EVERY,
        measure_next=1,
    ),
    Case(
        "heap keeps moving",
        auto(recent=(False, False)),
        Match(twin=figures(2, memory=(50_000,))),
        now=figures(7, memory=(150_000,)),
        cause=Cause.HEAP_KEEPS_MOVING,
        mode=EVERY,
        measure_next=1,
    ),
    Case(
        "keeps varying in every: one at a time",
        DecisionState(EVERY, recent=(False, False)),
        REPEATS,
        now=figures(7, nodes=(4, 0)),
        cause=Cause.NODES,
        mode=EVERY,
        measure_next=1,
    ),
]


def _decide(case: Case) -> Decision:
    return decide(case.state, ActivationReading(7, case.now, case.match, **case.reading))


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_close_is_decided_as_its_case_says(case: Case) -> None:
    decision = _decide(case)
    verdict = decision.verdict
    assert verdict.measured is case.measured
    assert (verdict.carried is not None) is case.carried
    if case.carried:
        assert verdict.carried is case.match.twin  # the twin's own figures
    assert verdict.alert is None  # the gate words the alert
    assert decision.cause is case.cause
    assert decision.next_mode is case.mode
    assert decision.measure_next == case.measure_next
    assert decision.also is case.also
    assert decision.compiled is case.compiled
    if case.recent is not None:
        assert decision.next_state.recent == case.recent
    if case.crossings is not None:
        assert decision.next_state.crossings == case.crossings
    if case.measure_why is not None:
        assert decision.measure_why is case.measure_why


def test_the_cases_cover_every_cause_and_every_mode_transition() -> None:
    assert {case.cause for case in CASES} == set(Cause)
    transitions = {(case.state.mode, case.mode) for case in CASES}
    assert transitions == {(AUTO, AUTO), (AUTO, EVERY), (EVERY, EVERY), (OFF, OFF)}
    switched = [case for case in CASES if (case.state.mode, case.mode) == (AUTO, EVERY)]
    assert {case.name for case in switched if case.compiled} == {
        "compiled, measured",
        "compiled, a repeat",
    }
    assert {case.cause for case in switched if not case.compiled} == {
        Cause.DATA_DEPENDENT,
        Cause.HELD_CROSSING,
        Cause.HELD_UNARMED,  # its data-dependent `also` switched
        Cause.NO_COUNTER,
        Cause.KEEPS_VARYING,
        Cause.HEAP_KEEPS_MOVING,
    }


def test_deciding_changes_nothing_it_was_given() -> None:
    for case in CASES:
        before = (case.state, case.match, case.now)
        first, again = _decide(case), _decide(case)
        assert (case.state, case.match, case.now) == before
        assert first == again


QUIET = {Cause.MEASURED, Cause.NOTHING_SAVED, Cause.REPEAT, Cause.OFF, *ARMED_FOR}
"""Causes worth no alert: the figures are the step's own, confirmed, or simply not asked for.
Every other step that is not known says why (a step measured in part too: a Trainer with
gradient accumulation left 26 of 100 steps not known without a word)."""


def test_every_step_that_is_not_known_says_why() -> None:
    for case in CASES:
        decision = _decide(case)
        if decision.verdict.measured or decision.verdict.carried is not None:
            continue
        if decision.cause is Cause.OFF:
            continue  # the user asked for no measurement
        said = SaidOnce().alert(decision)
        assert said is not None, case.name


def test_every_cause_worth_saying_has_its_words_and_the_rest_none() -> None:
    assert set(TEMPLATES) == set(Cause) - QUIET == set(LEADS)
    assert set(CLAUSES) == set(Difference)
    for case in CASES:
        decision = _decide(case)
        said = SaidOnce().alert(decision)
        if case.cause in QUIET:
            assert said is None, case.name
            continue
        assert said is not None and said.kind is schema.AlertKind.ACTIVATIONS_VARY
        assert "{" not in said.message and "None" not in said.message, said.message
        assert re.search(r"\bstep 7\b", said.message), said.message


def test_the_words_quote_the_numbers_that_differ() -> None:
    by_name = {case.name: _decide(case) for case in CASES}
    words = {
        name: message(decision.cause, decision)
        for name, decision in by_name.items()
        if decision.cause not in QUIET
    }
    assert "(max 100 B vs 80 B)" in words["data dependent, max"]
    assert "(at the close 0 B vs 8 B)" in words["data dependent, at the close"]
    assert (
        "autograd recorded 4 nodes here (4, 0 before and after each backward)"
        in (words["other nodes"])
    )
    assert "and 5 in step 2 (5, 0)" in words["other nodes"]
    assert "it ran 2 backward passes where step 2 ran 1" in words["other backward passes"]
    assert (
        "made 12 allocations of 8,192 B in all where step 2 made 12 of 4,096 B"
        in (words["other allocations"])
    )
    # The heap's own figures are memtui's evidence, not the user's: words, no bytes.
    assert (
        "the heap in use at its first backward had grown from its start by an amount more "
        "than 16 KiB away from step 2's" in words["heap moved"]
    )
    assert " B " not in words["heap moved"] and "66,385" not in words["heap moved"]
    for name, said in words.items():  # each starts with what varies, in the user's words
        assert said.startswith(LEADS[by_name[name].cause]), name
    assert words["heap moved"].startswith(
        "activations differ between steps (variable sequence lengths or batch sizes?): memtui "
        "measures every step where it cannot prove a repeat; step 7"
    )
    assert (
        "started with 64 B of activations held and closed with 64 B, step 2 with 0 B"
        in (words["held activations changed"])
    )
    assert (
        "its weights and optimizer state reached 30 B and 0 B, step 2's 10 B and 0 B"
        in (words["weights moved in the step"])
    )
    assert "4 of the last 4 steps" not in words["keeps varying"]
    assert (
        "3 of the last 4 steps that repeated a measured step's calls did something"
        in (words["keeps varying"])
    )
    assert "could not be confirmed by the heap" in words["heap keeps moving"]
    assert "no autograd node counter" in words["no node counter"]
    assert (
        "a graph built by the model while memtui's hooks were off still holds its"
        in (words["held unarmed"])
    )
    assert (
        "2 graphs built by the model while memtui's hooks were off still hold their"
        in (words["held unarmed, crossing again"])
    )
    assert words["held unarmed, crossing again"].endswith("every step is measured from now on")


def test_each_cause_is_said_once_and_a_second_cause_when_the_first_was() -> None:
    said = SaidOnce()
    held = _decide(next(case for case in CASES if case.name == "held unarmed"))
    both = _decide(next(case for case in CASES if case.also is Cause.DATA_DEPENDENT))
    first = said.alert(held)
    assert first is not None and "memtui never saw what they saved" in first.message
    assert said.alert(held) is None  # said: later closes with it only confirm it
    second = said.alert(both)  # held said already: the data-dependent switch is
    assert second is not None and "depends on the data" in second.message
    assert said.alert(both) is None
    fresh = SaidOnce().alert(both)  # held not said yet: it goes first, the switch unsaid
    assert fresh is not None and "memtui never saw what they saved" in fresh.message


def test_a_clause_for_every_difference() -> None:
    mismatches = [
        Mismatch(Difference.NODES, (4, 0), (5, 0)),
        Mismatch(Difference.BACKWARDS, (4, 1, 0), (5, 0)),
        Mismatch(Difference.HEAP, (90_000,), (50_000,)),
        Mismatch(Difference.DEVICE, (10, 2), (20, 3)),
        Mismatch(Difference.HELD, (1, 2), (3, 4)),
        Mismatch(Difference.PILES, (1, 2), (3, 4)),
        Mismatch(Difference.READERS, (1,), (0,)),
        Mismatch(Difference.COUNTER, (), ()),
    ]
    assert {mismatch.what for mismatch in mismatches} == set(Difference)
    for mismatch in mismatches:
        words = clause(mismatch, 3)
        assert "{" not in words and words
        assert "step 3" in words or mismatch.what is Difference.COUNTER


def test_the_policy_says_why_it_armed_each_measured_step() -> None:
    """The measured causes come from the policy's arming at a step's first root call, and the
    count of steps measured next keeps the cause of its largest request."""
    policy = ActivationPolicy(AUTO, audit_every=5)
    start = schema.Piles(weights=100)
    found: list[tuple[int, Cause | None]] = []

    def run(step: int, calls: tuple[Any, ...] = (("a",),), must: bool = False) -> None:
        policy.begin(start)
        for call in calls:
            policy.root_call(call, step, must_measure=must)
        match = policy.close(step, figures(step))
        found.append((step, match.armed_for if match.armed_throughout else None))

    policy.measure_next(2, Cause.FIRST_STEPS)
    run(1)
    run(2)
    run(3)  # a repeat: not armed
    run(4, must=True)
    run(5)  # audit_every
    run(6, calls=(("b",),))
    policy.measure_next(1, Cause.AFTER_ALERT)
    run(7)
    policy.measure_next(3, Cause.GRAPHS_HELD)
    policy.measure_next(1, Cause.AFTER_NOT_KNOWN)  # within the larger count: it keeps its cause
    run(8)
    run(9)
    run(10)  # an audit step, but still one of the three
    run(11, calls=(("a",), ("c",)))  # begins like step 3 and leaves it: measured in part
    run(12)  # the next from that start is measured whole
    run(13)
    assert found == [
        (1, Cause.FIRST_STEPS),
        (2, Cause.FIRST_STEPS),
        (3, None),
        (4, Cause.MUST_MEASURE),
        (5, Cause.AUDIT),
        (6, Cause.NEW_SIGNATURE),
        (7, Cause.AFTER_ALERT),
        (8, Cause.GRAPHS_HELD),
        (9, Cause.GRAPHS_HELD),
        (10, Cause.GRAPHS_HELD),
        (11, None),
        (12, Cause.WHOLE_AFTER_PARTIAL),
        (13, Cause.WHOLE_AFTER_PARTIAL),
    ]
