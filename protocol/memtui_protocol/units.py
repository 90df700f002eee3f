"""Byte sizes in and out (shared by agent messages and the viewer).

Accepted: `24GB`, `22.4GiB`, `512MiB`, plain bytes.

The difference matters (docs/numbers.md#units-gb-and-gib): a GB is 10**9 bytes, a GiB is 2**30, and
"16 GB is about 14.90 GiB" is not a saving. Parsing honours the suffix exactly; formatting uses one
system per view (binary by default), never both.
"""

from __future__ import annotations

import re
from decimal import Decimal

MAX_SIZE = 2**63 - 1
"""The largest size memtui takes: every reader holds sizes as int64 (the recording's schema,
the JSON report); a larger `--budget` once passed the CLI and then stopped the agent."""
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
DECIMAL = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def parse_size(text: str) -> int:
    """`"22.4GiB"` -> bytes.

    Raises:
        ValueError: with a message naming the accepted forms.
    """
    match = _SIZE.match(text) if len(text) <= 64 else None
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        shown = text if len(text) <= 64 else text[:40] + "..."
        raise ValueError(
            f"invalid size {shown!r}: use bytes or a unit such as 24GB, 22.4GiB, 512MiB"
        )
    value = Decimal(match.group(1)) * _UNITS[unit]  # exact: no float rounds 400 digits to inf
    if value > MAX_SIZE:
        raise ValueError(f"size {text!r} is too large: at most {MAX_SIZE:,} bytes (8 EiB)")
    return int(value)


DECIMAL_UNITS = frozenset({"kb", "mb", "gb", "tb"})
"""The decimal units `parse_size` reads (the rest are binary, bytes aside)."""


def written_decimal(text: str) -> bool:
    """Whether a size as the user wrote it names a decimal unit (`1GB`, `500 MB`): a view that
    sets a figure beside it then prints decimal units, so `1.20 GB` is read against `1GB` and
    never `1.12 GiB` against it (docs/numbers.md#units-gb-and-gib)."""
    match = _SIZE.match(text) if len(text) <= 64 else None
    return match is not None and match.group(2).lower() in DECIMAL_UNITS


def format_bytes(value: int | float | None, binary: bool = True, missing: str = "n/a") -> str:
    """Human size in one unit system: `format_bytes(16e9)` -> `"14.90 GiB"`."""
    if value is None:
        return missing
    sign = "-" if value < 0 else ""
    magnitude = abs(value)
    for name, factor in BINARY if binary else DECIMAL:
        if magnitude >= factor:
            return f"{sign}{magnitude / factor:.2f} {name}"
    return f"{sign}{int(magnitude)} B"
