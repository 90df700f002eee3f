"""The words of every `activations_vary` alert, one template per cause, each said once.

The decision (`decision.decide`) says why a close's activations stand as they do, with the
figures; this module says it to the user. `TEMPLATES` maps each cause that is worth an alert to
its template; a cause missing from it (a plain measurement, a confirmed repeat, `off`, which
the user asked for) raises none: every other step that is not known says why, once per cause.
`SaidOnce` is the one "say it once" of the activation alerts: a cause is said at the first
close that has it, never again (later closes with it only confirm it, and point at that step:
`said_at`), and a decision whose first cause was said already says its second.
"""

from __future__ import annotations

from memtui_agent.steps.activation_cause import Cause
from memtui_agent.steps.activation_policy import Figures
from memtui_agent.steps.decision import Decision
from memtui_agent.steps.step_signature import MEMORY_TOLERANCE, Difference, Mismatch
from memtui_protocol import schema

_REPEAT = "step {step} called the model as step {twin} did, but {clause}"
_NOT_KNOWN = ": {why}; its activations are not known and the next step is measured"
_EVERY = "; {why}, so every step is measured from now on"
_SIZES = "the same calls made tensors of other sizes"
_STRUCTURE = (
    "something its inputs do not show changed (a layer skipped, dropout switched, a branch taken "
    "on the data)"
)
_REPEATS = "{unconfirmed} of the last {recent} steps that repeated a measured step's calls"
_HELD = (
    "at the close of step {step}, {which} saved tensors (a loss accumulated without "
    "torch.no_grad(), an output kept for a later backward): memtui never saw what they saved, so "
    "activations are not known while they are held; the steps after a close that holds graphs "
    "are measured, so graphs built from now on are counted"
)

COMPILED_NOTE = (
    "the job runs torch.compile'd code: memtui measures its activations at every step from now "
    "on, with its hooks left in place, because installing and removing them between steps makes "
    "dynamo compile the model again (its guards read torch's global module hooks), up to its "
    "recompile limit, after which the model runs uncompiled"
)
"""The note said once when `auto` turns into `every` for a compiling job (`AlertKind.COMPILED`)."""

_VARY = (
    "activations differ between steps ({hint}): memtui measures every step where it cannot "
    "prove a repeat; "
)
_SIZES_HINT = "variable sequence lengths or batch sizes?"
_BRANCH_HINT = "dropout, a skipped layer or a branch on the data?"
LEADS: dict[Cause, str] = {
    Cause.DATA_DEPENDENT: _VARY.format(hint="routing or masks that depend on the data?"),
    Cause.JOB_HOOKS: "activations not counted under the job's own saved-tensor hooks: ",
    Cause.HOOKS_DISABLED: "activations not counted where torch.func disables saved-tensor hooks: ",
    Cause.THREAD_MOVED: "memtui now follows the thread that steps the optimizer: ",
    Cause.PARTIAL: _VARY.format(hint=_SIZES_HINT),
    Cause.HELD_UNARMED: "activations not known while graphs from earlier steps are held: ",
    Cause.HELD_CROSSING: "activations not known while graphs from earlier steps are held: ",
    Cause.NODES: _VARY.format(hint=_BRANCH_HINT),
    Cause.BACKWARDS: _VARY.format(hint=_BRANCH_HINT),
    Cause.DEVICE: _VARY.format(hint=_SIZES_HINT),
    Cause.READERS: _VARY.format(hint="memory read from another counter"),
    Cause.HEAP: _VARY.format(hint=_SIZES_HINT),
    Cause.HELD: _VARY.format(hint="graphs kept from earlier steps changed"),
    Cause.PILES: _VARY.format(hint="a model or an optimizer's state made or freed in the step"),
    Cause.NO_COUNTER: _VARY.format(hint="this torch cannot confirm a repeat"),
    Cause.KEEPS_VARYING: _VARY.format(hint=_BRANCH_HINT),
    Cause.HEAP_KEEPS_MOVING: _VARY.format(hint=_SIZES_HINT),
}
"""Cause -> the alert's first words: what varies and what memtui does about it, in the user's
terms, so a row cut to the width of a table still reads (the template after it says which step,
and the counters that differed)."""

TEMPLATES: dict[Cause, str] = {
    Cause.DATA_DEPENDENT: (
        "step {step} repeats step {twin} (the same calls, shapes, piles and autograd ops) but its "
        "activations differ ({differences}): what the model saves depends on the data (routing, "
        "masks), so every step is measured from now on"
    ),
    Cause.HOOKS_DISABLED: (
        "in step {step} the job ran torch.func's grad, vjp, jacrev or hessian, which refuse "
        "saved-tensor hooks (torch raises if any are active): memtui takes its own out while "
        "they run, so what they save is not counted and the activations of such steps are not "
        "known"
    ),
    Cause.JOB_HOOKS: (
        "in step {step} the job's own saved-tensor hooks (torch.utils.checkpoint over the model, "
        "save_on_cpu, its own pack hooks) were active when the model ran: memtui does not put its "
        "own above them (that would change what the job saves), so the activations of such steps "
        "are not known"
    ),
    Cause.THREAD_MOVED: (
        "step {step} began while memtui followed another thread, and this thread stepped the "
        "first optimizer: memtui follows that thread from here (one thread per recording), so the "
        "activations of this step's forward, which it did not see, are not known"
    ),
    Cause.PARTIAL: (
        "step {step} began as a repeat of a measured step, with memtui's hooks off, and then "
        "called the model in a way no measured step did (other shapes, another model, more "
        "calls: gradient accumulation over batches of varying length): the hooks counted only "
        "from that call on, so its activations are not known and the next step is measured"
    ),
    Cause.HELD_UNARMED: _HELD,
    Cause.HELD_CROSSING: (
        _HELD + "; graphs keep crossing steps in this job, so every step is measured from now on"
    ),
    Cause.NODES: _REPEAT + _NOT_KNOWN.format(why=_STRUCTURE),
    Cause.BACKWARDS: _REPEAT + _NOT_KNOWN.format(why=_STRUCTURE),
    Cause.DEVICE: _REPEAT + _NOT_KNOWN.format(why=_SIZES),
    Cause.READERS: _REPEAT + _NOT_KNOWN.format(why=_SIZES),
    Cause.HEAP: _REPEAT
    + _NOT_KNOWN.format(
        why=_SIZES + ", or memtui's own allocations while it measured moved the heap: the heap "
        "cannot tell which"
    ),
    Cause.HELD: _REPEAT + _NOT_KNOWN.format(why="graphs kept from earlier steps changed"),
    Cause.PILES: _REPEAT
    + _NOT_KNOWN.format(
        why="its weights or optimizer state changed during the step (a model, a copy of one or "
        "an optimizer's state made or freed), so the measured step's peak does not hold for it"
    ),
    Cause.NO_COUNTER: _REPEAT + _EVERY.format(why="no carry can be confirmed in this job"),
    Cause.KEEPS_VARYING: _REPEAT
    + _EVERY.format(
        why=_REPEATS + " did something else: this job's activations change with what its inputs "
        "do not show (LayerDrop, sampling, data-dependent branches)"
    ),
    Cause.HEAP_KEEPS_MOVING: _REPEAT
    + _EVERY.format(
        why=_REPEATS + " could not be confirmed by the heap, which also moves with what memtui "
        "allocates while it measures (by more than the tolerance in this job)"
    ),
}
"""Cause -> template; the fields are `_fields`' (a template uses those it needs)."""

CLAUSES: dict[Difference, str] = {
    Difference.NODES: (
        "autograd recorded {now_total:,} nodes here ({now_series} before and after each backward) "
        "and {then_total:,} in step {twin} ({then_series})"
    ),
    Difference.BACKWARDS: "it ran {now_backwards} backward passes where step {twin} ran "
    "{then_backwards}",
    Difference.HEAP: (
        "the heap in use at its first backward had grown from its start by an amount more "
        "than {tolerance_kib} KiB away from step {twin}'s"
    ),
    Difference.DEVICE: (
        "the allocator made {now1:,} allocations of {now0:,} B in all where step {twin} made "
        "{then1:,} of {then0:,} B"
    ),
    Difference.HELD: (
        "it started with {now0:,} B of activations held and closed with {now1:,} B, step {twin} "
        "with {then0:,} B and {then1:,} B"
    ),
    Difference.PILES: (
        "its weights and optimizer state reached {now0:,} B and {now1:,} B, step {twin}'s "
        "{then0:,} B and {then1:,} B"
    ),
    Difference.READERS: "its memory was read from another counter than step {twin}'s",
    Difference.COUNTER: "this torch has no autograd node counter to confirm it by",
}
"""What differed between a repeat and its twin, one clause per `Difference`."""


def clause(mismatch: Mismatch, twin_step: int) -> str:
    """One clause: what was counted in the step and in its twin, step `twin_step`."""
    now, then = mismatch.now, mismatch.then
    fields: dict[str, object] = {
        "twin": twin_step,
        "now_total": sum(now),
        "then_total": sum(then),
        "now_series": _series(now),
        "then_series": _series(then),
        "now_backwards": len(now) - 1,
        "then_backwards": len(then) - 1,
        "tolerance_kib": MEMORY_TOLERANCE // 1024,
    }
    for name, values in (("now", now), ("then", then)):
        for index, value in enumerate(values[:2]):
            fields[f"{name}{index}"] = value
    return CLAUSES[mismatch.what].format(**fields)


def differences(figures: Figures, other: Figures) -> list[str]:
    """The activation figures two measurements disagree on, each with both numbers: the step's
    highest activations and those left at its close (`decision._data_dependent`)."""
    pairs = (
        ("max", figures.high.activations, other.high.activations),
        ("at the close", figures.end_activations, other.end_activations),
    )
    return [
        f"{label} {mine:,} B vs {theirs:,} B" for label, mine, theirs in pairs if mine != theirs
    ]


def message(cause: Cause, decision: Decision) -> str:
    """The alert's words for `cause` at this decision: its lead (what varies), then which step
    and what differed. The heap's own figures stay in the decision's `Mismatch` (memtui's
    evidence, not a number the user can act on)."""
    return LEADS[cause] + TEMPLATES[cause].format(**_fields(decision))


def _fields(decision: Decision) -> dict[str, object]:
    reading, twin, mismatch = decision.reading, decision.twin, decision.mismatch
    unarmed = reading.unarmed_held
    which = (
        "a graph built by the model while memtui's hooks were off still holds its"
        if unarmed == 1
        else f"{unarmed} graphs built by the model while memtui's hooks were off still hold their"
    )
    return {
        "step": reading.step,
        "twin": twin.step if twin is not None else None,
        "clause": clause(mismatch, twin.step) if mismatch is not None and twin else "",
        "differences": "; ".join(differences(reading.figures, twin)) if twin else "",
        "which": which,
        "unconfirmed": decision.unconfirmed,
        "recent": len(decision.next_state.recent),
    }


def _series(values: tuple[int, ...]) -> str:
    return ", ".join(f"{value:,}" for value in values)


class SaidOnce:
    """The activation alerts of one recording: each cause said once."""

    def __init__(self) -> None:
        self._said: dict[Cause, int] = {}
        """Each cause said, with the step whose alert said it."""

    def alert(self, decision: Decision) -> schema.Alert | None:
        """The decision's alert: its first cause with words not said yet (None: nothing new)."""
        for cause in decision.causes:
            if cause in TEMPLATES and cause not in self._said:
                self._said[cause] = decision.reading.step
                return schema.Alert(
                    kind=schema.AlertKind.ACTIVATIONS_VARY, message=message(cause, decision)
                )
        return None

    def said_at(self, decision: Decision) -> int | None:
        """For a decision whose activations are not known: the step whose alert said why (its
        first cause's; None for a step measured or carried, and under `off`). So every such step
        points at its reason, though each reason is said once (`Step.activations_why_at`)."""
        verdict = decision.verdict
        if verdict.measured or verdict.carried is not None:
            return None
        return self._said.get(decision.cause)
