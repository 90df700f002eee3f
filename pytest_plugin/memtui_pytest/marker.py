"""A `@pytest.mark.memtui(...)` marker's keywords as `memtui check`'s `Limits` (docs/check.md).

The keywords are the command's flags: `max_peak="64MiB"` is `--max-peak 64MiB`, `max={"weights":
"1MiB"}` is `--max weights=1MiB`, `no_leak=True`, `no_nan=True`, `max_not_known=10`. A size is a
string with its unit or a whole number of bytes. A marker memtui cannot read fails its test with
one line, before the test runs: a gate that silently checked nothing would pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from memtui.reports.check_rules import Limits, SizeLimit
from memtui_protocol.schema import Pile
from memtui_protocol.units import parse_size

KEYWORDS = ("max_peak", "max", "no_leak", "no_nan", "max_not_known")
"""What the marker takes, in `memtui check`'s order."""


class MarkerError(ValueError):
    """A marker memtui cannot read; `str()` is the line the test fails with."""


def limits_of(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Limits:
    """The marker's rules (`Limits()`, no rule, for a bare `@pytest.mark.memtui`).

    Raises:
        MarkerError: a positional argument, an unknown keyword, a bad size, pile or percent.
    """
    if args:
        raise MarkerError("the memtui marker takes keywords only: " + ", ".join(KEYWORDS))
    unknown = sorted(set(kwargs) - set(KEYWORDS))
    if unknown:
        raise MarkerError(
            f"the memtui marker has no keyword {unknown[0]!r}: " + ", ".join(KEYWORDS)
        )
    peak = kwargs.get("max_peak")
    piles = kwargs.get("max") or {}
    if not isinstance(piles, Mapping):
        raise MarkerError('max= takes a dict of pile sizes, e.g. max={"activations": "8MiB"}')
    return Limits(
        max_peak=_size("max_peak", peak) if peak is not None else None,
        max_piles=tuple(
            (_pile(name), _size(f"max[{name!r}]", size)) for name, size in piles.items()
        ),
        no_leak=_flag("no_leak", kwargs.get("no_leak", False)),
        no_nan=_flag("no_nan", kwargs.get("no_nan", False)),
        max_not_known=_percent(kwargs.get("max_not_known", 0.0)),
    )


def _size(keyword: str, value: object) -> SizeLimit:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MarkerError(f"{keyword}= takes a size such as '64MiB' or bytes, not {value!r}")
    text = str(value)
    try:
        return SizeLimit(parse_size(text), text.strip())
    except ValueError as exc:
        raise MarkerError(f"{keyword}=: {exc}") from None


def _pile(name: object) -> Pile:
    try:
        return Pile(name)
    except ValueError:
        names = ", ".join(pile.value for pile in Pile)
        raise MarkerError(f"max= has no pile {name!r}: the piles are {names}") from None


def _flag(keyword: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise MarkerError(f"{keyword}= takes True or False, not {value!r}")
    return value


def _percent(value: object) -> float:
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if not 0 <= number <= 100:
        raise MarkerError(f"max_not_known= takes a percent from 0 to 100, not {value!r}")
    return number
