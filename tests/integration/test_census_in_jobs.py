"""Censuses in real jobs under `memtui run --headless` (issue 32): they run none of the job's code,
stop at their bounds, and an error inside one costs that census, never the recording.

The jobs are in `tests/fixtures/census/`: globals holding every hostile object beside a real
leak; a planted MemoryError inside every census; validation through
`checkpoint(use_reentrant=False)` kept without `torch.no_grad()`, whose graphs would run the
model's forward again if a census unpacked them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI
from repo_paths import FIXTURES

from memtui.model.recording import Recording, read_recording
from memtui_protocol.schema import AlertKind, CensusStop

JOBS = FIXTURES / "census"
STEPS = 60
pytestmark = pytest.mark.slow


@dataclass
class Run:
    recording: Recording | None
    counts: dict[str, Any]
    stderr: str


def _run(job: str, folder: Path, monitored: bool) -> Run:
    folder.mkdir()
    shutil.copy(JOBS / f"{job}.py", folder)
    memtui = [*MEMTUI, "run", "--headless", "-o", "run.memtui"]
    command = [*memtui] if monitored else [sys.executable]
    result = subprocess.run(
        [*command, f"{job}.py", str(STEPS)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line[4:] for line in result.stdout.splitlines() if line.startswith("JOB ")]
    recording = read_recording(folder / "run.memtui") if monitored else None
    return Run(recording, json.loads(lines[-1]), result.stderr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("census-jobs")
    plan = {
        "hostile": ("hostile_globals", True),
        "errors": ("census_errors", True),
        "checkpoint": ("checkpoint_retained", True),
        "checkpoint plain": ("checkpoint_retained", False),
    }
    with ThreadPoolExecutor(max_workers=2) as pool:  # CI has two cores
        started = {
            name: pool.submit(_run, job, tmp / name.replace(" ", "-"), monitored)
            for name, (job, monitored) in plan.items()
        }
        return {name: future.result() for name, future in started.items()}


def _censuses(recording: Recording) -> list[Any]:
    return [step.census for step in recording.steps if step.census is not None]


def test_hostile_globals_run_none_of_their_code_and_every_step_is_recorded(
    runs: dict[str, Run],
) -> None:
    """A sleeping and a raising `__getattr__`, a counting `__getattribute__`, a `__class__`
    property, a lazily loading list, a key with a `__repr__`, a `MagicMock(spec=Tensor)`
    counting `__torch_function__`, a LazyLoader module, an endless `__iter__`, a dead proxy, a
    huge int key, a deep tuple key and a 5,000,000-item list, all beside a growing `history`;
    the loop is a function whose 10 MiB temporary lives across each close."""
    run = runs["hostile"]
    assert run.counts["calls"] == [] and run.counts["mock_calls"] == 0
    assert run.counts["kept_after_del"] == 0  # its frame's locals were read, none kept
    recording = run.recording
    assert recording is not None
    assert [step.step for step in recording.steps] == list(range(1, STEPS + 1))
    censuses = _censuses(recording)
    assert len(censuses) >= 2
    for census in censuses:  # the 5,000,000 numbers: each census stops at a bound, says which
        assert not census.complete
        assert census.stopped in (CensusStop.OBJECTS, CensusStop.SECONDS)
    leaks = [alert.where for step in recording.steps for alert in step.alerts]
    assert "history" in leaks
    assert recording.agent_errors == [] and "failed" not in run.stderr


def test_an_error_inside_every_census_costs_those_censuses_only(runs: dict[str, Run]) -> None:
    run = runs["errors"]
    recording = run.recording
    assert recording is not None
    assert [step.step for step in recording.steps] == list(range(1, STEPS + 1))
    censuses = _censuses(recording)
    assert len(censuses) >= 2
    assert all(census.stopped == CensusStop.ERROR for census in censuses)
    said = [line for line in run.stderr.splitlines() if "memtui: census failed" in line]
    assert len(said) == 1 and "MemoryError: planted inside the census" in said[0]
    assert "the job continues" in said[0]
    assert [error.component for error in recording.agent_errors] == ["census"]


def test_a_retained_checkpointed_graph_is_never_recomputed(runs: dict[str, Run]) -> None:
    """Its saved tensors are never unpacked: the model runs exactly the forwards it runs
    without memtui (60 steps, 60 validations, 60 recomputations in backward), and BatchNorm's
    running mean and the validation total are bit-identical."""
    plain, monitored = runs["checkpoint plain"], runs["checkpoint"]
    assert plain.counts["forwards"] == 3 * STEPS
    assert monitored.counts == plain.counts
    recording = monitored.recording
    assert recording is not None
    assert len(_censuses(recording)) >= 2  # censuses did walk the retained graphs
    alerts = [alert for step in recording.steps for alert in step.alerts]
    assert any(alert.kind == AlertKind.LEAK and alert.where == "val_total" for alert in alerts)
