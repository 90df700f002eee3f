"""The step definition (docs/design.md#steps): optimizer closes, GradScaler skips, ticks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from memtui.model.recording import Recording, read_recording

pytestmark = pytest.mark.slow  # each test starts a torch job or two

GRAD_SCALER = """
import torch, memtui_agent
torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(4):
        opt.zero_grad()
        loss = model(torch.randn(2, 8)).pow(2).mean()
        scaler.scale(loss).backward()
        if step == 1:
            model.weight.grad[0, 0] = float("inf")  # forced overflow: the update is skipped
        scaler.step(opt)
        scaler.update()
        print("LOSS", repr(loss.item()), "SCALE", scaler.get_scale(), flush=True)
"""

NO_OPTIMIZER = """
import time, torch, memtui_agent
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = torch.nn.Linear(64, 64)
    keep = []
    deadline = time.time() + 2.6
    while time.time() < deadline:
        keep.append(model(torch.randn(32, 64)))  # graphs kept alive: activations stay
        keep = keep[-3:]
        time.sleep(0.01)
"""

WATCH_AND_WORKERS = """
import sys, torch, memtui_agent
from torch.utils.data import DataLoader, TensorDataset

with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = torch.nn.Linear(16, 2)
    opt = torch.optim.Adam(model.parameters())
    memtui_agent.watch(model, opt)
    data = TensorDataset(torch.randn(64, 16), torch.randn(64, 2))
    loader = DataLoader(data, batch_size=16, num_workers=2, multiprocessing_context=sys.argv[1])
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
print("WORKERS OK")
"""


def _run(run_python: Any, tmp_path: Path, source: str, *args: str) -> tuple[str, Recording]:
    result = run_python(source, *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return result.stdout, read_recording(tmp_path / "rec.memtui")


def test_grad_scaler_skip_is_a_skipped_step_with_scale_and_unscaled_loss(
    tmp_path: Path, shared_python: Any
) -> None:
    stdout, recording = _run(shared_python, tmp_path, GRAD_SCALER)
    printed = [line.split() for line in stdout.splitlines() if line.startswith("LOSS")]
    steps = recording.steps
    assert [step.step for step in steps] == [1, 2, 3, 4]
    assert [step.skipped for step in steps] == [False, True, False, False]
    assert [a.kind for a in steps[1].alerts] == ["skipped_step"]
    # The scale each step's backward used: 1024 until the skip halves it.
    assert [step.scale for step in steps] == [1024.0, 1024.0, 512.0, 512.0]
    # The loss is the unscaled one the job computed, not scale * loss.
    assert [step.loss for step in steps] == [float(fields[1]) for fields in printed]
    # SGD momentum buffers: 8*4 + 4 floats, allocated at the first (not skipped) update.
    assert steps[0].end.optimizer_state == (8 * 4 + 4) * 4


def test_job_without_optimizer_gets_ticks_with_live_piles(
    tmp_path: Path, shared_python: Any
) -> None:
    from memtui_protocol import schema, wire

    _, recording = _run(shared_python, tmp_path, NO_OPTIMIZER)
    assert recording.steps == []
    messages = list(wire.FrameDecoder().feed((tmp_path / "rec.memtui").read_bytes()))
    ticks = [m for m in messages if isinstance(m, schema.Tick)]
    assert len(ticks) >= 2
    assert all(tick.piles.weights == (64 * 64 + 64) * 4 for tick in ticks)
    assert all(tick.piles.counted()[3] > 0 for tick in ticks)
    assert recording.end is not None and recording.end.status == "ok"


def test_watch_counts_weights_and_forked_or_spawned_workers_stay_silent(
    tmp_path: Path, run_python: Any
) -> None:
    # Fresh interpreters (`run_python`): spawned workers re-run `__main__` as a fresh
    # interpreter's, and forked ones copy whatever a shared interpreter holds.
    for context in ("fork", "spawn"):
        folder = tmp_path / context
        folder.mkdir()
        stdout, recording = _run(run_python, folder, WATCH_AND_WORKERS, context)
        assert "WORKERS OK" in stdout
        assert len(recording.steps) == 4
        assert recording.steps[0].peak.weights == (16 * 2 + 2) * 4
        assert recording.end is not None and recording.end.status == "ok"
        assert not recording.agent_errors
