"""The exact series of the TensorBoard export (issue 38): TensorBoard's default loader keeps every
scalar as a float32, which holds integers exactly only up to 2^24 (16 MiB of bytes), so each byte
figure is also written as two float32-exact integers, `hi_16MiB` x 16,777,216 + `lo_bytes`."""

from __future__ import annotations

import struct

import pytest

from memtui.reports.tensorboard_export import EXACT_BLOCK, exact_parts, exact_scalars


def as_float32(value: float) -> float:
    rounded: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return rounded


FIGURES = (0, 1, 2**24 - 1, 2**24, 2**24 + 1, 67_141_636, 80 * 2**30 + 12_345, 2**48 - 1, -1)
"""Around the float32 limit, a job's odd weights, an 80 GiB card, the largest, a shrinking."""


@pytest.mark.parametrize("value", FIGURES)
def test_the_parts_are_float32_exact_and_give_the_figure_back(value: int) -> None:
    parts = exact_parts(value)
    assert parts is not None
    hi, lo = parts
    assert hi * EXACT_BLOCK + lo == value
    assert as_float32(hi) == hi and as_float32(lo) == lo and 0 <= lo < 2**24


def test_a_figure_a_float32_cannot_hold_needs_them() -> None:
    assert as_float32(67_141_636) != 67_141_636  # a bias-free Linear(4097, 4097): its weights
    assert exact_parts(67_141_636) == (4, 32_772)


def test_beyond_2_to_the_48_there_is_no_exact_point_rather_than_a_rounded_one() -> None:
    assert exact_parts(2**48) is None and exact_parts(-(2**48) - 1) is None


def test_only_integer_figures_have_exact_series() -> None:
    scalars: dict[str, float] = {
        "piles/end/weights": 67_141_636,
        "host/rss": 2**48,
        "step/duration_seconds": 0.25,
        "step/loss": 4.0,
    }
    assert exact_scalars(scalars) == {
        "exact/piles/end/weights/hi_16MiB": 4,
        "exact/piles/end/weights/lo_bytes": 32_772,
    }
