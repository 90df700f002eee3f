"""An optimizer's first `step()`: the state it will allocate, said before, and what it did.

The first step of an optimizer allocates its state (Adam's two moments per parameter): the moment
a job that fits in memory for its forward and backward runs out. Before that step runs, its state
is forecast from the parameters (`job.forecast`) and checked against what is free on the device
and against the budget, as alerts that cannot wait for the step to close (`AlertNow`); after it,
the state it really allocated is said, against the forecast.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from memtui_agent.job.forecast import forecast_first_step
from memtui_agent.job.modules import state_bytes
from memtui_agent.job.optimizer_book import OptimizerRecord
from memtui_agent.steps.budget import Budget
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, Pile
from memtui_protocol.units import format_bytes

if TYPE_CHECKING:  # for annotations only
    import torch


class FirstSteps:
    """Forecasts before, and growth after, each optimizer's first `step()`."""

    def __init__(
        self,
        budget: Budget,
        emit: Callable[[schema.Message], None],
        on_device: Callable[[], bool],
    ) -> None:
        self._budget = budget
        self._emit = emit
        self._on_device = on_device
        """Whether a CUDA allocator is in use (its free memory is then a budget too)."""

    def before(
        self,
        optimizer: torch.optim.Optimizer,
        record: OptimizerRecord,
        step: int,
        current: schema.Piles,
        closure: bool,
    ) -> None:
        """First `step()` of an optimizer: forecast its state and warn if it will not fit."""
        record.state_before = state_bytes(optimizer)
        forecast = record.forecast = forecast_first_step(optimizer, closure)
        if forecast is None or forecast.bytes <= 0:
            return
        who = f"the first {record.name or record.kind}.step()"
        device_short = self._device_shortfall(forecast.bytes)
        if device_short is not None:
            self._alert(step, AlertKind.OVER_BUDGET, device_short, Pile.OPTIMIZER_STATE)
        message = f"{who} will allocate {forecast.describe()} of optimizer state"
        self._alert(step, AlertKind.FIRST_STEP_FORECAST, message)
        over = self._budget.forecast_over(sum(current.counted()), forecast.bytes, who)
        if over is not None:
            self._emit(schema.AlertNow(time=time.time(), step=step, alert=over))

    @staticmethod
    def after(optimizer: torch.optim.Optimizer, record: OptimizerRecord) -> schema.Alert | None:
        """What the first `step()` of an optimizer allocated, against its forecast."""
        record.first_step_done = True
        grown = state_bytes(optimizer) - record.state_before
        if grown <= 0:
            return None
        message = (
            f"the first {record.name or record.kind}.step() allocated {format_bytes(grown)} "
            f"({grown:,} bytes) of optimizer state"
        )
        forecast = record.forecast
        if forecast is not None:
            if not forecast.matches(grown):
                verdict = "forecast was"
            else:
                verdict = "as forecast" if forecast.exact else "within the forecast,"
            message += f"; {verdict} {forecast.describe()}"
        return schema.Alert(kind=AlertKind.FIRST_STEP_GROWTH, message=message)

    def _alert(self, step: int, kind: AlertKind, message: str, where: str | None = None) -> None:
        alert = schema.Alert(kind=kind, message=message, where=where)
        self._emit(schema.AlertNow(time=time.time(), step=step, alert=alert))

    def _device_shortfall(self, forecast: int) -> str | None:
        """On CUDA the device is a budget too: will the first step's state fit in what is free
        on the device plus what the allocator holds cached?"""
        if forecast <= 0 or not self._on_device():
            return None
        import torch

        free, _total = torch.cuda.mem_get_info()
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        if forecast <= free + cached:
            return None
        return (
            f"the first optimizer step will allocate {format_bytes(forecast)} of state but only "
            f"{format_bytes(free + cached)} is free on the device (incl. the allocator's cache)"
        )
