"""A step's frame, built once from the inputs its close gathered, by a pure function.

A close first gathers everything the frame says (`step_closer.StepCloser.close`): the ledger's
piles at the close, the gradients counted outside the ledger, the activation gate's verdict with
the figures a repeat carries, the allocator's counters with NVML's, the process's memory, the
health check's alerts, alerts of earlier steps that arrived late, the data-parallel wrappers'
memory, the allocator events drained and the alerts raised during the step. Those inputs are one
frozen `StepInputs`; `build_step` turns them into the `schema.Step` the recording and viewers
get, and nothing writes into the frame afterwards. Tests build frames from hand-made inputs, with
no hooks and no training job.

What is not an input yet when the step closes comes with the build: the step's loss and
GradScaler scales (read on the host, or None while their copies travel, `late_values`), values
of earlier steps that reached the host since, and the emitter's count of dropped frames.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from memtui_agent.memory.alloc_trace import Drained
from memtui_agent.steps.activation_policy import Verdict
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, Pile


class LedgerReading(msgspec.Struct, frozen=True):
    """The ledger's piles as the step closes (`Ledger.at_close`, `Ledger.top_modules`); the
    defaults are a ledger that counted nothing."""

    end: schema.Piles = schema.Piles()
    high: schema.Piles = schema.Piles()
    """Each pile's high-water mark during the step (the frame's `max`)."""
    peak: schema.Piles = schema.Piles()
    dtypes: dict[str, dict[str, schema.DtypeStat]] = {}
    top: list[schema.ModuleBytes] = []
    steady: frozenset[Pile] = frozenset((Pile.WEIGHTS, Pile.GRADIENTS, Pile.OPTIMIZER_STATE))
    """The persistent piles the ledger watched through the step without their bytes moving
    (`Ledger.steady`): known at every moment of it, the peak's included."""
    gradients_watched: bool = True
    """The gradient hooks kept the gradients pile in the ledger from the step's opening to its
    close (`Ledger.gradients_watched`): its high is the ledger's own."""


class CloseReading(msgspec.Struct, frozen=True):
    """What a close measured, as the activation gate's verdict reads it.

    The allocator's counters are here for the check that confirms a carry exactly (allocated at
    the close and the peak since the step began, against the measured step's): the verdict
    takes the whole reading, so that check is added inside it, not around it.
    """

    step: int
    ledger: LedgerReading = LedgerReading()
    allocator: schema.Allocator = schema.Allocator()


class StepInputs(msgspec.Struct, frozen=True):
    """Everything a closed step's frame is built from, gathered at its close.

    Fields that a step often lacks default as `schema.Step`'s do.
    """

    step: int
    t_start: float
    t_end: float
    reading: CloseReading
    verdict: Verdict
    skipped: bool = False
    microbatches: int = 0
    closed_by: schema.StepTrigger = schema.StepTrigger.OPTIMIZER
    optimizer: str | None = None
    """The optimizer whose top-level `step()` (or GradScaler skip) closed it (`AdamW#1`)."""
    optimizer_step: int | None = None
    gradients: tuple[int, dict[str, schema.DtypeStat]] | None = None
    """The gradients pile counted outside the ledger (bytes, dtype inventory) at an unarmed
    close; None when the ledger holds the gradients."""
    host: schema.Host = schema.Host()
    raised: tuple[schema.Alert, ...] = ()
    """Alerts raised during the step by the hooks and wrappers (clipping order, first-step
    growth, the step rule, the attach)."""
    fragmentation: schema.Alert | None = None
    health: tuple[schema.Alert, ...] = ()
    grad_norm: float | None = None
    """The step's global gradient norm when the health check read it at the close (host
    gradients); None when not known or deferred (then a later frame's `late` carries it)."""
    over_budget: schema.Alert | None = None
    late: tuple[schema.StepLate, ...] = ()
    """Alerts of earlier steps whose checks reached the host since (CUDA: read late)."""
    distributed: schema.Distributed | None = None
    alloc_events: Drained | None = None
    """`--alloc-events`: the ring entries read at the close, summarised by `build_step`."""
    activations_left: int = 0
    """Activations still held after the close (graphs kept past it): the next step starts
    from them."""
    leaks: tuple[schema.Leak, ...] = ()
    leak_alerts: tuple[schema.Alert, ...] = ()
    census: schema.CensusCost | None = None
    """The census this close took (a leak suspected, graphs to count, or the tensors the job
    keeps to count), if any."""
    kept: schema.Kept | None = None
    """The tensors the job keeps outside every pile, as this close's census found them."""
    workers: schema.Workers | None = None
    """The job's DataLoader workers as last sampled before the close (`worker_memory`)."""
    blocks: tuple[schema.BlockBytes, ...] = ()
    """The repeated blocks' saved and input bytes, on a measured step (`job.blocks`)."""

    def alerts(self) -> list[schema.Alert]:
        """The step's alerts in the frame's order (without the skip's, which needs the scales)."""
        alerts = list(self.raised)
        if self.fragmentation is not None:
            alerts.append(self.fragmentation)
        alerts.extend(self.health)
        if self.verdict.alert is not None:
            alerts.append(self.verdict.alert)
        if self.verdict.note is not None:
            alerts.append(self.verdict.note)
        if self.over_budget is not None:
            alerts.append(self.over_budget)
        alerts.extend(self.leak_alerts)
        return alerts

    def start_of_next(self) -> schema.Piles:
        """The persistent piles the next step starts from (its activations are its own)."""
        weights, gradients, state, _ = self.reading.ledger.end.counted()
        if self.gradients is not None:
            gradients = self.gradients[0]
        return schema.Piles(weights, gradients, state, 0)


class HostValues(msgspec.Struct, frozen=True):
    """The step's loss (sum of its microbatches' losses) and GradScaler scales, read on the
    host; None where a value is still on its way from the device (or there is none)."""

    loss: float | None = None
    scale: float | None = None
    scale_after: float | None = None


class ClosedStep(msgspec.Struct, frozen=True):
    """A closed step on its way to the emitter, which builds its frame (`build_step`).

    The loss and scales are the job's values as the close saw them (tensors, maybe on a
    device); the emitter reads them on the host or sends them late (`late_values`).
    """

    inputs: StepInputs
    losses: list[Any]
    scale: Any = None
    scale_after: Any = None
    """The scale after a skipped update (`GradScaler.update()` ran after the close)."""


def build_step(
    inputs: StepInputs,
    values: HostValues,
    late: Sequence[schema.StepLate] = (),
    dropped: int = 0,
) -> schema.Step:
    """The `Step` frame of a closed step: the ledger's piles with the gradients counted outside
    it and the activation figures a repeat carries, and every alert in one list.

    Args:
        inputs: what the close gathered.
        values: the step's loss and scales on the host (`HostValues()` while they travel).
        late: values of earlier steps that reached the host since, carried by this frame.
        dropped: frames the emitter's socket queue had no room for so far.
    """
    ledger = inputs.reading.ledger
    dtypes = dict(ledger.dtypes)
    if inputs.gradients is not None:
        dtypes[Pile.GRADIENTS] = inputs.gradients[1]
    end, high, peak = stated_figures(inputs)
    top = ledger.top
    carried = inputs.verdict.carried
    if carried is not None:
        top = list(carried.top)
        dtypes[Pile.ACTIVATIONS] = carried.dtypes
    elif not inputs.verdict.measured:  # what the ledger saw of them is part of them at most
        top = []
        dtypes.pop(Pile.ACTIVATIONS, None)
    alerts = inputs.alerts()
    if inputs.skipped:
        alerts.insert(0, skipped_alert(values.scale, values.scale_after))
    drained = inputs.alloc_events
    return schema.Step(
        step=inputs.step,
        t_start=inputs.t_start,
        t_end=inputs.t_end,
        end=end,
        max=high,
        peak=peak,
        microbatches=inputs.microbatches,
        skipped=inputs.skipped,
        dtypes=dtypes,
        allocator=inputs.reading.allocator,
        host=inputs.host,
        loss=values.loss,
        scale=values.scale,
        grad_norm=inputs.grad_norm,
        alerts=alerts,
        top_activations=top,
        dropped=dropped,
        distributed=inputs.distributed,
        alloc_events=drained.summary() if drained is not None else None,
        closed_by=inputs.closed_by,
        optimizer=inputs.optimizer,
        optimizer_step=inputs.optimizer_step,
        activations_measured=inputs.verdict.measured,
        activations_from=carried.step if carried is not None else None,
        activations_why_at=inputs.verdict.why_at,
        late=[*late, *inputs.late][: schema.MAX_LATE],  # at most 73 by construction
        leaks=list(inputs.leaks),
        census=inputs.census,
        kept=inputs.kept,
        workers=inputs.workers,
        blocks=list(inputs.blocks),
    )


def stated_figures(inputs: StepInputs) -> tuple[schema.Piles, schema.Piles, schema.Piles]:
    """The step's `end`, `max` and `peak` as the frame states them: each pile measured or
    proven, None where the step cannot know it (docs/numbers.md#not-known).

    - `end`: the ledger's piles at the close, with the gradients counted beside it at an
      unarmed close; the activations measured, carried from the twin, or None.
    - A measured step: the ledger's high and peak (its marks start from the opening
      composition, gradients included, `Ledger.reset_step`).
    - A carried step: the twin's high and peak (the repeat is proven by the step's own
      counters).
    - A step whose activations are not known: no high or peak of the activations, so no peak
      moment and no peak total; the weights' and optimizer state's high are the ledger's (it
      watches them the same way on every step), the gradients' only where the gradient hooks
      kept them in the ledger from the step's opening; at the peak's unknown moment only a
      pile that never moved in the step (`LedgerReading.steady`) is known, as its value.

    A stated high below the step's own end (a twin whose gradients ended lower) is not the
    step's high: None.
    """
    ledger = inputs.reading.ledger
    weights, gradients, state, activations = ledger.end.counted()
    if inputs.gradients is not None:
        gradients = inputs.gradients[0]
    verdict = inputs.verdict
    carried = verdict.carried
    if verdict.measured:
        end = schema.Piles(weights, gradients, state, activations)
        high, peak = ledger.high, ledger.peak
    elif carried is not None:
        end = schema.Piles(weights, gradients, state, carried.end_activations)
        high, peak = carried.high, carried.peak
    else:
        end = schema.Piles(weights, gradients, state, None)
        watched = ledger.gradients_watched and inputs.gradients is None
        high = schema.Piles(
            ledger.high.weights,
            ledger.high.gradients if watched else None,
            ledger.high.optimizer_state,
            None,
        )
        steady = ledger.steady
        peak = schema.Piles(
            weights if Pile.WEIGHTS in steady else None,
            gradients if Pile.GRADIENTS in steady and watched else None,
            state if Pile.OPTIMIZER_STATE in steady else None,
            None,
        )
    return end, _not_below(high, end), peak


def _not_below(high: schema.Piles, end: schema.Piles) -> schema.Piles:
    """`high` with each pile that is below its own `end` made None (not the step's high)."""
    values = []
    for name in schema.PILES:
        top, last = getattr(high, name), getattr(end, name)
        values.append(None if top is not None and last is not None and top < last else top)
    return schema.Piles(*values)


def skipped_alert(scale: float | None, after: float | None) -> schema.Alert:
    """`skipped_step`, with the scale change when both scales are known at close (host values)."""
    # The scale after is known when GradScaler.update() ran before the step was written (with
    # two optimizers on one scaler, the other's step may close first).
    change = f"; scale {scale:g} -> {after:g}" if scale and after else ""
    change = change or (f"; at scale {scale:g}" if scale else "")
    return schema.Alert(
        kind=AlertKind.SKIPPED_STEP,
        message="GradScaler skipped the optimizer update (non-finite gradients)" + change,
    )
