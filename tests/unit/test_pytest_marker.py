"""`@pytest.mark.memtui(...)`'s keywords read as `memtui check`'s rules (memtui_pytest/marker.py):
the same sizes, piles and percent, and one line for a marker memtui cannot read."""

from __future__ import annotations

from typing import Any

import pytest

from memtui.reports.check_rules import Limits, SizeLimit
from memtui_protocol.schema import Pile
from memtui_pytest.marker import MarkerError, limits_of


def test_the_keywords_are_the_commands_flags() -> None:
    limits = limits_of(
        (),
        {
            "max_peak": "64MiB",
            "max": {"activations": "8MB", "weights": 1024},
            "no_leak": True,
            "no_nan": True,
            "max_not_known": 12.5,
        },
    )
    assert limits == Limits(
        max_peak=SizeLimit(64 * 2**20, "64MiB"),
        max_piles=(
            (Pile.ACTIVATIONS, SizeLimit(8_000_000, "8MB")),
            (Pile.WEIGHTS, SizeLimit(1024, "1024")),
        ),
        no_leak=True,
        no_nan=True,
        max_not_known=12.5,
    )
    assert not limits_of((), {}).any_rule  # a bare marker: monitored, no rule


@pytest.mark.parametrize(
    ("args", "kwargs", "said"),
    [
        (("64MiB",), {}, "keywords only"),
        ((), {"max_peek": "64MiB"}, "no keyword 'max_peek'"),
        ((), {"max_peak": "12XB"}, "invalid size '12XB'"),
        ((), {"max_peak": True}, "takes a size"),
        ((), {"max": {"optimizer": "1MiB"}}, "no pile 'optimizer': the piles are weights"),
        ((), {"max": ["activations"]}, "takes a dict"),
        ((), {"no_leak": "yes"}, "no_leak= takes True or False"),
        ((), {"max_not_known": 101}, "percent from 0 to 100"),
        ((), {"max_not_known": float("nan")}, "percent from 0 to 100"),
    ],
)
def test_a_marker_memtui_cannot_read_is_one_line(
    args: tuple[Any, ...], kwargs: dict[str, Any], said: str
) -> None:
    with pytest.raises(MarkerError, match=None) as raised:
        limits_of(args, kwargs)
    assert said in str(raised.value) and "\n" not in str(raised.value)
