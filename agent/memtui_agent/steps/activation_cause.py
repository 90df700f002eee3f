"""Why a step's activations stand as they do: one member per reason (`decision.decide`).

Its own module because both sides name it: the policy says why it armed a step (the cause of
a measured step, and why steps are measured next), the decision says why a close's activations
are measured, carried or not known, and the wording (`activation_wording`) has one template per
cause worth an alert.
"""

from __future__ import annotations

from enum import Enum

from memtui_agent.steps.step_signature import Difference


class Cause(Enum):
    """Why a close's activations stand as they do: one member per reason, one alert each."""

    MEASURED = "measured"
    """Armed from its start (the agent's first step, `--activations every`, a step with no root
    call): its figures are its own."""
    NEW_SIGNATURE = "new signature"
    """Measured: its first root call began no remembered step (new shapes, piles, optimizers)."""
    FIRST_STEPS = "first steps"
    """Measured: one of an optimizer's first steps (its state and the graph settle in them)."""
    AFTER_ALERT = "after an alert"
    """Measured: one of the steps after an alert that calls for measuring, or a skipped step."""
    GRAPHS_HELD = "graphs held"
    """Measured: one of the steps after a close that found graphs held (`MEASURE_WHILE_HELD`)."""
    AFTER_NOT_KNOWN = "after not known"
    """Measured: the step after one whose activations were not known."""
    MUST_MEASURE = "must measure"
    """Measured: NaN/Inf module probes armed, FSDP, or a peak near the budget (the gate's)."""
    AUDIT = "audit"
    """Measured: an audit step (every `audit_every` steps)."""
    WHOLE_AFTER_PARTIAL = "whole after partial"
    """Measured whole: a step from a start whose last step was measured in part."""
    NOTHING_SAVED = "nothing saved"
    """Measured without hooks: the step recorded no autograd node and ran no backward, and no
    graph was held at its start or close, so nothing was saved: its activations were 0 (the
    second optimizer's close when two step after one backward)."""
    REPEAT = "repeat"
    """It repeats a measured step, and its counters confirm it: that step's figures."""
    OFF = "off"
    """`--activations off`: nothing is measured."""
    PARTIAL = "measured in part"
    """Armed only from a root call that left every remembered repeat, or a repeat's calls that
    then ran differently: not known, the next step measured."""
    DATA_DEPENDENT = "data dependent"
    """A measured repeat (same calls, piles and autograd ops) measured other activations: what
    the model saves depends on the data; every step is measured."""
    JOB_HOOKS = "job hooks"
    """The job's own saved-tensor hooks were on top when the model ran: not known."""
    HOOKS_DISABLED = "hooks disabled"
    """A forward of the step ran where torch disables saved-tensor hooks (torch.func's grad,
    vjp, jacrev, hessian): what it saved is not counted, not known."""
    THREAD_MOVED = "thread moved"
    """The step began while the agent followed another thread: its forward ran unseen."""
    HELD_UNARMED = "held"
    """Graphs built while the hooks were off are still held: not known while held."""
    HELD_CROSSING = "held, every step"
    """Such graphs keep crossing steps: every step is measured."""
    NODES = Difference.NODES.value
    BACKWARDS = Difference.BACKWARDS.value
    DEVICE = Difference.DEVICE.value
    READERS = Difference.READERS.value
    HEAP = Difference.HEAP.value
    HELD = Difference.HELD.value
    PILES = Difference.PILES.value
    """A repeat whose counters differ from its twin's in this (`step_signature.Difference`):
    not known, the next step measured."""
    NO_COUNTER = "no node counter"
    """A repeat that cannot be confirmed at all (no autograd node counter): every step."""
    KEEPS_VARYING = "keeps varying"
    """Repeats keep doing something else than their twins (LayerDrop): every step."""
    HEAP_KEEPS_MOVING = "heap keeps moving"
    """Repeats keep failing the heap's confirmation (it moves with the agent's own measuring by
    more than the tolerance): every step."""
