"""What the job kept outside every pile, census by census: the screen's "kept" line as of the
cursor step and the report's last one come from this one fold, so they cannot disagree.

Only a step whose close took a census carries a `Kept` (nothing proves the figure unchanged
between censuses), so the screen shows the latest census at or before the cursor, with its step.
Bounded against a hostile recording as the leak book is: past `MAX_ENTRIES` the older half goes.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from functools import partial

from memtui_protocol import schema
from memtui_protocol.units import format_bytes

MAX_ENTRIES = 1024
"""Censuses kept (the agent counts at doubling gaps and while leaks grow: a handful per
thousand steps)."""
NAMED = 3
"""Holders a line names (the largest); the report's JSON has them all."""


@dataclass(frozen=True)
class KeptAt:
    """One census's count of what the job kept outside the piles, and its step."""

    step: int
    kept: schema.Kept


@dataclass
class KeptTrail:
    """Every counted step's `Kept`, in stream order."""

    steps: list[int] = field(default_factory=list)
    counts: list[KeptAt] = field(default_factory=list)

    def stepped(self, step: schema.Step) -> None:
        """A step's count, if its close took a census (others add nothing)."""
        if step.kept is None:
            return
        if len(self.counts) >= MAX_ENTRIES:
            del self.steps[: MAX_ENTRIES // 2], self.counts[: MAX_ENTRIES // 2]
        self.steps.append(step.step)
        self.counts.append(KeptAt(step.step, step.kept))

    def at(self, step: int) -> KeptAt | None:
        """The latest count at or before `step`."""
        index = bisect_right(self.steps, step)
        return self.counts[index - 1] if index else None

    def last(self) -> KeptAt | None:
        """The run's latest count."""
        return self.counts[-1] if self.counts else None


def kept_words(found: KeptAt, binary: bool = True, named: int = NAMED) -> str:
    """The count in one line: its total, then the largest holders by name."""
    kept = found.kept
    size = partial(format_bytes, binary=binary)
    total = (
        f"{size(kept.bytes)} in {kept.tensors} tensor{'s' if kept.tensors != 1 else ''}"
        if kept.bytes is not None
        else "a total not known (its census stopped at its bound)"
    )
    holders = ", ".join(f"{item.holder} {size(item.bytes)}" for item in kept.holders[:named])
    return f"kept outside the piles at step {found.step} (its census): {total}" + (
        f"; {holders}" if holders else ""
    )
