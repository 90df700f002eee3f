"""Recordings written by hand for the tests that read them: a hello, bare steps, the file.

Importable by name because pytest puts `tests/` on `sys.path` (`pythonpath` in pyproject.toml).
The fixture recording of a whole run is `tests/fixtures/make_fixture.py`'s; these are for tests
that need a few frames of their own (hostile text, damaged or huge files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memtui_protocol import schema, wire

ZERO = schema.Piles()
"""Every pile empty."""


def hello(argv: list[str] | None = None, **fields: Any) -> schema.Hello:
    """A run's first frame, from another host long ago (nothing here may be taken for live)."""
    defaults: dict[str, Any] = {
        "agent_version": "hostile",
        "pid": 1,
        "argv": argv or ["python", "train.py"],
        "started": "2026-01-01T00:00:00+00:00",
        "started_unix": 1.0,
        "hostname": "not-this-host",
    }
    return schema.Hello(format_version=schema.FORMAT_VERSION, **(defaults | fields))


def bare_step(number: int, **fields: Any) -> schema.Step:
    """Step `number` with every pile empty, a second apart (`fields` on top)."""
    return schema.Step(number, float(number), number + 0.5, ZERO, ZERO, ZERO, **fields)


def write_recording(path: Path, messages: list[schema.Message]) -> Path:
    """`messages` as a recording file at `path`, as the agent frames them."""
    path.write_bytes(wire.preamble() + b"".join(wire.encode(m) for m in messages))
    return path
