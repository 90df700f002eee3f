"""Out of memory explained: when a job died of out-of-memory or went over `--budget`, what the
failed request was, what the piles and the top modules held then, the allocator's unusable
reserve on a GPU, and how large a batch would have fitted.

Built from the recording alone (the `End` frame, the over-budget alert, the steps), so the end
of `memtui run`, `memtui report` and its JSON say the same. A figure the recording does not
prove is `None`, shown as "not known".

The largest batch that fits assumes what `memtui estimate` assumes too: the activations at the
step's peak scale with the batch size, and the weights, gradients and optimizer state at that
moment do not. It is stated as a fraction of the step's batch (the recording does not hold the
batch size), and only against a known limit: the budget. A CUDA device's limit in pile terms
(what the CUDA context, other processes and the allocator's cache leave) is not known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import floor, isinf

from memtui.model.recording import Recording
from memtui.model.step_rows import NOT_KNOWN, activations_known, known_piles
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind
from memtui_protocol.units import format_bytes

TOP_MODULES = 3
"""Modules named, by saved-activation bytes at the step."""

ESTIMATE_HINT = "memtui estimate --budget"
"""The command that plans activation checkpoints under a budget instead of a smaller batch."""


@dataclass(frozen=True)
class Shortfall:
    """What ran out, and what was held when it did (each figure None where not known)."""

    cause: AlertKind
    """`AlertKind.OOM` (the job died) or `AlertKind.OVER_BUDGET` (a step's peak passed it)."""
    step: int | None
    """The step it happened in (for an OOM, the step that never closed)."""
    phase: str | None
    requested: int | None
    """The failed allocation's size (OOM), from the allocator or torch's message."""
    requested_where: str | None
    """`file:line function` that made the failed request (`--alloc-events`)."""
    budget: int | None
    peak: int | None
    """Over budget: the step's tracked peak that passed it."""
    piles: schema.Piles | None
    piles_at: str
    """`peak` (the step's peak composition) or `end` (the piles as the job ended)."""
    piles_step: int | None
    """The step whose peak `piles` is (None with `piles_at` `end`)."""
    modules: tuple[tuple[str, int], ...]
    modules_step: int | None
    """The step whose top activations `modules` are (None: no step knows them)."""
    on_gpu: bool
    reserved_unallocated: int | None
    expandable_segments: bool | None
    batch_fraction: float | None
    """The largest batch that fits the budget, as a fraction of step `piles_step`'s batch."""
    batch_why: str | None
    """Why `batch_fraction` is not known (None when it is)."""
    batch_step: int | None
    """The step whose peak limits `batch_fraction` (the lowest fraction of all closed steps)."""


def explain(recording: Recording) -> Shortfall | None:
    """The run's shortfall: an out-of-memory end first, else the first over-budget alert;
    None when neither happened."""
    end = recording.end
    over = next((item for item in recording.alerts if item.kind == AlertKind.OVER_BUDGET), None)
    hello = recording.hello
    if end is not None and end.oom:
        cause, number, phase = AlertKind.OOM, end.step, end.phase
    elif over is not None:
        cause, number, phase = AlertKind.OVER_BUDGET, over.step, None
    else:
        return None
    step = _step_at(recording, number, cause)
    requested, where = _request(end) if cause is AlertKind.OOM else (None, None)
    if cause is AlertKind.OOM and end is not None and end.piles is not None:
        piles, piles_at, piles_step = end.piles, "end", None
    elif step is not None:
        piles, piles_at, piles_step = known_piles(step, step.peak), "peak", step.step
    else:
        piles, piles_at, piles_step = None, "peak", None
    oom = cause is AlertKind.OOM
    closed = [item for item in recording.steps if not oom or number is None or item.step <= number]
    fraction, why, limiting = _batch_fraction(closed, hello.budget, oom)
    gpu = hello.device == "cuda" or (end is not None and end.reserved_unallocated is not None)
    return Shortfall(
        cause=cause,
        step=number,
        phase=phase,
        requested=requested,
        requested_where=where,
        budget=hello.budget,
        peak=step.peak.total if step is not None and cause is AlertKind.OVER_BUDGET else None,
        piles=piles,
        piles_at=piles_at,
        piles_step=piles_step,
        modules=_top_modules(recording, step),
        modules_step=step.step if step is not None and activations_known(step) else None,
        on_gpu=gpu,
        reserved_unallocated=end.reserved_unallocated if end is not None else None,
        expandable_segments=hello.expandable_segments,
        batch_fraction=fraction,
        batch_why=why,
        batch_step=limiting,
    )


def _step_at(recording: Recording, number: int | None, cause: AlertKind) -> schema.Step | None:
    """The closed step the figures come from: the over-budget alert's own step when it closed,
    else (an OOM's step never closes) the last closed step before it."""
    steps = recording.steps
    if cause is AlertKind.OVER_BUDGET:
        found = next((step for step in steps if step.step == number), None)
        if found is not None:
            return found
    earlier = [step for step in steps if number is None or step.step <= number]
    return earlier[-1] if earlier else None


def _request(end: schema.End | None) -> tuple[int | None, str | None]:
    """The failed allocation's size and, with `--alloc-events`, the source line that made it."""
    if end is None:
        return None, None
    event = end.alloc_events.oom if end.alloc_events is not None else None
    size = end.requested if end.requested is not None else (event.size if event else None)
    return size, (event.where or None) if event is not None else None


def _top_modules(recording: Recording, step: schema.Step | None) -> tuple[tuple[str, int], ...]:
    if step is None or not activations_known(step):
        return ()
    ranked = sorted(step.top_activations, key=lambda item: item.bytes, reverse=True)
    return tuple((recording.module_name(item.module), item.bytes) for item in ranked[:TOP_MODULES])


def _batch_fraction(
    steps: list[schema.Step], budget: int | None, oom: bool
) -> tuple[float | None, str | None, int | None]:
    """The largest fraction f of a step's batch with (peak - activations) + f * activations
    within the budget at every closed step (the step that limits it named), or why it is not
    known.

    Every step counts, not only the one that passed the budget: a batch that fits the first
    step can pass it from the second on, when the optimizer state the first `step()` made is
    held at every later peak. After an out-of-memory, the step that never closed is counted
    too, as the last closed step's activations over what that step left held (its weights and
    optimizer state), which the next step's peak holds as well.
    """
    if budget is None:
        return None, "no --budget: the device's limit in pile terms is not known", None
    if not steps:
        return None, "no step closed, so no step's activations are known", None
    limits: list[tuple[float, int]] = []
    known: list[tuple[schema.Step, int, int]] = []
    for step in steps:
        peak = known_piles(step, step.peak)
        total, activations = peak.total, peak.activations
        if total is None or activations is None:
            continue
        known.append((step, total - activations, activations))
        limits.append((_fraction(total - activations, activations, budget), step.step))
    if not known:
        return None, "no step's activations are known", None
    if oom:
        last, fixed, activations = known[-1]
        held = (last.end.weights or 0) + (last.end.optimizer_state or 0)
        limits.append((_fraction(max(held, fixed), activations, budget), last.step))
    fraction, step_number = min(limits, key=lambda item: item[0])  # ties: the earliest step
    if isinf(fraction):
        return None, "no step saved activations at its peak: the batch does not move it", None
    return fraction, None, step_number


def _fraction(fixed: int, activations: int, budget: int) -> float:
    """f with fixed + f * activations = budget; 0 when the fixed part alone passes it, and
    unbounded (inf) when the step saved no activations within the budget."""
    if fixed >= budget:
        return 0.0
    if activations <= 0:
        return float("inf")
    return (budget - fixed) / activations


def shortfall_lines(shortfall: Shortfall, binary: bool = True) -> list[str]:
    """The explanation in a few lines: what ran out, the piles, the top modules, the GPU's
    reserve (GPU only) and what would fit."""

    def size(value: int | None) -> str:
        return format_bytes(value, binary=binary, missing=NOT_KNOWN)

    lines = [_headline(shortfall, size)]
    if shortfall.piles is not None:
        when = (
            "as the job ended"
            if shortfall.piles_at == "end"
            else f"at step {shortfall.piles_step}'s peak"
        )
        values = ", ".join(
            f"{pile} {size(getattr(shortfall.piles, pile.value))}" for pile in schema.Pile
        )
        lines.append(f"  piles {when}: {values}")
    else:
        lines.append(f"  piles: {NOT_KNOWN} (no step closed)")
    if shortfall.modules:
        named = ", ".join(f"{name} {size(value)}" for name, value in shortfall.modules)
        lines.append(f"  top modules by saved activations (step {shortfall.modules_step}): {named}")
    else:
        lines.append(f"  top modules by saved activations: {NOT_KNOWN}")
    if shortfall.on_gpu and shortfall.cause is AlertKind.OOM:
        lines.append("  " + _gpu_words(shortfall, size))
    lines.append("  " + _fit_words(shortfall, size))
    return lines


def _headline(shortfall: Shortfall, size: Callable[[int | None], str]) -> str:
    if shortfall.cause is AlertKind.OVER_BUDGET:
        over = (
            size(shortfall.peak - shortfall.budget)
            if shortfall.peak is not None and shortfall.budget is not None
            else NOT_KNOWN
        )
        return (
            f"over budget at step {shortfall.step}: tracked peak {size(shortfall.peak)}, "
            f"budget {size(shortfall.budget)}, over by {over}"
        )
    during = f" in {shortfall.phase}" if shortfall.phase else ""
    where = f" at {shortfall.requested_where}" if shortfall.requested_where else ""
    return (
        f"out of memory at step {shortfall.step}{during}: the failed request was "
        f"{size(shortfall.requested)}{where}"
    )


def _gpu_words(shortfall: Shortfall, size: Callable[[int | None], str]) -> str:
    expandable = {
        True: "expandable_segments was on at start",
        False: "expandable_segments was off at start "
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow in place)",
        None: f"expandable_segments: {NOT_KNOWN}",
    }[shortfall.expandable_segments]
    return (
        f"on the GPU: {size(shortfall.reserved_unallocated)} reserved but unallocated "
        f"(fragmentation: free to the allocator, unusable for this request); {expandable}"
    )


def _fit_words(shortfall: Shortfall, size: Callable[[int | None], str]) -> str:
    fraction = shortfall.batch_fraction
    if fraction is None:
        return (
            f"largest batch that fits: {NOT_KNOWN} ({shortfall.batch_why}); "
            f"{ESTIMATE_HINT} plans activation checkpoints"
        )
    budget = size(shortfall.budget)
    if fraction <= 0:
        return (
            f"largest batch that fits: none: weights, gradients and optimizer state alone pass "
            f"the budget of {budget}; {ESTIMATE_HINT} {budget} for what else would"
        )
    # Two decimals, rounded down: a stated fraction must fit, never pass by rounding.
    shown = floor(fraction * 100) / 100
    fitted = " (its peak was within the budget)" if fraction >= 1 else ""
    return (
        f"largest batch that fits the budget of {budget}: {shown:.2f}x step "
        f"{shortfall.batch_step}'s batch{fitted} (assuming activations scale with the batch size "
        f"and the other piles do not); or {ESTIMATE_HINT} for an activation checkpoint plan"
    )
