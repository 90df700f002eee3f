"""Every tensor a distillation job keeps is in a pile or in the kept figure, in every mode.

`tests/fixtures/kept/distill_ema.py` builds an `AveragedModel` of its student at step 5 (a
deepcopy of it: this stopped the job under memtui before), calls it as the teacher and updates
it after every step, and keeps a second EMA as a plain list of tensors. It prints its own count
after each `opt.step()`. Under `memtui run --headless`, in `auto`, `every` and `off`: every
step's weights equal the job's count of the student and the AveragedModel (from the step that
first calls it), and every step that took a census states the list's bytes under its name
`ema_list` in `kept`, and `kept`'s total equals the job's count of every tensor it keeps outside
the piles.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cli_harness import MEMTUI
from repo_paths import FIXTURES

from memtui.model.recording import read_recording

JOB = FIXTURES / "kept" / "distill_ema.py"
STEPS = 24
EMA_FROM = 5

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["auto", "every", "off"])
def test_an_ema_model_and_an_ema_list_are_counted_exactly(tmp_path: Path, mode: str) -> None:
    recording_path = tmp_path / f"{mode}.memtui"
    command = [*MEMTUI, "run", "--headless", "--activations", mode, "-o", str(recording_path)]
    result = subprocess.run(
        [*command, str(JOB), str(STEPS), str(EMA_FROM)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    counts = [
        json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("JOB ")
    ]
    assert [count["step"] for count in counts] == list(range(1, STEPS + 1))
    recording = read_recording(recording_path)
    steps = {step.step: step for step in recording.steps}
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert [steps[c["step"]].end.weights for c in counts] == [c["weights"] for c in counts]
    assert counts[EMA_FROM - 1]["weights"] == 2 * counts[0]["weights"] + 8  # n_averaged: int64
    counted = [(step.step, step.kept) for step in recording.steps if step.kept is not None]
    assert [number for number, _ in counted][:3] == [3, EMA_FROM, 9]  # first, new model, doubling
    for number, kept in counted:
        census = steps[number].census
        assert census is not None and census.complete
        holders = {holder.holder: holder for holder in kept.holders}
        ema_list = holders["ema_list"]
        assert (ema_list.bytes, ema_list.tensors) == (counts[number - 1]["ema_list"], 6)
        assert kept.bytes == sum(holder.bytes for holder in kept.holders)
        # Nothing of the piles (the models' weights and gradients, the optimizer's state) is
        # in it; the rest of what the loop keeps (batch, outputs, loss) is, each storage once.
        assert kept.bytes == counts[number - 1]["kept"]
    assert recording.agent_errors == []
