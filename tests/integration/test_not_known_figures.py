"""Every figure a real job's recording states is exact, and "not known" is null (issue 34).

The job (tests/fixtures/partly_hooked.py) runs every third step's forward under its own
saved-tensor hooks, so those steps' activations are not known; its loop frees the gradients
(`zero_grad()`) before each backward. On main before this change such a step said
`max.gradients` 0 below `end.gradients` 330,756, a `peak.total` of 992,292 that never happened
and `activations` 0 in `end`, `max` and `peak`. Read back through `memtui report --json`, the
CSV export and the TensorBoard export (with TensorBoard's own reader).
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI, run_memtui, scrubbed_env
from repo_paths import FIXTURES

from memtui_protocol.schema import PILES

pytestmark = pytest.mark.slow  # starts a torch job

JOB = FIXTURES / "partly_hooked.py"
STEPS = 12
TIMEOUT_S = 240


def tensorboard_points(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, as TensorBoard's own event reader reads the export back; a byte
    figure to the byte, from its exact series (`exact/<tag>/hi_16MiB` x 16,777,216 +
    `exact/<tag>/lo_bytes`), since its curve is a float32."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={TENSORS: 0})
    accumulator.Reload()
    points: dict[str, dict[int, float]] = {}
    for tag in accumulator.Tags()["tensors"]:
        for event in accumulator.Tensors(tag):
            proto = event.tensor_proto
            if not proto.string_val:
                points.setdefault(tag, {})[event.step] = proto.float_val[0]
    for tag in [tag for tag in points if not tag.startswith("exact/")]:
        hi, lo = points.get(f"exact/{tag}/hi_16MiB"), points.get(f"exact/{tag}/lo_bytes")
        if hi is not None and lo is not None:
            assert set(hi) == set(lo) == set(points[tag]), tag
            points[tag] = {step: hi[step] * 16_777_216 + lo[step] for step in hi}
    return points


def not_known(step: dict[str, Any]) -> bool:
    return not step["activations_measured"] and step["activations_from"] is None


def test_every_stated_figure_is_exact_and_not_known_is_null(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard is in the [test] extra")
    job = subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", "rec.memtui", str(JOB), str(STEPS)],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    lines = [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == STEPS
    hooked = {line["step"] for line in lines if line["hooked"]}
    truth = {line["step"]: line["gradients"] for line in lines}

    shown = run_memtui("report", str(tmp_path / "rec.memtui"), "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["version"] == 2
    steps = {step["step"]: step for step in report["steps"]}
    assert sorted(steps) == list(range(1, STEPS + 1))
    unknown = {number for number, step in steps.items() if not_known(step)}
    assert hooked <= unknown  # the job's own hooks hid those forwards
    assert unknown != set(steps)
    for number, step in steps.items():
        end, high, peak = step["end"], step["max"], step["peak"]
        assert end["gradients"] == truth[number], number  # the job's own count at its end
        for pile in PILES:
            if end[pile] is not None and high[pile] is not None:
                assert high[pile] >= end[pile], (number, pile)
        nulls = number in unknown
        for piles in (end, high, peak["piles"]):
            assert (piles["activations"] is None) == nulls, number
        assert (peak["total"] is None) == (None in peak["piles"].values()), number
        if nulls:
            assert peak["total"] is None
            # Counted at the close only, between unwatched moments: no high, no peak value.
            assert high["gradients"] is None and peak["piles"]["gradients"] is None
            assert step["top_activations"] == [] and step["dtypes"]["activations"] == {}
        else:
            assert peak["total"] == sum(peak["piles"].values())

    exported = run_memtui("export", str(tmp_path / "rec.memtui"), "--format", "csv", "-o", "-")
    assert exported.returncode == 0, exported.stderr
    rows = {int(row["step"]): row for row in csv.DictReader(io.StringIO(exported.stdout))}
    for number, step in steps.items():
        for prefix, piles in (("end", step["end"]), ("max", step["max"])):
            for pile in PILES:
                cell = rows[number][f"{prefix}_{pile}"]
                assert (cell == "") == (piles[pile] is None), (number, prefix, pile)
        assert (rows[number]["peak_total"] == "") == (number in unknown)

    board = tmp_path / "tb"
    exported = run_memtui(
        "export", str(tmp_path / "rec.memtui"), "--format", "tensorboard", "-o", str(board)
    )
    assert exported.returncode == 0, exported.stderr
    [run] = list(board.iterdir())
    points = tensorboard_points(run)
    for number, step in steps.items():
        assert (number in points["piles/peak_total"]) == (number not in unknown), number
        for stat, piles in (("end", step["end"]), ("max", step["max"])):
            for pile in PILES:
                value = points.get(f"piles/{stat}/{pile}", {}).get(number)
                assert value == piles[pile], (number, stat, pile)
    assert not unknown & set(points["piles/max/activations"])
    assert sys.executable  # the job ran under this interpreter's memtui
