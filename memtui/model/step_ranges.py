"""Step numbers as a reader takes them in: runs folded into ranges, a long list cut with how many
more there are ("steps 2, 5-7, 12 and 3 more")."""

from __future__ import annotations

from collections.abc import Iterable

MAX_RANGES = 8
"""Ranges named before the rest is counted ("and N more")."""


def step_ranges(numbers: Iterable[int], limit: int = MAX_RANGES) -> str:
    """`2, 5-7, 12 and 3 more`: the distinct numbers in order, consecutive ones as one range,
    at most `limit` ranges named and the steps left over counted."""
    ordered = sorted(set(numbers))
    runs: list[tuple[int, int]] = []
    for number in ordered:
        if runs and number == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], number)
        else:
            runs.append((number, number))
    named = ", ".join(f"{low}-{high}" if high > low else str(low) for low, high in runs[:limit])
    left = sum(high - low + 1 for low, high in runs[limit:])
    return named + (f" and {left} more" if left else "")


def steps_words(numbers: Iterable[int], limit: int = MAX_RANGES) -> str:
    """`step 4` or `steps 2, 5-7`: `step_ranges` with its noun."""
    ordered = sorted(set(numbers))
    return ("step " if len(ordered) == 1 else "steps ") + step_ranges(ordered, limit)


__all__ = ["MAX_RANGES", "step_ranges", "steps_words"]
