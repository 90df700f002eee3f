"""A closed step waiting for the values that must not be read on the training thread.

The loss and the GradScaler scale are device tensors: turning them into floats syncs the device,
so the emitter thread does it. Process RSS (about 20 us through psutil) is read there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from memtui_agent import schema
from memtui_agent.alloc_trace import Drained

_process: Any = None


def process_rss() -> int:
    """Resident set size of this process, through a cached psutil handle."""
    global _process
    if _process is None:
        import psutil

        _process = psutil.Process()
    return int(_process.memory_info().rss)


def host_now() -> schema.Host:
    """Process RSS and the machine's memory."""
    import psutil

    system = psutil.virtual_memory()
    return schema.Host(rss=process_rss(), system_total=system.total, system_used=system.used)


_nvml: Any = None


def with_nvml(allocator: schema.Allocator, device_index: int | None) -> schema.Allocator:
    """Add NVML's process/device figures (GPU jobs only; never raises)."""
    global _nvml
    if device_index is None or allocator.allocated is None:
        return allocator
    if _nvml is None:
        from memtui_agent.nvml import NvmlReader

        _nvml = NvmlReader()
    memory = _nvml.read(device_index)
    return msgspec.structs.replace(
        allocator,
        process_gpu=memory.process_gpu,
        device_used=memory.device_used,
        device_total=memory.device_total,
        nvml_note=memory.note,
    )


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

    def finalize(self) -> schema.Step:
        """The `Step` message, with loss and scale resolved to floats."""
        loss = None
        if self.losses:
            loss = float(sum(float(value.item()) for value in self.losses))
        scale = float(self.scale.item()) if self.scale is not None else None
        alerts = list(self.alerts)
        if self.skipped:
            after = float(self.scale_after.item()) if self.scale_after is not None else None
            # The scale after is known when GradScaler.update() ran before the next step closed
            # (with two optimizers on one scaler, the other's step may close first).
            change = f"; scale {scale:g} -> {after:g}" if scale and after else ""
            change = change or (f"; at scale {scale:g}" if scale else "")
            alerts.insert(
                0,
                schema.Alert(
                    kind="skipped_step",
                    message="GradScaler skipped the optimizer update (non-finite gradients)"
                    + change,
                ),
            )
        return schema.Step(
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
        )
