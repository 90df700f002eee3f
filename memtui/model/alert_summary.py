"""The alerts of a run in one line: which kinds, from which step, and how many in all.

A run ends with a few lines on the terminal (`memtui run --headless`, `memtui run` after its TUI
closes, `memtui detach`); a NaN from step 60 or a budget overrun at step 80 must be in them, not
only in the report. All three build that line here, from the `Recording` the report reads, so the
kinds and steps it names are the report's.

Kinds are compared as `AlertKind` members (converted at the fold), never by their text. The
line leads with the errors, then the warnings (`Severity`), each kind in order of its first
step. The notes (an optimizer's first-step forecast and what it then allocated, the attach
itself, memtui's own note that it measures every step) are counted but not named: a healthy
run's line would otherwise always name them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from memtui.model.alert_kinds import AlertKindShown
from memtui.model.recording import Recording, StepAlert
from memtui.terminal_text import terminal_safe
from memtui_protocol.schema import AlertKind, Severity, alert_severity

KIND_WORDS: dict[AlertKind, str] = {
    AlertKind.NONFINITE_LOSS: "NaN/Inf loss",
    AlertKind.NONFINITE_ACTIVATION: "NaN/Inf activations",
    AlertKind.NONFINITE_GRADIENT: "NaN/Inf gradients",
    AlertKind.SKIPPED_STEP: "skipped step",
    AlertKind.CLIP_BEFORE_UNSCALE: "gradients clipped before unscaling",
    AlertKind.FIRST_STEP_FORECAST: "first-step forecast",
    AlertKind.FIRST_STEP_GROWTH: "first-step growth",
    AlertKind.OVER_BUDGET: "over budget",
    AlertKind.OOM: "out of memory",
    AlertKind.FRAGMENTATION: "fragmentation",
    AlertKind.CHECKPOINT_LIMIT: "checkpointed activations not counted",
    AlertKind.STEP_RULE: "step rule changed",
    AlertKind.ACTIVATIONS_VARY: "activations vary",
    AlertKind.COMPILED: "torch.compile: every step measured",
    AlertKind.LEAK: "leak",
    AlertKind.ATTACHED: "attached",
    AlertKind.SNAPSHOT: "snapshot",
    AlertKind.GROUPED: "follow-on alerts",
    AlertKind.DIVERGENCE: "divergence",
}
"""A kind as the end-of-run line names it (a kind a newer agent sent: its own string)."""

MAX_NAMED = 4
"""Kinds named in the line; the rest are in the count and the report."""


@dataclass(frozen=True)
class KindSeen:
    """One kind of alert in a run: where it first and last came."""

    kind: AlertKindShown
    first_step: int | None
    last_step: int | None
    where: str | None
    """The first alert's `where` (a leak's holder)."""
    loss: float | None = None
    """A non-finite loss: the first such step's loss as recorded (NaN or Inf), if it was."""

    @property
    def severity(self) -> Severity:
        """The kind's one severity."""
        return alert_severity(self.kind)

    def words(self) -> str:
        """`NaN loss from step 60`, `over budget at step 80`, `leak in losses from step 40`."""
        name = (
            KIND_WORDS.get(self.kind, str(self.kind))
            if isinstance(self.kind, AlertKind)
            else (str(self.kind))
        )
        if self.kind is AlertKind.NONFINITE_LOSS and self.loss is not None:
            name = "NaN loss" if math.isnan(self.loss) else "Inf loss"
        if self.kind is AlertKind.LEAK and self.where:
            name = f"leak in {self.where}"
        if self.first_step is None:
            return name
        recurs = self.last_step is not None and self.last_step != self.first_step
        return f"{name} {'from' if recurs else 'at'} step {self.first_step}"


@dataclass(frozen=True)
class AlertTally:
    """The run's alerts: each named kind, errors first, then warnings, each in order of its
    first step, and how many in all."""

    kinds: tuple[KindSeen, ...]
    total: int

    @property
    def worst(self) -> KindSeen | None:
        """The first kind of the highest severity (None: the run raised only notes)."""
        return self.kinds[0] if self.kinds else None

    def error_words(self) -> str | None:
        """The worst error's words (`NaN loss from step 5`) for the headline of a run whose job
        exited 0 (None: no error): an exit code of 0 is not all that happened."""
        worst = self.worst
        if worst is None or worst.severity is not Severity.ERROR:
            return None
        return worst.words()

    def line(self, path: Path | str | None) -> str | None:
        """`NaN loss from step 60; over budget at step 80; 127 alerts: memtui report PATH`
        (None: the run raised nothing worth naming)."""
        if not self.kinds:
            return None
        named = [seen.words() for seen in self.kinds[:MAX_NAMED]]
        if len(self.kinds) > MAX_NAMED:
            named.append(f"{len(self.kinds) - MAX_NAMED} more kinds")
        count = f"{self.total} alert{'s' if self.total != 1 else ''}"
        where = f": memtui report {path}" if path is not None else ""
        return terminal_safe("; ".join([*named, count + where]))


def alert_tally(recording: Recording) -> AlertTally:
    """Every alert the recording holds, counted; the kinds worth naming (errors and
    warnings), the errors first, each severity's kinds first step first."""
    seen: dict[AlertKindShown, list[StepAlert]] = {}
    for item in recording.alerts:
        if alert_severity(item.kind) is Severity.NOTE:
            continue
        seen.setdefault(item.kind, []).append(item)
    losses = (
        {step.step: step.loss for step in recording.steps}
        if AlertKind.NONFINITE_LOSS in seen
        else {}
    )
    kinds = []
    for kind, items in seen.items():
        steps = [item.step for item in items if item.step is not None]
        first = min(steps) if steps else None
        loss = losses.get(first) if first is not None else None
        kinds.append(
            KindSeen(
                kind=kind,
                first_step=first,
                last_step=max(steps) if steps else None,
                where=items[0].alert.where,
                loss=loss if loss is not None and not math.isfinite(loss) else None,
            )
        )
    kinds.sort(key=lambda seen_kind: (seen_kind.severity.rank, seen_kind.first_step or 0))
    return AlertTally(kinds=tuple(kinds), total=len(recording.alerts))
