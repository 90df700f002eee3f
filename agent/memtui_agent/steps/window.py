"""A step's life: where it opens, what happens in it, and the three ways it closes.

docs/design.md#steps. A step opens when the agent starts and again at every close (`_open`). While
it is open, the hooks and wrappers report to it: each top-level backward is a microbatch and
brings its loss, GradScaler says which scale the backward used and whether the gradients were
unscaled, and alerts raised on the way wait for the step's frame. It closes in one of three ways:

- a top-level `optimizer.step()` returns (`optimizer_stepped`);
- a GradScaler skips that optimizer's update, which fires no optimizer hook (`scaler_skipped`):
  the step closes at once (so the next optimizer's frame does not take its window) and its frame
  is held until `GradScaler.update()` says the scale after the skip (`scaler_updated`), or until
  anything else closes or ends;
- in a job with no optimizer, a top-level backward returns (`backward_returned`).

Which of optimizer or backward closes steps is decided once (`trigger`): at the first top-level
backward the heap is searched for optimizers, and any optimizer built or stepping afterwards makes
it the optimizer from then on (with an alert if backward closed steps before).

The window keeps the step's own values only; the close's measurements are gathered by a `Closer`
(`step_closer`), and the activation gate decides how the next step is measured as it opens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import torch

from memtui_agent.job.optimizer_book import OptimizerRecord
from memtui_agent.steps.frame import ClosedStep, StepInputs
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, StepTrigger

MAX_LOSSES_PER_STEP = 256


class OpenStep(msgspec.Struct):
    """The step in progress: what its hooks reported since it opened."""

    started: float
    microbatches: int = 0
    losses: list[Any] = []
    """Each top-level backward's loss, detached (unscaled when GradScaler scaled it)."""
    scaled_loss: tuple[int, Any] | None = None
    """(id of `GradScaler.scale`'s result, the loss it scaled): a backward of that result is a
    backward of this loss, scaled."""
    scale: Any = None
    """The scale the step's backward used (a copy; `update()` changes the scaler's in place)."""
    scaled_backward: bool = False
    unscaled: bool = False
    raised: list[schema.Alert] = []
    """Alerts raised during the step, for its frame."""


class Closer(Protocol):
    """Gathers a closing step's inputs (`step_closer.StepCloser`)."""

    def close(
        self, opened: OpenStep, step: int, skipped: bool, record: OptimizerRecord | None
    ) -> StepInputs:
        """Everything the step's frame is built from, measured now."""
        ...


class Opener(Protocol):
    """Decides how a step is measured as it opens (`gate.ActivationGate`)."""

    def step_opens(self, after: StepInputs) -> None:
        """A step opens after the step `after` closed."""
        ...


class Marks(Protocol):
    """The per-step high-water marks (`Ledger`)."""

    def reset_step(self, start_gradients: int | None = None) -> None:
        """High-water marks restart from the piles now, with the gradients alive now
        (`start_gradients`, counted at the close) where the marks do not hold them."""
        ...


class HeldSkip(msgspec.Struct, frozen=True):
    """A skipped step's frame, waiting for its `GradScaler.update()`."""

    closed: ClosedStep
    scaler: Any


class StepWindow:
    """The open step, the rule that closes it, and a skipped step waiting for its scale."""

    def __init__(
        self,
        closer: Closer,
        opener: Opener,
        marks: Marks,
        emit: Callable[[ClosedStep], None],
        optimizers_exist: Callable[[], bool],
    ) -> None:
        """`optimizers_exist` searches the job for optimizers (once, at the first backward of a
        job whose optimizers have not stepped yet)."""
        self._closer = closer
        self._opener = opener
        self._marks = marks
        self._emit = emit
        self._optimizers_exist = optimizers_exist
        self.trigger: StepTrigger | None = None
        """What closes steps: None until the first top-level backward or optimizer step."""
        self.closed = 0
        """The last closed step's number (an attached agent starts from the job's own count)."""
        self.recorded = 0
        """Steps this agent closed (and recorded): `closed` minus the job's steps before an
        attach."""
        self._held: HeldSkip | None = None
        self.current = OpenStep(started=time.time())

    @property
    def number(self) -> int:
        """The open step's number (1-based)."""
        return self.closed + 1

    def _open(self, after: StepInputs) -> None:
        """A step opens where `after` closed: the gate arms or disarms the hooks for it, and
        the ledger's high-water marks restart from the piles now."""
        self._opener.step_opens(after)
        self._marks.reset_step(after.start_of_next().gradients)
        self.current = OpenStep(started=after.t_end)

    # ----- within the step ---------------------------------------------------------------------

    def backward_started(self) -> None:
        """A top-level backward begins: one more microbatch."""
        self.current.microbatches += 1

    def loss(self, tensors: Any) -> None:
        """The tensor a top-level backward starts from: the step's loss if it is one value."""
        if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
            return
        current = self.current
        if len(current.losses) >= MAX_LOSSES_PER_STEP:
            return
        scaled = current.scaled_loss
        if scaled is not None and scaled[0] == id(tensors):
            current.scaled_backward = True
            current.losses.append(scaled[1])
        else:
            current.losses.append(tensors.detach())

    def loss_scaled(self, loss: Any, scaled: Any) -> None:
        """`GradScaler.scale(loss)` returned `scaled`."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.current.scaled_loss = (id(scaled), loss.detach())

    def scale_used(self, scale: Any) -> None:
        """`GradScaler.step` is about to run with this scale (a copy of the scaler's)."""
        self.current.scale = scale

    def unscaled(self) -> None:
        """`GradScaler.unscale_` ran: the gradients are true values now."""
        self.current.unscaled = True

    @property
    def gradients_scaled(self) -> bool:
        """Whether the gradients still carry GradScaler's scale (a backward of a scaled loss,
        no `unscale_` since)."""
        return self.current.scaled_backward and not self.current.unscaled

    def note(self, alert: schema.Alert) -> None:
        """An alert for the open step's frame."""
        self.current.raised.append(alert)

    def forget_losses(self) -> None:
        """The open step's backwards so far were another thread's (the agent moved to the
        thread that stepped first, `hooks.training_thread`): its microbatches, losses and
        scales are not this step's."""
        self.current = msgspec.structs.replace(
            self.current,
            microbatches=0,
            losses=[],
            scaled_loss=None,
            scale=None,
            scaled_backward=False,
            unscaled=False,
        )

    def optimizer_exists(self) -> None:
        """An optimizer was built or steps: from now on steps close at its `step()`, not at
        backward (an accumulation window must not be cut at each backward)."""
        if self.trigger is StepTrigger.BACKWARD and self.closed:
            self.note(
                schema.Alert(
                    kind=AlertKind.STEP_RULE,
                    message=f"an optimizer appeared after {self.closed} steps that were "
                    "closed by backward(): from here on each optimizer.step() closes a step",
                )
            )
        self.trigger = StepTrigger.OPTIMIZER

    # ----- the three closes --------------------------------------------------------------------

    def optimizer_stepped(self, record: OptimizerRecord) -> None:
        """The top-level `step()` of `record`'s optimizer returned."""
        self._emit(self._close(False, record))

    def scaler_skipped(self, record: OptimizerRecord, scaler: Any) -> None:
        """`scaler` skipped the update of `record`'s optimizer: the step closes now, and its
        frame waits for `scaler.update()`, which knows the scale after the skip."""
        self.optimizer_exists()
        self._held = HeldSkip(self._close(True, record), scaler)

    def backward_returned(self) -> None:
        """A top-level backward returned in a job where no optimizer has stepped yet.

        The first time, the job is searched for optimizers (built before the agent, or not
        stepped yet); with none, each top-level backward closes a step (manual updates,
        gradient analysis).
        """
        if self.trigger is None:
            found = self._optimizers_exist()
            self.trigger = StepTrigger.OPTIMIZER if found else StepTrigger.BACKWARD
        if self.trigger is StepTrigger.BACKWARD:
            self._emit(self._close(False, None))

    def _close(self, skipped: bool, record: OptimizerRecord | None) -> ClosedStep:
        """Close the open step and open the next; the closed step's message."""
        self.release_held_skip()
        opened = self.current
        inputs = self._closer.close(opened, self.closed + 1, skipped, record)
        self.closed = inputs.step
        self.recorded += 1
        self._open(inputs)
        return ClosedStep(inputs, opened.losses, opened.scale)

    # ----- the held skip -----------------------------------------------------------------------

    def scaler_updated(self, scaler: Any) -> None:
        """`scaler.update()` returned: a skip it held goes out with the scale after it."""
        held = self._held
        if held is None or held.scaler is not scaler:
            return
        self._held = None
        try:
            after = scaler._scale.detach().clone()
        except Exception:
            after = None
        self._emit(msgspec.structs.replace(held.closed, scale_after=after))

    def release_held_skip(self) -> None:
        """Emit a skipped step still waiting for its `GradScaler.update()`, as it is."""
        held, self._held = self._held, None
        if held is not None:
            self._emit(held.closed)
