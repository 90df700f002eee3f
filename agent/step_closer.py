"""Closing a step: the piles at close, health checks, forecasts and budgets, as one frame.

Runs on the training thread when the primary optimizer's `step()` returns (or GradScaler skips
it), so it keeps to counters already maintained by the hooks plus the health module's single
fused check; everything that needs a host sync of a value is resolved later by the emitter.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from memtui_agent import schema
from memtui_agent.allocator import read_allocator
from memtui_agent.forecast import forecast_first_step
from memtui_agent.health import HealthMonitor
from memtui_agent.ledger import Ledger
from memtui_agent.modules import ModuleRegistry
from memtui_agent.pending import PendingStep
from memtui_agent.schema import PILES
from memtui_agent.units import format_bytes

TOP_MODULES = 10


class StepCloser:
    """Builds each `Step` and the alerts that belong to it."""

    def __init__(
        self,
        ledger: Ledger,
        registry: ModuleRegistry,
        emit: Callable[[Any], None],
        budget: int | None = None,
        nan_check: str = "default",
    ) -> None:
        self.ledger = ledger
        self.registry = registry
        self._emit = emit
        self.budget = budget
        self.health = HealthMonitor(nan_check)
        self.forecast: int | None = None
        self._forecast_for: set[int] = set()
        self._budget_warned = False
        self._previous_peak: schema.Piles | None = None
        self._state_before: int | None = None

    def first_sight(self, optimizer: Any) -> bool:
        """Whether this is the optimizer's first `step()` (True once per optimizer)."""
        if id(optimizer) in self._forecast_for:
            return False
        self._forecast_for.add(id(optimizer))
        return True

    def before_first_step(self, optimizer: Any, step: int, current: schema.Piles) -> None:
        """First `step()` of an optimizer: forecast its state and warn if it will not fit."""
        if self._state_before is None:
            self._state_before = current.optimizer_state
        forecast = forecast_first_step(optimizer)
        if forecast is None:
            return
        self.forecast = (self.forecast or 0) + forecast
        if forecast > 0:
            message = (
                f"the first {type(optimizer).__name__}.step() will allocate "
                f"{format_bytes(forecast)} ({forecast:,} bytes) of optimizer state"
            )
            alert = schema.Alert(kind="first_step_forecast", message=message)
            self._emit(schema.AlertNow(time=time.time(), step=step, alert=alert))
        if self.budget is not None and current.total + forecast > self.budget:
            message = (
                f"the first {type(optimizer).__name__}.step() will allocate "
                f"{format_bytes(forecast)} of optimizer state: tracked memory would reach "
                f"{format_bytes(current.total + forecast)}, over the budget of "
                f"{format_bytes(self.budget)}"
            )
            alert = schema.Alert(kind="over_budget", message=message, where="optimizer_state")
            self._emit(schema.AlertNow(time=time.time(), step=step, alert=alert))
            self._budget_warned = True

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
    ) -> PendingStep:
        """The closing step's frame (handed to the emitter by the caller)."""
        end, high, peak, dtypes = self.ledger.snapshot()
        alerts = list(extra_alerts)
        alerts.extend(
            self.health.close(
                step,
                self._named_grads(),
                losses,
                self._named_parameters(),
                skipped,
                self.registry.name,
            )
        )
        grown = end.optimizer_state - (self._state_before or 0)
        if step == 1 and grown > 0:
            alerts.append(self._first_step_alert(grown))
        budget_alert = self._budget_alert(peak)
        if budget_alert is not None:
            alerts.append(budget_alert)
        self._previous_peak = peak
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
            allocator=read_allocator(),
        )

    def _first_step_alert(self, grown: int) -> schema.Alert:
        message = (
            f"the first optimizer step allocated {format_bytes(grown)} ({grown:,} bytes) "
            "of optimizer state"
        )
        if self.forecast is not None:
            verdict = "as forecast" if self.forecast == grown else "forecast was"
            message += f"; {verdict} {format_bytes(self.forecast)} ({self.forecast:,} bytes)"
        return schema.Alert(kind="first_step_growth", message=message)

    def _budget_alert(self, peak: schema.Piles) -> schema.Alert | None:
        """The step's peak over the budget, naming the pile that grew the most (once)."""
        if self.budget is None or peak.total <= self.budget or self._budget_warned:
            return None
        self._budget_warned = True
        before = self._previous_peak or schema.Piles()
        growth = {pile: getattr(peak, pile) - getattr(before, pile) for pile in PILES}
        grew = max(growth, key=lambda pile: growth[pile])
        message = (
            f"tracked peak {format_bytes(peak.total)} is over the budget of "
            f"{format_bytes(self.budget)}; {grew} grew most (+{format_bytes(growth[grew])})"
        )
        return schema.Alert(kind="over_budget", message=message, where=grew)

    def _named_parameters(self) -> list[tuple[str, Any]]:
        names = self.registry.param_names
        seen: set[int] = set()
        named = []
        for index, parameter in enumerate(self.registry.parameters()):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            named.append((names.get(id(parameter), f"param[{index}]"), parameter))
        return named

    def _named_grads(self) -> list[tuple[str, Any]]:
        return [(name, p.grad) for name, p in self._named_parameters() if p.grad is not None]
