"""Leaks of every shape of growth, run as users run their jobs (`memtui run`, default mode, CPU):
an evaluation every k steps that keeps its graphs, a leak of 1 KiB a step under the heap's
noise, and a real leak among names that are only rebound (docs/numbers.md#leaks). Each job
counts what its holder keeps and when its growth began; memtui must name that holder alone,
soon, with the cadence it grew at."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI
from repo_paths import FIXTURES

from memtui.model.recording import Recording, read_recording
from memtui_protocol.schema import AlertKind

JOBS = FIXTURES / "growing"
pytestmark = pytest.mark.slow


def _run(tmp: Path, job: str, steps: int, **env: str) -> tuple[Recording, dict[str, Any]]:
    recording = tmp / f"{job}-{'-'.join(env.values()) or 'default'}.memtui"
    result = subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", str(recording), str(JOBS / f"{job}.py"), str(steps)],
        cwd=JOBS,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )
    assert result.returncode == 0, result.stderr
    lines = [line[4:] for line in result.stdout.splitlines() if line.startswith("JOB ")]
    return read_recording(recording), json.loads(lines[-1])


def _alerts(recording: Recording) -> list[tuple[int, str]]:
    return [
        (step.step, alert.where or "")
        for step in recording.steps
        for alert in step.alerts
        if alert.kind == AlertKind.LEAK
    ]


@pytest.mark.parametrize("every", [2, 5])
def test_an_evaluation_every_k_steps_is_named_within_ten_steps(tmp_path: Path, every: int) -> None:
    recording, counts = _run(tmp_path, "val_every", 40, VAL_EVERY=str(every))
    ((step, holder),) = _alerts(recording)
    assert holder == counts["holder"] and step - counts["first_step"] <= 10, step
    end = recording.end
    assert end is not None
    (leak,) = end.leaks
    assert leak.every == every and leak.first_step == counts["first_step"]
    # One validation's graph a cadence: its saved tensors and output, per step.
    per_growth = leak.per_step * every
    assert per_growth * (len(counts["validated"]) - 1) <= leak.bytes
    assert leak.bytes <= per_growth * (len(counts["validated"]) + 1)


def test_only_the_real_leak_is_named_among_rebound_names(tmp_path: Path) -> None:
    """`out`, `mean`, `vx, vy`, `val_logits` and a one-off `logits` of 4 MiB are rebound or
    made once: before, the census after the one-off named `logits` ("grows 1 MiB a step"),
    `vx`, `val_logits` and `vy` beside `history`."""
    recording, counts = _run(tmp_path, "rebound_names", 60)
    assert [holder for _step, holder in _alerts(recording)] == ["history"]
    end = recording.end
    assert end is not None
    (leak,) = end.leaks
    assert abs(leak.bytes - counts["bytes"]) <= counts["bytes"] // 10
    assert leak.per_step == 8192 and leak.every in (1, None)


def test_a_slow_leak_of_one_kib_a_step_is_named_within_three_hundred_steps(
    tmp_path: Path,
) -> None:
    recording, counts = _run(tmp_path, "slow_leak", 300)
    ((step, holder),) = _alerts(recording)
    assert holder == "stats" and step < 300
    end = recording.end
    assert end is not None
    (leak,) = end.leaks
    assert leak.bytes == counts["bytes"] and leak.first_step <= 5
    assert leak.per_step == 1024
