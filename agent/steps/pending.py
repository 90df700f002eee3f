"""A closed step, turned into its `Step` frame on the training thread as the step closes.

The frame is written before control returns to the job (see emitter.py), so everything in it is
read here: process RSS and NVML on GPU jobs (memory_readers.py), and the loss and scale when
they are host values. A loss or scale in GPU memory is not read here (that would wait for the
device): it is copied to the host behind an event (`late_values.LateValues`) and reaches the
recording with a later frame.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memtui_agent.memory.alloc_trace import Drained
from memtui_agent.memory.memory_readers import host_now, with_nvml
from memtui_agent.steps.late_values import LateValues, device_values, host_float
from memtui_protocol import schema


@dataclass
class PendingStep:
    """Everything `close_step` captured on the training thread."""

    step: int
    t_start: float
    t_end: float
    end: schema.Piles
    high: schema.Piles
    peak: schema.Piles
    dtypes: dict[str, dict[str, schema.DtypeStat]]
    microbatches: int
    skipped: bool
    losses: list[Any]
    scale: Any
    scale_after: Any
    alerts: list[schema.Alert]
    top: list[schema.ModuleBytes]
    allocator: schema.Allocator
    device_index: int | None = None
    dropped: int = 0
    distributed: schema.Distributed | None = None
    alloc_events: Drained | None = None
    """`--alloc-events`: the ring entries read at the close, summarised here, off that thread."""
    closed_by: schema.StepTrigger = schema.StepTrigger.OPTIMIZER
    optimizer: str | None = None
    optimizer_step: int | None = None
    activations_measured: bool = True
    activations_from: int | None = None
    late_alerts: list[schema.StepLate] = field(default_factory=list)
    """Alerts of earlier steps whose checks reached the host since (CUDA: read late)."""

    def finalize(
        self, late: list[schema.StepLate] | None = None
    ) -> tuple[schema.Step, LateValues | None]:
        """The `Step` message now, plus the device values still on their way to the host.

        Args:
            late: values of earlier steps that reached the host since, carried by this frame.
        """
        pending = None
        loss = scale = after = None
        if device_values(self.losses, self.scale, self.scale_after):
            pending = LateValues(self.step, self.losses, self.scale)
        else:
            if self.losses:
                loss = float(sum(host_float(value) or 0.0 for value in self.losses))
            scale = host_float(self.scale)
            after = host_float(self.scale_after)
        alerts = list(self.alerts)
        if self.skipped:
            alerts.insert(0, skipped_alert(scale, after))
        step = schema.Step(
            step=self.step,
            t_start=self.t_start,
            t_end=self.t_end,
            end=self.end,
            max=self.high,
            peak=self.peak,
            microbatches=self.microbatches,
            skipped=self.skipped,
            dtypes=self.dtypes,
            allocator=with_nvml(self.allocator, self.device_index),
            host=host_now(),
            loss=loss,
            scale=scale,
            alerts=alerts,
            top_activations=self.top,
            dropped=self.dropped,
            distributed=self.distributed,
            alloc_events=self.alloc_events.summary() if self.alloc_events is not None else None,
            closed_by=self.closed_by,
            optimizer=self.optimizer,
            optimizer_step=self.optimizer_step,
            activations_measured=self.activations_measured,
            activations_from=self.activations_from,
            late=[*(late or []), *self.late_alerts],
        )
        return step, pending


def skipped_alert(scale: float | None, after: float | None) -> schema.Alert:
    """`skipped_step`, with the scale change when both scales are known at close (host values)."""
    # The scale after is known when GradScaler.update() ran before the step was written (with
    # two optimizers on one scaler, the other's step may close first).
    change = f"; scale {scale:g} -> {after:g}" if scale and after else ""
    change = change or (f"; at scale {scale:g}" if scale else "")
    return schema.Alert(
        kind="skipped_step",
        message="GradScaler skipped the optimizer update (non-finite gradients)" + change,
    )
