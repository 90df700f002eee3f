"""The ranks of a distributed job side by side: pure functions over each rank's latest step.

Shared by the TUI's ranks table and its imbalance line, so both compare the same numbers: each
pile's high-water mark in each rank's latest step.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtui.model.step_rows import NOT_KNOWN, pile_figure
from memtui_protocol import schema
from memtui_protocol.schema import Pile


@dataclass(frozen=True)
class RankRow:
    """One rank: its latest step, each pile's high in that step, and which piles it leads.

    `label` is the rank's identity (a session folder names each recording once)."""

    label: str
    step: int | None
    piles: tuple[tuple[Pile, int | None], ...]
    """Each pile with its high in the rank's latest step (None before the rank's first step, or
    where that step does not know it: activations neither measured nor carried)."""
    heaviest: frozenset[Pile]
    state: str


@dataclass(frozen=True)
class Spread:
    """One pile across ranks: highest and lowest value, and the rank holding the highest."""

    high: int
    low: int
    heaviest: str

    @property
    def ratio(self) -> float | None:
        """max/min (None when the lowest rank holds nothing)."""
        return self.high / self.low if self.low else None

    @property
    def differs(self) -> bool:
        """Whether any rank holds more than another (equal ranks have no heaviest to mark)."""
        return self.high != self.low


def spread(values: dict[str, int]) -> Spread:
    """The spread of one pile's value per rank (ties: the first rank listed is the heaviest)."""
    heaviest = max(values, key=values.__getitem__)
    return Spread(values[heaviest], min(values.values()), heaviest)


def _high(step: schema.Step | None, pile: Pile) -> int | None:
    """`pile`'s high in a rank's latest step; None before its first step or where the step
    does not know it."""
    return pile_figure(step, step.max, pile) if step is not None else None


def _latest(latest: dict[str, schema.Step | None], pile: Pile) -> dict[str, int]:
    """Each reporting rank's high of `pile` in its latest step, where that step knows it."""
    highs = {label: _high(step, pile) for label, step in latest.items()}
    return {label: high for label, high in highs.items() if high is not None}


def rank_rows(latest: dict[str, schema.Step | None], states: dict[str, str]) -> tuple[RankRow, ...]:
    """A row per rank; `heaviest` names the piles where this rank holds the most."""
    leaders: dict[Pile, str] = {}
    for pile in Pile:
        values = _latest(latest, pile)
        pile_spread = spread(values) if len(values) >= 2 else None
        if pile_spread is not None and pile_spread.differs:
            leaders[pile] = pile_spread.heaviest
    rows = []
    for label, step in latest.items():
        piles = tuple((pile, _high(step, pile)) for pile in Pile)
        leads = frozenset(pile for pile, leader in leaders.items() if leader == label)
        rows.append(
            RankRow(label, step.step if step else None, piles, leads, states.get(label, ""))
        )
    return tuple(rows)


def imbalance_line(latest: dict[str, schema.Step | None]) -> str | None:
    """`weights 1.05x (heaviest rank 0), gradients equal, ...`: max/min of each pile across
    ranks (None before two ranks report)."""
    if sum(step is not None for step in latest.values()) < 2:
        return None
    parts = []
    for pile in Pile:
        values = _latest(latest, pile)
        if len(values) < 2:  # a pile the latest steps do not know (activations)
            parts.append(f"{pile} {NOT_KNOWN}")
            continue
        pile_spread = spread(values)
        if not pile_spread.differs:
            parts.append(f"{pile} equal")
            continue
        ratio = pile_spread.ratio
        shown = f"{ratio:.2f}x" if ratio is not None else "n/a"
        parts.append(f"{pile} {shown} (heaviest rank {pile_spread.heaviest})")
    return ", ".join(parts)
