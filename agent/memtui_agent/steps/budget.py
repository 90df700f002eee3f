"""The memory budget (`--budget`): one over-budget alert per run, and how near the last peak was.

Three parts of the agent look at the budget: the first step's forecast (will the optimizer state
fit?), each close (did the step's peak pass it?) and the activation gate (a step whose peak came
near it is measured, so the alert rests on measured figures). They share this one record of the
budget, whether it was already reported, and the last step's peak.
"""

from __future__ import annotations

from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, Pile
from memtui_protocol.units import format_bytes

NEAR_TENTHS = 9
"""A peak at 9/10 of the budget or more makes the next steps measured (integers: exact)."""


class Budget:
    """The budget, whether it was reported, and the peak of the last closed step."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.warned = False
        """An over-budget alert was given (once per run: forecast or peak)."""
        self.previous_peak: schema.Piles | None = None

    def near(self) -> bool:
        """Whether the last step's peak came within `NEAR_TENTHS` of the budget."""
        limit, peak = self.limit, self.previous_peak
        return (
            limit is not None
            and peak is not None
            and sum(peak.counted()) * 10 >= (limit * NEAR_TENTHS)
        )

    def forecast_over(self, current: int, forecast: int, who: str) -> schema.Alert | None:
        """The alert when the piles now plus a first step's forecast state pass the budget."""
        if self.limit is None or current + forecast <= self.limit:
            return None
        message = (
            f"{who} will allocate {format_bytes(forecast)} of optimizer state: "
            f"tracked memory would reach {format_bytes(current + forecast)}, "
            f"over the budget of {format_bytes(self.limit)}"
        )
        self.warned = True
        return schema.Alert(kind=AlertKind.OVER_BUDGET, message=message, where=Pile.OPTIMIZER_STATE)

    def judge_peak(self, peak: schema.Piles) -> schema.Alert | None:
        """The alert for a closing step's final peak (measured, or carried from the step it
        repeats: between measured steps the ledger alone holds neither its activations nor its
        gradients), once per run, naming the pile that grew the most; the peak is also what the
        next steps' arming compares with the budget."""
        before, self.previous_peak = self.previous_peak, peak
        total = sum(peak.counted())
        if self.limit is None or total <= self.limit or self.warned:
            return None
        self.warned = True
        earlier = (before or schema.Piles()).counted()
        growth = {
            pile: now - then for pile, now, then in zip(Pile, peak.counted(), earlier, strict=True)
        }
        grew = max(growth, key=lambda pile: growth[pile])
        message = (
            f"tracked peak {format_bytes(total)} is over the budget of "
            f"{format_bytes(self.limit)}; {grew} grew most (+{format_bytes(growth[grew])})"
        )
        return schema.Alert(kind=AlertKind.OVER_BUDGET, message=message, where=grew)
