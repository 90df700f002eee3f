"""Smoke test of the benchmark command: `benchmarks/run.py --quick` runs and prints every section.

The benchmark is run on demand, not in CI, so nothing else exercises it; without this test a
change to the agent or the viewer could break it unnoticed. Only the exit status and the section
headers are checked: timings on a shared machine mean nothing, and asserting on them would make
the suite flaky.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
SECTIONS = (
    "== 1. Training overhead ==",
    "== 2. Agent memory ==",
    "== 3. Viewer ==",
    "== 4. Recording size ==",
)


def test_quick_benchmark_prints_every_section(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for section in SECTIONS:
        assert section in done.stdout, f"missing {section!r} in:\n{done.stdout}"
