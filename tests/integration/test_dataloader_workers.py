"""DataLoader workers whose private memory grows, run for real under `memtui run --headless`.

tests/fixtures/workers/dataset_workers.py trains a small model from two persistent workers. With
its samples in a Python list of dicts (`list`), each worker copies the pages it reads (reference
counts written after fork) and its USS grows by about the dataset's size; in one numpy array
(`numpy`) it stays flat. The truth is measured here, from outside, with psutil: the USS of the
job's children, sampled every 0.2 s, each worker's highest minus its first. memtui must name
`dataset.items` with a `leak` alert and a `Leak` of kind `workers` whose bytes are within 30 % of
that truth, and say nothing of the numpy twin.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from cli_harness import run_memtui, scrubbed_env, start_memtui
from repo_paths import FIXTURES

JOB = FIXTURES / "workers" / "dataset_workers.py"
SAMPLES = "30000"
"""Enough samples for the workers to grow for several seconds (about 120 MiB in all)."""


def _run_measured(kind: str, tmp_path: Path) -> tuple[dict[str, Any], int, str]:
    """Run the job under memtui, measuring its workers' USS growth from outside; the report's
    JSON, the workers' summed growth (bytes) and memtui's output."""
    recording = tmp_path / f"{kind}.memtui"
    process = start_memtui(
        "run",
        "--headless",
        "-o",
        str(recording),
        str(JOB),
        kind,
        "1",
        cwd=tmp_path,
        env=scrubbed_env(JOB_SAMPLES=SAMPLES),
    )
    first: dict[int, int] = {}
    highest: dict[int, int] = {}
    root = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            tree = root.children(recursive=True)
        except psutil.Error:
            break
        for child in tree:
            try:
                parent = child.parent()
                # A worker is forked from the job: it runs the job's command line, whose parent
                # (memtui) does not; any other child of the job runs its own.
                if parent is None or str(JOB) not in parent.cmdline():
                    continue
                if child.cmdline() != parent.cmdline():
                    continue
                uss = int(child.memory_full_info().uss)
            except psutil.Error:
                continue
            first.setdefault(child.pid, uss)
            highest[child.pid] = max(uss, highest.get(child.pid, 0))
        time.sleep(0.2)
    output, errors = process.communicate(timeout=60)
    assert process.returncode == 0, errors
    report = run_memtui("report", "--json", str(recording), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    assert len(first) == 2, f"workers seen from outside: {sorted(first)}"
    growth = sum(highest[pid] - first[pid] for pid in first)
    return json.loads(report.stdout), growth, output + errors


@pytest.mark.slow
def test_workers_copying_a_python_list_are_a_leak_of_the_dataset_attribute(
    tmp_path: Path,
) -> None:
    document, truth, output = _run_measured("list", tmp_path)
    assert truth > 32 * 1024 * 1024, f"the fixture's workers grew only {truth} B"
    leaks = [leak for leak in document["leaks"] if leak["kind"] == "workers"]
    assert [leak["holder"] for leak in leaks] == ["dataset.items"], document["leaks"]
    leak = leaks[0]
    assert abs(leak["bytes"] - truth) <= 0.3 * truth, (leak["bytes"], truth)
    assert leak["tensors"] == 0 and leak["fix"] and "numpy array" in leak["fix"]
    alerts = [alert for alert in document["alerts"] if alert["kind"] == "leak"]
    assert [alert["where"] for alert in alerts] == ["dataset.items"]
    assert "2 DataLoader workers (pids " in alerts[0]["message"]
    assert "a list of 30,000 dict objects in DS" in alerts[0]["message"]
    workers = [step["workers"] for step in document["steps"] if "workers" in step]
    assert workers and all(entry["count"] == 2 for entry in workers)
    assert max(entry["growth"] for entry in workers) <= leak["bytes"]
    # Never the job's piles: the MLP's weights (1.2 MB), whatever the workers hold.
    weights = (64 * 512 + 512) + (512 * 512 + 512) + (512 * 10 + 10)
    assert {step["end"]["weights"] for step in document["steps"]} == {weights * 4}
    text = run_memtui("report", str(tmp_path / "list.memtui"), cwd=tmp_path).stdout
    assert "dataset.items (copied into the DataLoader workers)" in text
    assert "DataLoader workers at step" in text
    assert "leak in dataset.items" in output


@pytest.mark.slow
def test_workers_reading_a_numpy_array_raise_nothing(tmp_path: Path) -> None:
    document, truth, _ = _run_measured("numpy", tmp_path)
    assert truth < 8 * 1024 * 1024, f"the healthy twin's workers grew {truth} B"
    assert document["leaks"] == []
    assert [alert for alert in document["alerts"] if alert["kind"] == "leak"] == []
    workers = [step["workers"] for step in document["steps"] if "workers" in step]
    assert workers and all(entry["count"] == 2 for entry in workers)
