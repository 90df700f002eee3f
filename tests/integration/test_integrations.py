"""memtui_agent.integrations in real training libraries: a transformers `Trainer` with
`report_to="tensorboard"` and a Lightning `fit` with its `TensorBoardLogger`, each under `memtui
run` and once on its own (the callback starts the agent). The event files are read back with
TensorBoard's own reader and every figure must be the recording's own, step for step, as
`memtui report --json` states it (every figure here is under 2**24 bytes, which a float32
scalar holds exactly)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import DEFAULT_TIMEOUT_S, run_memtui, scrubbed_env
from repo_paths import FIXTURES

pytest.importorskip("transformers", reason="transformers is in the [test] extra")
pytest.importorskip("lightning", reason="lightning is in the [test] extra")
pytest.importorskip("tensorboard", reason="tensorboard is in the [test] extra")

JOBS = FIXTURES / "integrations"
STEPS = 6
EXACT = 2**24
"""Integers up to this are exact in TensorBoard's float32 scalars."""
PILES = ("weights", "gradients", "optimizer_state", "activations")


def read_scalars(output: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value of the one TensorBoard run written under `output`."""
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    [events] = list(output.rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events.parent), size_guidance={SCALARS: 0})
    accumulator.Reload()
    return {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)}
        for tag in accumulator.Tags()["scalars"]
    }


def report_of(recording: Path, cwd: Path) -> dict[str, Any]:
    result = run_memtui("report", "--json", str(recording), cwd=cwd)
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def run_job(tmp_path: Path, job: str, under_memtui: bool) -> tuple[Path, Path]:
    """The job to its end; returns its TensorBoard folder and its recording."""
    output, recording = tmp_path / "out", tmp_path / "run.memtui"
    script = str(JOBS / job)
    if under_memtui:
        result = run_memtui(
            "run", "--headless", "-o", str(recording), script, str(output), cwd=tmp_path
        )
    else:
        result = subprocess.run(
            [sys.executable, script, str(output), str(recording)],
            cwd=tmp_path,
            env=scrubbed_env(tmp_path / "rt"),
            capture_output=True,
            text=True,
            timeout=DEFAULT_TIMEOUT_S,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trained {STEPS} steps" in result.stdout
    assert "failed" not in result.stderr  # no part of the agent or the callback turned off
    return output, recording


def assert_figures_are_the_recordings(
    scalars: dict[str, dict[int, float]], prefix: str, report: dict[str, Any]
) -> None:
    """Each step's logged figures equal the report's, and a figure not known is absent."""
    steps = report["steps"]
    assert [step["step"] for step in steps] == list(range(1, STEPS + 1))
    assert report["exit"]["status"] == "ok"

    def logged(key: str) -> dict[int, float]:
        return scalars.get(f"{prefix}memtui/{key}", {})

    assert logged("step") == {number: float(number) for number in range(1, STEPS + 1)}
    for step in steps:
        number = step["step"]
        for pile in PILES:
            value = step["peak"]["piles"][pile]
            if value is None:
                assert number not in logged(f"{pile}_bytes")
            else:
                assert value < EXACT
                assert logged(f"{pile}_bytes")[number] == value, (pile, number)
        assert logged("peak_bytes")[number] == step["peak"]["held"]
        assert number not in logged("other_bytes")  # a CPU job: the allocator has no peak
        known = step["peak"]["piles"]["activations"] is not None
        assert logged("activations_known")[number] == (1 if known else 0)
        assert logged("activations_measured")[number] == (1 if step["activations_measured"] else 0)
        for severity in ("error", "warning", "note"):
            raised = sum(
                1
                for alert in report["alerts"]
                if alert["severity"] == severity and alert["step"] <= number
            )
            assert logged(f"alerts_{severity}")[number] == raised, (severity, number)
        assert logged("leaks")[number] == 0 == len(report["leaks"])
        assert logged("leak_bytes")[number] == 0
    assert sum(1 for step in steps if not step["activations_measured"]) > 0  # some carried


@pytest.mark.slow
@pytest.mark.parametrize("under_memtui", [True, False], ids=["memtui-run", "own-agent"])
def test_trainer_report_to_tensorboard_gets_the_recordings_figures(
    tmp_path: Path, under_memtui: bool
) -> None:
    output, recording = run_job(tmp_path, "hf_trainer.py", under_memtui)
    scalars = read_scalars(output)
    # Through the Trainer's own logs, beside its loss, which goes on as before.
    assert set(scalars["train/loss"]) == set(range(1, STEPS + 1))
    assert_figures_are_the_recordings(scalars, "train/", report_of(recording, tmp_path))
    # Not a constant: the first step's peak (in the forward) has no optimizer state yet.
    assert len(set(scalars["train/memtui/peak_bytes"].values())) > 1


@pytest.mark.slow
@pytest.mark.parametrize("under_memtui", [True, False], ids=["memtui-run", "own-agent"])
def test_lightning_loggers_get_the_recordings_figures(tmp_path: Path, under_memtui: bool) -> None:
    output, recording = run_job(tmp_path, "lightning_fit.py", under_memtui)
    assert_figures_are_the_recordings(read_scalars(output), "", report_of(recording, tmp_path))


@pytest.mark.slow
def test_metrics_through_accelerate_log_are_the_recordings_figures(tmp_path: Path) -> None:
    """The plain dict, logged by the job's own loop through accelerate's TensorBoard tracker."""
    output, recording = run_job(tmp_path, "accelerate_loop.py", under_memtui=True)
    assert_figures_are_the_recordings(read_scalars(output), "", report_of(recording, tmp_path))


@pytest.mark.slow
def test_importing_the_integrations_imports_no_library() -> None:
    """`import memtui_agent.integrations` (and `metrics()` with no agent) loads neither torch
    nor any training library: each callback's module imports its own."""
    probe = (
        "import sys, json, memtui_agent, memtui_agent.integrations as i\n"
        "print(json.dumps([i.metrics(), sorted(sys.modules)]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    figures, modules = json.loads(result.stdout)
    assert figures == {}
    for library in ("torch", "transformers", "lightning", "pytorch_lightning", "accelerate"):
        assert library not in modules
