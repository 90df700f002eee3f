"""A user's diverging job run under `memtui run`: the divergence is said before the first NaN,
with the fixes, and the recorded gradient norm is the one the job's own `clip_grad_norm_`
returned; healthy variants of the same job raise no divergence."""

from __future__ import annotations

import json
import math
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI
from repo_paths import FIXTURES

from memtui.model.recording import Recording, read_recording
from memtui_protocol.schema import AlertKind

JOB = FIXTURES / "diverging" / "train_mlp.py"
pytestmark = pytest.mark.slow

RUNS = {
    "lr=1e4": ("--lr", "1e4", "--steps", "10"),
    "fast fall": ("--lr", "1e-2", "--steps", "60"),
    "fp16 GradScaler, summed loss, warm-up": (
        *("--lr", "3e-3", "--steps", "60", "--warmup", "20"),
        *("--amp", "--reduction", "sum"),
    ),
}


@dataclass
class Run:
    recording: Recording
    path: Path
    truth: list[dict[str, Any]]


def _run(name: str, tmp: Path) -> Run:
    path = tmp / f"{len(name)}.memtui"
    truth = tmp / f"{len(name)}.json"
    result = subprocess.run(
        [
            *MEMTUI,
            "run",
            "--headless",
            "-o",
            str(path),
            str(JOB),
            *RUNS[name],
            "--truth",
            str(truth),
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return Run(read_recording(path), path, json.loads(truth.read_text()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("diverging")
    with ThreadPoolExecutor(max_workers=2) as pool:  # one core each; CI has two
        started = {name: pool.submit(_run, name, tmp) for name in RUNS}
        return {name: future.result() for name, future in started.items()}


def _first_nonfinite(truth: list[dict[str, Any]]) -> int:
    return next(
        int(row["step"])
        for row in truth
        if not (math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]))
    )


def test_the_divergence_is_said_before_the_first_nan_with_its_fixes(runs: dict[str, Run]) -> None:
    run = runs["lr=1e4"]
    found = [item for item in run.recording.alerts if item.kind == AlertKind.DIVERGENCE]
    assert len(found) == 1  # one per episode, not one per step
    (divergence,) = found
    first_nan = _first_nonfinite(run.truth)
    assert divergence.step is not None and divergence.step < first_nan
    assert divergence.step == divergence.alert.began == 2  # 2.9e14x step 1's loss there
    message = divergence.alert.message
    assert "learning rate" in message and "clip" in message and "GradScaler" in message
    followers = [
        item
        for item in run.recording.alerts
        if item.kind in (AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRADIENT)
    ]
    assert followers and all(item.alert.began == 2 for item in followers)
    first = min(item.step or 0 for item in followers)
    assert first == first_nan
    assert all(
        "divergence that began at step 2" in item.alert.message
        for item in followers
        if item.step == first
    )


def test_the_report_says_the_divergence_first(runs: dict[str, Run]) -> None:
    path = runs["lr=1e4"].path
    text = subprocess.run(
        [*MEMTUI, "report", str(path)], capture_output=True, text=True, timeout=120
    ).stdout
    # Errors lead the report (severity); the first NaN error names the divergence it followed,
    # and the divergence itself is listed as a warning.
    lines = [line.split() for line in text.splitlines() if " step " in line]
    rows = [(words[0], words[3].rstrip(":")) for words in lines if words[1] == "step"]
    numerical = [row for row in rows if row[1].startswith(("divergence", "nonfinite"))]
    assert numerical[0][0] == "error"
    assert ("warning", "divergence") in numerical
    first_error = next(line for line in text.splitlines() if line.startswith("  error "))
    assert "divergence that began at step 2" in first_error
    report = json.loads(
        subprocess.run(
            [*MEMTUI, "report", "--json", str(path)], capture_output=True, text=True, timeout=120
        ).stdout
    )
    assert report["steps"][0]["grad_norm"] == pytest.approx(runs["lr=1e4"].truth[0]["grad_norm"])


@pytest.mark.parametrize("name", list(RUNS))
def test_the_recorded_norm_is_the_jobs_own_clip_grad_norm(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    recorded = {step.step: step.grad_norm for step in run.recording.steps}
    known = [row for row in run.truth if math.isfinite(row["grad_norm"])]
    assert len(known) >= min(3, len(run.truth) // 2)
    for row in known:
        assert recorded[row["step"]] == pytest.approx(row["grad_norm"], rel=1e-5), row
    for row in run.truth:
        if not math.isfinite(row["grad_norm"]):
            assert recorded[row["step"]] is None  # not known: never a number that is not it


@pytest.mark.parametrize("name", [name for name in RUNS if name != "lr=1e4"])
def test_healthy_runs_raise_no_divergence(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert [item.kind for item in run.recording.alerts if item.kind == AlertKind.DIVERGENCE] == []
    losses = [row["loss"] for row in run.truth]
    assert losses[-1] < losses[0] / 2  # it did learn: the shapes the rule must clear
