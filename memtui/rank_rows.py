"""The ranks of a distributed job side by side: pure functions over each rank's latest step.

Shared by the TUI's ranks table and its imbalance line, so both compare the same numbers: each
pile's high-water mark in each rank's latest step.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtui_agent import schema
from memtui_agent.schema import PILES


@dataclass(frozen=True)
class RankRow:
    """One rank: its latest step, each pile's high in that step, and which piles it leads."""

    label: str
    step: int | None
    piles: tuple[int | None, ...]
    heaviest: frozenset[str]
    state: str


def rank_rows(latest: dict[str, schema.Step | None], states: dict[str, str]) -> tuple[RankRow, ...]:
    """A row per rank; `heaviest` names the piles where this rank holds the most (ties: first)."""
    leaders = {pile: _leader(latest, pile) for pile in PILES}
    rows = []
    for label, step in latest.items():
        piles = tuple(getattr(step.max, pile) if step else None for pile in PILES)
        leads = frozenset(pile for pile, leader in leaders.items() if leader == label)
        rows.append(
            RankRow(label, step.step if step else None, piles, leads, states.get(label, ""))
        )
    return tuple(rows)


def heaviest_rank(latest: dict[str, schema.Step | None], pile: str) -> str | None:
    """The rank whose latest step reached the most of `pile` (None before two ranks report)."""
    values = {label: getattr(step.max, pile) for label, step in latest.items() if step}
    if len(values) < 2:
        return None
    return max(values, key=lambda label: values[label])


def _leader(latest: dict[str, schema.Step | None], pile: str) -> str | None:
    """The heaviest rank for `pile`, only where the ranks differ (equal ranks mark nothing)."""
    values = [getattr(step.max, pile) for step in latest.values() if step]
    if len(values) < 2 or max(values) == min(values):
        return None
    return heaviest_rank(latest, pile)


def imbalance_line(latest: dict[str, schema.Step | None]) -> str | None:
    """`weights 1.00x (heaviest rank 0), ...`: max/min of each pile across ranks."""
    parts = []
    for pile in PILES:
        leader = heaviest_rank(latest, pile)
        if leader is None:
            return None
        values = [getattr(step.max, pile) for step in latest.values() if step]
        low = min(values)
        high = max(values)
        if high == low:
            parts.append(f"{pile} equal")
            continue
        ratio = f"{high / low:.2f}x" if low else "n/a"
        parts.append(f"{pile} {ratio} (heaviest rank {leader})")
    return ", ".join(parts)
