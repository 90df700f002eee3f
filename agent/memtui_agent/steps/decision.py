"""The measure/carry decision at a step's close, as one pure function (docs/design.md#steps).

`decide(state, reading)` says whether the closing step's activation figures were measured, are
carried from the measured step it repeats, or are not known; why (`activation_cause.Cause`,
one member per reason: why a measured step was armed, why a repeat stands, why a step is not
known); and how the next steps are measured (`--activations` mode, steps measured whatever
their signature). It reads nothing and changes nothing: what the close measured comes in as an
`ActivationReading`, the history it weighs (recent repeats, graphs crossing steps) as a
`DecisionState`, and the next state goes out in the `Decision`. The gate (`gate.ActivationGate`)
gathers the reading, applies the decision (the only place the mode changes) and words the
alert (`activation_wording`, by cause).

A repeat's key (the same calls on the same shapes) only makes it a candidate: the carry stands
when the step's own counters confirm it (`step_signature`), when it starts and ends holding the
same activations as its twin, and when no graph it built unarmed is still held at its close.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memtui_agent.steps.activation_cause import Cause
from memtui_agent.steps.activation_policy import FIRST_STEPS, Figures, Match, Verdict
from memtui_agent.steps.step_signature import Difference, Mismatch, compare
from memtui_protocol.schema import ActivationMode

RECENT_CARRIES = 10
UNCONFIRMED_FOR_EVERY = 3
"""Of the last `RECENT_CARRIES` repeats, this many unconfirmed make every step measured: the
job's activations change with what its inputs do not show (LayerDrop), and a fifth of its steps
or more would otherwise say "not known"."""
CROSSINGS_FOR_EVERY = 2
"""Closes finding new graphs built unarmed still held, after which every step is measured (a
GAN whose generator graph is backpropagated a step later): only armed steps count such
graphs."""
MEASURE_WHILE_HELD = 2
"""Steps measured after a close that finds graphs of root calls still held. What a graph saves
is known only from the agent's own pack hook (a census never unpacks a graph), so while the
job keeps graphs across closes the steps that may build more are armed: two, because in a job
of two optimizers (a GAN) the step that builds the graph held at one close is the one after the
next."""


_UNCONFIRMED = {
    Difference.NODES: Cause.NODES,
    Difference.BACKWARDS: Cause.BACKWARDS,
    Difference.DEVICE: Cause.DEVICE,
    Difference.READERS: Cause.READERS,
    Difference.HEAP: Cause.HEAP,
    Difference.HELD: Cause.HELD,
    Difference.PILES: Cause.PILES,
}
"""The cause of a repeat found unconfirmed once, by what differed (the counter's absence is
never a one-off: `Cause.NO_COUNTER`)."""


@dataclass(frozen=True)
class DecisionState:
    """What the decision weighs besides the close: the mode and the history of earlier closes."""

    mode: ActivationMode
    recent: tuple[bool, ...] = ()
    """Whether each recent repeat's carry was confirmed (the last `RECENT_CARRIES`)."""
    crossings: int = 0
    """Closes that found new graphs built unarmed still held."""


@dataclass(frozen=True)
class ActivationReading:
    """What a close read that bears on its activations (`gate.ActivationGate.verdict`)."""

    step: int
    figures: Figures
    """What the ledger measured, with the step's counters (`step_signature`)."""
    match: Match
    """What the policy's bookkeeping found: armed throughout, in part, the remembered twin."""
    graphs_held: int = 0
    """Graphs of root calls still holding saved tensors at the close (`held_graphs`)."""
    unarmed_held: int = 0
    """Of those, built while the hooks were off."""
    new_unarmed: int = 0
    """Of the unarmed ones, those no earlier close found held."""
    blind: bool = False
    """A forward ran under the job's own saved-tensor hooks (nothing of it counted)."""
    disabled: bool = False
    """A forward ran where torch disables saved-tensor hooks (torch.func's transforms)."""
    moved: bool = False
    """The step began while the agent followed another thread."""
    counter: bool = True
    """Whether this torch has autograd's node counter (without it no carry is confirmed)."""
    compiled: bool = False
    """The job has run code `torch.compile` made (`job.compiled`): switching the hooks between
    steps would make dynamo compile it again."""


@dataclass(frozen=True)
class Decision:
    """A close's verdict, its cause, and how the next steps are measured."""

    verdict: Verdict
    """Measured, carried (with the twin's figures) or not known; the alert is the gate's."""
    cause: Cause
    next_state: DecisionState
    reading: ActivationReading
    """What was decided on (the alert quotes its figures)."""
    measure_next: int = 0
    """Steps from the next one measured whatever their signature (at least)."""
    measure_why: Cause = Cause.AFTER_NOT_KNOWN
    """Why they are measured (`GRAPHS_HELD`, `AFTER_NOT_KNOWN`)."""
    also: Cause | None = None
    """A second cause to say if the first was said already (a data-dependent switch at a close
    that also holds graphs built unarmed)."""
    twin: Figures | None = None
    """The measured step the decision compared this one with."""
    mismatch: Mismatch | None = None
    """What differed from the twin (a repeat not confirmed)."""
    compiled: bool = False
    """`auto` turned into `every` at this close because the job compiles (said once, as a note
    of its own: `AlertKind.COMPILED`)."""

    @property
    def next_mode(self) -> ActivationMode:
        """The `--activations` mode from the next step on."""
        return self.next_state.mode

    @property
    def causes(self) -> tuple[Cause, ...]:
        """The causes to say, first first."""
        return (self.cause,) if self.also is None else (self.cause, self.also)

    @property
    def unconfirmed(self) -> int:
        """Of the recent repeats (`next_state.recent`), those not confirmed."""
        return sum(1 for confirmed in self.next_state.recent if not confirmed)


NOT_KNOWN = Verdict(measured=False)
MEASURED = Verdict(measured=True)


def decide(state: DecisionState, reading: ActivationReading) -> Decision:
    """The decision at a close: pure, from `state` and `reading` alone."""
    if state.mode is ActivationMode.OFF:
        return Decision(NOT_KNOWN, Cause.OFF, state, reading)
    # Graphs kept across this close: what the next steps build is counted by the pack hook, the
    # only record of what a graph saves.
    held = MEASURE_WHILE_HELD if reading.graphs_held else 0
    if reading.moved or reading.blind or reading.disabled:
        if reading.moved:
            cause = Cause.THREAD_MOVED
        elif reading.disabled:
            cause = Cause.HOOKS_DISABLED
        else:
            cause = Cause.JOB_HOOKS
        decision = Decision(NOT_KNOWN, cause, state, reading)
    elif _nothing_saved(reading):
        decision = Decision(MEASURED, Cause.NOTHING_SAVED, state, reading)
    else:
        decision = _from_match(state, reading)
        if reading.unarmed_held:
            decision = _held_unarmed(decision)
        elif decision.verdict.carried is not None:
            decision = _confirm(decision)
    if reading.compiled and decision.next_state.mode is ActivationMode.AUTO:
        # Hooks installed for a measured step and removed for a carried one fail the guards of
        # every graph dynamo compiled (`job.compiled`): from here they stay, every step measured.
        every = replace(decision.next_state, mode=ActivationMode.EVERY)
        decision = replace(decision, next_state=every, compiled=True)
    return _measure(decision, held, Cause.GRAPHS_HELD)


def _nothing_saved(reading: ActivationReading) -> bool:
    """A step the hooks did not see and that repeats no measured one, whose activations are 0
    all the same: autograd's node counter (exact) recorded no node in it and no backward ran, so
    no tensor was saved, and no graph held activations at its start or at its close. Only where
    the counter exists; a repeat is carried as ever."""
    match = reading.match
    if match.armed_throughout or match.twin is not None or not reading.counter:
        return False
    if reading.graphs_held:
        return False
    figures = reading.figures
    signature = figures.signature
    return (
        signature is not None
        and signature.nodes == (0,)
        and figures.start_activations == 0
        and figures.end_activations == 0
        and figures.high.activations == 0
    )


def _measure(decision: Decision, steps: int, why: Cause) -> Decision:
    """`decision` with at least `steps` steps measured next, for `why` (the cause of the
    largest request)."""
    if steps <= 0 or steps < decision.measure_next:
        return decision
    return replace(decision, measure_next=steps, measure_why=why)


def _from_match(state: DecisionState, reading: ActivationReading) -> Decision:
    """What the policy's match says, before the counters and held graphs are weighed."""
    match, figures = reading.match, reading.figures
    twin = match.twin
    if match.armed_throughout:
        # Data-dependent activations switch `auto` to every step; in `every` they only confirm.
        if (
            twin is not None
            and state.mode is ActivationMode.AUTO
            and _data_dependent(twin, figures)
        ):
            every = replace(state, mode=ActivationMode.EVERY)
            return Decision(MEASURED, Cause.DATA_DEPENDENT, every, reading, twin=twin)
        return Decision(MEASURED, match.armed_for, state, reading, twin=twin)
    if twin is not None and not match.partial:
        return Decision(Verdict(measured=False, carried=twin), Cause.REPEAT, state, reading)
    # Measured in part, or a repeat of a prefix that then ran differently: not known exactly;
    # the next step is measured whatever it looks like.
    return _measure(Decision(NOT_KNOWN, Cause.PARTIAL, state, reading), 1, Cause.AFTER_NOT_KNOWN)


def _data_dependent(known: Figures, figures: Figures) -> bool:
    """A repeat whose activations measured differently although it ran the same autograd ops
    from the same held activations: what it saved depends on the data. (With other ops, or other
    held graphs, the step simply did something else: the new measurement replaces the old.)
    Only the step's highest activations and those left at its close count: the moment of the
    peak also moves with the other piles (gradients freed between two steps are allocated again
    during the next backward), so a peak that differs is no sign of data-dependent activations."""
    if (figures.high.activations, figures.end_activations) == (
        known.high.activations,
        known.end_activations,
    ):
        return False  # the same activations
    if known.start_activations != figures.start_activations:
        return False
    before, now = known.signature, figures.signature
    return before is not None and now is not None and before.nodes == now.nodes


def _held_unarmed(decision: Decision) -> Decision:
    """Graphs built while the hooks were off are still held: no hook counted their saved
    tensors, and nothing else may (reading a graph's `_saved_*` would unpack: the job's hooks, a
    checkpoint's recomputed forward). So the activations of every close that finds them held
    are not known; steps are measured meanwhile (`FIRST_STEPS`, every step once it happens
    again), so graphs built from now on are counted. A data-dependent switch at the same close
    is said if this was said already."""
    state = decision.next_state
    if decision.reading.new_unarmed:
        # New graphs built unarmed, not the same ones held longer.
        state = replace(state, crossings=state.crossings + 1)
    cause = Cause.HELD_UNARMED
    if state.crossings >= CROSSINGS_FOR_EVERY and state.mode is ActivationMode.AUTO:
        state, cause = replace(state, mode=ActivationMode.EVERY), Cause.HELD_CROSSING
    also = Cause.DATA_DEPENDENT if decision.cause is Cause.DATA_DEPENDENT else None
    held = replace(decision, verdict=NOT_KNOWN, cause=cause, also=also, next_state=state)
    return _measure(held, FIRST_STEPS, Cause.GRAPHS_HELD)


def _confirm(decision: Decision) -> Decision:
    """A carry candidate: it stands when its counters confirm it; otherwise not known and the
    next step measured, every step from now on when it keeps happening."""
    carried = decision.verdict.carried
    assert carried is not None
    reading, state = decision.reading, decision.next_state
    mismatch = _unconfirmed(reading, carried)
    recent = (*state.recent, mismatch is None)[-RECENT_CARRIES:]
    state = replace(state, recent=recent)
    if mismatch is None:
        return replace(decision, next_state=state, twin=carried)
    unconfirmed = sum(1 for confirmed in recent if not confirmed)
    cause = _UNCONFIRMED.get(mismatch.what, Cause.NO_COUNTER)
    if cause is not Cause.NO_COUNTER and (
        unconfirmed >= UNCONFIRMED_FOR_EVERY and state.mode is ActivationMode.AUTO
    ):
        cause = Cause.HEAP_KEEPS_MOVING if cause is Cause.HEAP else Cause.KEEPS_VARYING
    if cause in (Cause.NO_COUNTER, Cause.HEAP_KEEPS_MOVING, Cause.KEEPS_VARYING):
        state = replace(state, mode=ActivationMode.EVERY)
    unknown = replace(
        decision, verdict=NOT_KNOWN, cause=cause, next_state=state, twin=carried, mismatch=mismatch
    )
    return _measure(unknown, 1, Cause.AFTER_NOT_KNOWN)


def _unconfirmed(reading: ActivationReading, carried: Figures) -> Mismatch | None:
    """Why the repeat does not stand (None: its counters confirm it)."""
    figures = reading.figures
    now, twin = figures.signature, carried.signature
    if not reading.counter or now is None or twin is None:
        return Mismatch(Difference.COUNTER, (), ())
    mismatch = compare(now, twin, carried.high.counted()[3])
    if mismatch is not None:
        return mismatch
    held_now = (figures.start_activations, figures.end_activations)
    held_then = (carried.start_activations, carried.end_activations)
    if held_now != held_then:
        return Mismatch(Difference.HELD, held_now, held_then)
    # The twin's peak holds its own weights and optimizer state: a step in which these reached
    # other highs (an `AveragedModel` deep-copied in it, state made or freed) does not repeat
    # it, whatever its calls did.
    weights, _, state, _ = figures.high.counted()
    then_weights, _, then_state, _ = carried.high.counted()
    if (weights, state) != (then_weights, then_state):
        return Mismatch(Difference.PILES, (weights, state), (then_weights, then_state))
    return None
