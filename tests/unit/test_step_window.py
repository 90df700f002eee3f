"""The step window (`steps.window.StepWindow`) on its own: where a step opens, what it collects,
the three closes, the held GradScaler skip and the optimizer-or-backward rule.

The close's measurements, the gate and the ledger are stand-ins that record what the window asks
of them, so each rule is checked without hooks or a training job.
"""

from __future__ import annotations

import pytest
import torch

from memtui_agent.job.optimizer_book import OptimizerRecord
from memtui_agent.steps.activation_policy import Verdict
from memtui_agent.steps.frame import ClosedStep, CloseReading, StepInputs
from memtui_agent.steps.window import MAX_LOSSES_PER_STEP, OpenStep, StepWindow
from memtui_protocol.schema import AlertKind, StepTrigger


class Closer:
    """Records each close and gives inputs that end one second after the step began."""

    def __init__(self) -> None:
        self.calls: list[tuple[OpenStep, int, bool, OptimizerRecord | None]] = []

    def close(
        self, opened: OpenStep, step: int, skipped: bool, record: OptimizerRecord | None
    ) -> StepInputs:
        self.calls.append((opened, step, skipped, record))
        return StepInputs(
            step=step,
            t_start=opened.started,
            t_end=opened.started + 1.0,
            reading=CloseReading(step),
            verdict=Verdict(measured=True),
            skipped=skipped,
            microbatches=opened.microbatches,
            closed_by=StepTrigger.BACKWARD if record is None else StepTrigger.OPTIMIZER,
            raised=tuple(opened.raised),
        )


class Parts:
    """The window with stand-ins, and what each was asked."""

    def __init__(self, optimizers: bool = False) -> None:
        self.closer = Closer()
        self.opened: list[int] = []
        self.resets = 0
        self.emitted: list[ClosedStep] = []
        self.searches = 0
        self._optimizers = optimizers
        self.window = StepWindow(self.closer, self, self, self.emitted.append, self._search)

    def step_opens(self, after: StepInputs) -> None:
        self.opened.append(after.step)

    def reset_step(self, start_gradients: int | None = None) -> None:
        self.resets += 1

    def _search(self) -> bool:
        self.searches += 1
        return self._optimizers


def record(steps: int = 1) -> OptimizerRecord:
    return OptimizerRecord(kind="SGD", name="SGD#1", steps=steps)


class Scaler:
    """The part of a GradScaler the window reads: its scale tensor."""

    def __init__(self, scale: float) -> None:
        self._scale = torch.tensor(scale)


def test_an_optimizer_step_closes_the_open_step_and_opens_the_next() -> None:
    parts = Parts()
    window = parts.window
    first = window.current
    assert window.number == 1
    window.backward_started()
    window.backward_started()
    window.loss(torch.tensor(0.5))
    window.optimizer_stepped(record())
    [(opened, step, skipped, closed_by)] = parts.closer.calls
    assert opened is first and step == 1 and not skipped and closed_by is not None
    [closed] = parts.emitted
    assert closed.inputs.microbatches == 2
    assert [float(loss) for loss in closed.losses] == [0.5]
    # The next step opened where this one closed: the gate decided, the marks restarted.
    assert parts.opened == [1] and parts.resets == 1
    assert window.number == 2 and window.current is not first
    assert window.current.started == closed.inputs.t_end
    assert window.current.microbatches == 0 and window.current.losses == []


def test_without_an_optimizer_each_backward_closes_and_the_job_is_searched_once() -> None:
    parts = Parts(optimizers=False)
    for _ in range(3):
        parts.window.backward_started()
        parts.window.backward_returned()
    assert parts.searches == 1
    assert parts.window.trigger is StepTrigger.BACKWARD
    assert [closed.inputs.step for closed in parts.emitted] == [1, 2, 3]
    assert all(call[3] is None for call in parts.closer.calls)


def test_an_optimizer_found_at_the_first_backward_leaves_the_closing_to_it() -> None:
    parts = Parts(optimizers=True)
    parts.window.backward_returned()
    parts.window.backward_returned()
    assert parts.searches == 1 and parts.window.trigger is StepTrigger.OPTIMIZER
    assert parts.emitted == []


def test_an_optimizer_after_backward_closes_says_the_rule_changed_once() -> None:
    parts = Parts()
    window = parts.window
    window.backward_returned()
    window.backward_returned()
    window.optimizer_exists()
    window.optimizer_exists()  # already the rule: said once
    window.backward_returned()  # no longer closes
    assert window.trigger is StepTrigger.OPTIMIZER and len(parts.emitted) == 2
    window.optimizer_stepped(record())
    raised = parts.emitted[-1].inputs.raised
    assert [alert.kind for alert in raised] == [AlertKind.STEP_RULE]
    assert "after 2 steps" in raised[0].message


def test_a_skip_is_held_until_its_scaler_updates_with_the_scale_after() -> None:
    parts = Parts()
    window = parts.window
    scaler = Scaler(65536.0)
    window.scale_used(torch.tensor(65536.0))
    window.scaler_skipped(record(), scaler)
    assert parts.emitted == [] and window.trigger is StepTrigger.OPTIMIZER
    assert parts.closer.calls[0][2] is True  # closed as skipped, at once
    assert window.number == 2  # the next step is open already
    window.scaler_updated(Scaler(1.0))  # another scaler: not this skip's
    assert parts.emitted == []
    scaler._scale = torch.tensor(32768.0)  # update() halved it in place
    window.scaler_updated(scaler)
    [closed] = parts.emitted
    assert closed.inputs.skipped and float(closed.scale) == 65536.0
    assert float(closed.scale_after) == 32768.0
    window.scaler_updated(scaler)  # released once
    assert len(parts.emitted) == 1


def test_a_held_skip_goes_out_before_the_next_close_and_as_it_is() -> None:
    parts = Parts()
    window = parts.window
    window.scaler_skipped(record(), Scaler(8.0))
    window.optimizer_stepped(record(2))
    assert [closed.inputs.step for closed in parts.emitted] == [1, 2]
    assert parts.emitted[0].scale_after is None
    window.scaler_skipped(record(3), Scaler(8.0))
    window.release_held_skip()  # the job ended before update()
    assert [closed.inputs.step for closed in parts.emitted] == [1, 2, 3]


def test_losses_are_single_values_detached_and_bounded() -> None:
    window = Parts().window
    weight = torch.ones(1, requires_grad=True)
    window.loss((weight * 2).sum())
    window.loss(torch.ones(3))  # not a loss: more than one value
    window.loss("not a tensor")
    assert len(window.current.losses) == 1
    assert not window.current.losses[0].requires_grad
    for _ in range(MAX_LOSSES_PER_STEP + 5):
        window.loss(torch.tensor(1.0))
    assert len(window.current.losses) == MAX_LOSSES_PER_STEP


def test_a_backward_of_a_scaled_loss_records_the_loss_unscaled() -> None:
    window = Parts().window
    loss = torch.tensor(0.25)
    scaled = loss * 1024
    window.loss_scaled(loss, scaled)
    assert not window.gradients_scaled
    window.loss(scaled)
    assert [float(value) for value in window.current.losses] == [0.25]
    assert window.gradients_scaled
    window.unscaled()
    assert not window.gradients_scaled


@pytest.mark.parametrize("closed_before", [0, 41])
def test_the_open_steps_number_follows_the_closed_count(closed_before: int) -> None:
    parts = Parts()
    parts.window.closed = closed_before  # an attached agent starts from the job's own count
    parts.window.optimizer_stepped(record())
    assert parts.closer.calls[0][1] == closed_before + 1
    assert parts.window.closed == closed_before + 1
