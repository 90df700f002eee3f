"""Smoke test of `benchmarks/duty_floor.py`: it runs, each job in its own process, and prints a
row per job whose parts add up to its total.

Run on demand, not in CI, so nothing else exercises it. Only the shape of the table and the
arithmetic between its columns are checked, never a timing: on a shared machine timings mean
nothing, and a test asserting on them would be flaky.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

pytestmark = pytest.mark.slow  # starts a torch job in a fresh interpreter per job

SCRIPT = REPO / "benchmarks" / "duty_floor.py"
QUICK = ["--blocks", "2", "--steps", "3", "--warmup", "1"]


def test_duty_floor_prints_one_row_per_job(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--jobs", "tiny,gpt", *QUICK],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    header, *rows = done.stdout.strip().splitlines()
    assert header.split() == [
        "job",
        "step",
        "ms",
        "heap",
        "grads",
        "norm",
        "duties",
        "of",
        "step",
        "5",
        "%",
        "is",
    ]
    assert [row.split()[0] for row in rows] == ["tiny", "gpt"]
    for row in rows:
        step, heap, grads, norm, duties = (float(cell) for cell in row.split()[1:6])
        assert step > 0 and min(heap, grads, norm) >= 0
        # The total is the median of per-step sums, not the sum of medians: equal only within
        # the spread, so only its bounds are checked.
        assert max(heap, grads, norm) * 0.5 <= duties <= (heap + grads + norm) * 2 + 0.002
        share = float(row.split()[6].rstrip("%")) / 100
        assert share == pytest.approx(duties / step, abs=0.0015, rel=0.02)
