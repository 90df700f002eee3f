"""Closing a step: the piles at close, health checks, forecasts and budgets, as one frame.

Runs on the training thread when a top-level optimizer `step()` returns (or GradScaler skips it,
or, in a job with no optimizer, a top-level backward returns), so it keeps to counters already
maintained by the hooks plus the health module's single fused check; everything that needs a
host sync of a value is resolved later by the emitter.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from memtui_agent.job.forecast import forecast_first_step
from memtui_agent.job.modules import ModuleRegistry, state_bytes
from memtui_agent.job.optimizer_book import OptimizerRecord
from memtui_agent.memory.alloc_events import AllocEventsRecorder
from memtui_agent.memory.allocator import (
    AllocatorReader,
    expandable_segments_enabled,
    fragmentation_message,
)
from memtui_agent.memory.gpu_events import GpuEvents
from memtui_agent.memory.ledger import Ledger
from memtui_agent.steps.health import HealthMonitor
from memtui_agent.steps.pending import PendingStep
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig
from memtui_protocol.schema import PILES
from memtui_protocol.units import format_bytes

TOP_MODULES = 10


class StepCloser:
    """Builds each `Step` and the alerts that belong to it."""

    def __init__(
        self,
        ledger: Ledger,
        registry: ModuleRegistry,
        emit: Callable[[Any], None],
        config: AgentConfig | None = None,
    ) -> None:
        config = config if config is not None else AgentConfig()
        self.ledger = ledger
        self.allocator = AllocatorReader(config.reset_peaks)
        self.gpu_events = GpuEvents(config.oom_snapshot_path())
        self.alloc_events: AllocEventsRecorder | None = None
        """Set by the agent with `--alloc-events`: drains the allocator's history each close."""
        self.registry = registry
        self._emit = emit
        self.budget = config.budget
        self.health = HealthMonitor(config.nan_check)
        self._budget_warned = False
        self.previous_peak: schema.Piles | None = None

    def before_first_step(
        self,
        optimizer: Any,
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
            alert = schema.Alert(kind="over_budget", message=device_short, where="optimizer_state")
            self._emit(schema.AlertNow(time=time.time(), step=step, alert=alert))
        message = f"{who} will allocate {forecast.describe()} of optimizer state"
        alert = schema.Alert(kind="first_step_forecast", message=message)
        self._emit(schema.AlertNow(time=time.time(), step=step, alert=alert))
        if self.budget is not None and current.total + forecast.bytes > self.budget:
            message = (
                f"{who} will allocate {format_bytes(forecast.bytes)} of optimizer state: "
                f"tracked memory would reach {format_bytes(current.total + forecast.bytes)}, "
                f"over the budget of {format_bytes(self.budget)}"
            )
            alert = schema.Alert(kind="over_budget", message=message, where="optimizer_state")
            self._emit(schema.AlertNow(time=time.time(), step=step, alert=alert))
            self._budget_warned = True

    @staticmethod
    def after_first_step(optimizer: Any, record: OptimizerRecord) -> schema.Alert | None:
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
        return schema.Alert(kind="first_step_growth", message=message)

    def close(
        self,
        step: int,
        t_start: float,
        skipped: bool,
        microbatches: int,
        losses: list[Any],
        scale: Any,
        scale_after: Any,
        extra_alerts: list[schema.Alert],
        gradients: list[Any],
        gradient_groups: dict[tuple[Any, Any], list[Any]] | None = None,
    ) -> PendingStep:
        """The closing step's frame (handed to the emitter by the caller).

        `gradients` are the ones the caller's resync just counted; the health check reads them
        (grouped by device and dtype already when `gradient_groups` says so).
        """
        end, high, peak, dtypes = self.ledger.at_close()
        alerts = list(extra_alerts)
        self.allocator.phase_ended("optimizer")
        allocator = self.allocator.read()
        device_index = None
        drained = None
        if allocator.allocated is not None:
            device_index = self.gpu_events.ensure_attached()
            if self.alloc_events is not None:
                drained = self.alloc_events.drain(allocator.allocations)
            fragmented = fragmentation_message(
                allocator, expandable_segments_enabled(dict(os.environ))
            )
            if fragmented is not None:
                alerts.append(schema.Alert(kind="fragmentation", message=fragmented))
        alerts.extend(
            self.health.close(
                step,
                gradients,
                losses,
                self.named_parameters,  # names are needed only on an alarm
                skipped,
                self.registry.name,
                gradient_groups,
            )
        )
        return PendingStep(
            step=step,
            t_start=t_start,
            t_end=time.time(),
            end=end,
            high=high,
            peak=peak,
            dtypes=dtypes,
            microbatches=microbatches,
            skipped=skipped,
            losses=losses,
            scale=scale,
            scale_after=scale_after,
            alerts=alerts,
            top=self.ledger.top_modules(TOP_MODULES),
            allocator=allocator,
            device_index=device_index,
            alloc_events=drained,
        )

    def _device_shortfall(self, forecast: int) -> str | None:
        """On CUDA the device is a budget too: will the first step's state fit in what is free
        on the device plus what the allocator holds cached?"""
        if forecast <= 0 or not self.allocator.active():
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

    def judge_peak(self, peak: schema.Piles) -> schema.Alert | None:
        """The budget alert for a closing step's final peak (measured, or carried from the step
        it repeats: between measured steps the ledger alone holds neither its activations nor
        its gradients), which is also what the next steps' arming compares with the budget."""
        alert = self._budget_alert(peak)
        self.previous_peak = peak
        return alert

    def _budget_alert(self, peak: schema.Piles) -> schema.Alert | None:
        """The step's peak over the budget, naming the pile that grew the most (once)."""
        if self.budget is None or peak.total <= self.budget or self._budget_warned:
            return None
        self._budget_warned = True
        before = self.previous_peak or schema.Piles()
        growth = {pile: getattr(peak, pile) - getattr(before, pile) for pile in PILES}
        grew = max(growth, key=lambda pile: growth[pile])
        message = (
            f"tracked peak {format_bytes(peak.total)} is over the budget of "
            f"{format_bytes(self.budget)}; {grew} grew most (+{format_bytes(growth[grew])})"
        )
        return schema.Alert(kind="over_budget", message=message, where=grew)

    def named_parameters(self) -> list[tuple[str, Any]]:
        names = self.registry.param_names
        seen: set[int] = set()
        named = []
        for index, parameter in enumerate(self.registry.parameters()):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            named.append((names.get(id(parameter), f"param[{index}]"), parameter))
        return named
