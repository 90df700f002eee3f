"""Sizes in and out: GB is 10**9, GiB is 2**30, and 16 GB is 14.90 GiB."""

from __future__ import annotations

import pytest

from memtui_protocol.units import format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GB", 24 * 10**9),
        ("22.4GiB", int(22.4 * 2**30)),
        ("512MiB", 512 * 2**20),
        ("1234", 1234),
        ("1.5 kB", 1500),
        ("2g", 2 * 2**30),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12XB", "GB", "-1GB", "1e9"])
def test_parse_size_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_seed_figure_16_gb_is_14_90_gib() -> None:
    assert format_bytes(16 * 10**9) == "14.90 GiB"
    assert format_bytes(16 * 10**9, binary=False) == "16.00 GB"


def test_small_and_missing_values() -> None:
    assert format_bytes(804) == "804 B"
    assert format_bytes(None) == "n/a"
    assert format_bytes(-2048) == "-2.00 KiB"
