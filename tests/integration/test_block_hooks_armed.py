"""The repeated blocks' pre-hooks (their inputs' bytes for `memtui estimate --from`) are on a
block only while the step is measured: a carried step runs none of them (each costs torch's
slow call path), and the measured steps still record every block's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_harness import run_memtui
from repo_paths import FIXTURES

pytestmark = pytest.mark.slow  # a torch child under `memtui run`


def test_block_pre_hooks_are_on_measured_steps_only(tmp_path: Path) -> None:
    recording = tmp_path / "blocks.memtui"
    seen_path = tmp_path / "seen.json"
    ran = run_memtui(
        "run",
        "--headless",
        "-o",
        str(recording),
        str(FIXTURES / "block_hooks_seen.py"),
        str(seen_path),
        cwd=FIXTURES,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(seen_path.read_text())
    report = run_memtui("report", str(recording), "--json", cwd=FIXTURES)
    assert report.returncode == 0, report.stderr
    steps = json.loads(report.stdout)["steps"]
    assert len(steps) == len(seen) == 10
    measured = [step["step"] for step in steps if step["activations_measured"]]
    carried = [step["step"] for step in steps if step["activations_from"] is not None]
    assert measured and carried, (measured, carried)
    for number in measured:
        assert seen[number - 1] == 1, (number, seen)
    for number in carried:
        assert seen[number - 1] == 0, (number, seen)
    # A budget under the peak, so the plan reads the measured step's blocks.
    planned = run_memtui(
        "estimate", "--from", str(recording), "--budget", "1MB", "--json", cwd=FIXTURES
    )
    assert planned.returncode == 0, planned.stderr
    blocks = json.loads(planned.stdout)["blocks"]
    assert [block["module"] for block in blocks] == [f"blocks.{i}" for i in range(4)]
    # Each block's input: the hidden state, 4 x 32 tokens x 64 float32.
    assert all(block["inputs"] == 4 * 32 * 64 * 4 and block["saved"] > 0 for block in blocks)
