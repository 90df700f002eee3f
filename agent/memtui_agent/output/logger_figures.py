"""The latest closed step's figures as one flat dict, for the job's own logger (TensorBoard,
Weights & Biases, MLflow, a CSV): `memtui_agent.integrations.metrics()` and the Trainer and
Lightning callbacks (docs/integrations.md).

The figures are the recording's: the emitter hands every message it has just recorded to
`LoggerFigures.offer` (on the thread that put it, as it does for the Prometheus exporter), which
keeps a reference to the latest `Step` and folds the alerts and leaks frames carry into two small
dictionaries. Nothing is measured again and nothing waits for the device: `figures()` reads
host integers the frame already holds. A figure the frame does not state (activations not known,
"other" on a CPU job) is left out of the dict, never written as 0.
"""

from __future__ import annotations

from memtui_agent.output.raised import raised
from memtui_protocol import schema
from memtui_protocol.peak import other_at_peak, peak_total
from memtui_protocol.schema import Severity, alert_severity

PREFIX = "memtui/"
"""Every key starts with it, so the figures group in one section of a logger's UI."""
STEP = PREFIX + "step"
PILE_KEYS: dict[str, str] = {pile: f"{PREFIX}{pile}_bytes" for pile in schema.PILES}
"""The four piles at the step's peak (`peak.piles` in `memtui report --json`)."""
OTHER = PREFIX + "other_bytes"
PEAK = PREFIX + "peak_bytes"
ACTIVATIONS_KNOWN = PREFIX + "activations_known"
ACTIVATIONS_MEASURED = PREFIX + "activations_measured"
ALERT_KEYS: dict[Severity, str] = {
    severity: f"{PREFIX}alerts_{severity.value}" for severity in Severity
}
LEAKS = PREFIX + "leaks"
LEAK_BYTES = PREFIX + "leak_bytes"
MAX_HOLDERS_KEPT = 256
"""Leaking holders remembered (the largest), so a job naming thousands costs a bounded dict."""


class LoggerFigures:
    """The latest step, the alerts by severity and the leaking holders so far."""

    def __init__(self) -> None:
        self._step: schema.Step | None = None
        self._alerts: dict[Severity, int] = dict.fromkeys(Severity, 0)
        self._leaks: dict[str, int] = {}

    def offer(self, message: schema.Message) -> None:
        """Take a message the emitter has just recorded (a reference kept on most steps)."""
        alerts, leaks = raised(message)
        if alerts or leaks:
            self._fold(alerts, leaks)
        if isinstance(message, schema.Step):
            self._step = message

    def _fold(self, alerts: list[schema.Alert], leaks: list[schema.Leak]) -> None:
        """Copy, change, swap: a reader on another thread never sees a half-changed dict."""
        if alerts:
            counts = dict(self._alerts)
            for alert in alerts:
                counts[alert_severity(alert.kind)] += 1
            self._alerts = counts
        if leaks:
            held = dict(self._leaks)
            for leak in leaks:
                held[leak.holder] = leak.bytes
            if len(held) > MAX_HOLDERS_KEPT:
                held = dict(sorted(held.items(), key=lambda item: -item[1])[:MAX_HOLDERS_KEPT])
            self._leaks = held

    @property
    def step(self) -> int | None:
        """The number of the latest closed step; None before the first closes."""
        step = self._step
        return step.step if step is not None else None

    def figures(self) -> dict[str, int]:
        """The latest closed step's figures (docs/integrations.md has every key); empty before
        the first step closes. Integers, each as the recording states it."""
        step = self._step
        if step is None:
            return {}
        figures = {STEP: step.step}
        for pile, key in PILE_KEYS.items():
            value = getattr(step.peak, pile)
            if value is not None:  # not known: left out, never a 0 that reads as a figure
                figures[key] = value
        other = other_at_peak(step.peak, step.distributed, step.allocator.peak_allocated)
        if other is not None:
            figures[OTHER] = other
        peak = peak_total(step.peak, step.distributed)
        if peak is not None:
            figures[PEAK] = peak
        known = step.activations_measured or step.activations_from is not None
        figures[ACTIVATIONS_KNOWN] = 1 if known and step.peak.activations is not None else 0
        figures[ACTIVATIONS_MEASURED] = 1 if step.activations_measured else 0
        for severity, count in self._alerts.items():
            figures[ALERT_KEYS[severity]] = count
        leaks = self._leaks
        figures[LEAKS] = len(leaks)
        figures[LEAK_BYTES] = sum(leaks.values())
        return figures


__all__ = ["PREFIX", "LoggerFigures"]
