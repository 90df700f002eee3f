"""A step's signature tells a repeat from a step that only looks like one."""

from __future__ import annotations

import torch
from torch import nn

from memtui_agent.steps.step_signature import (
    Signature,
    SignatureRecorder,
    compare,
    heap_reader,
)


def _steps(model: nn.Module, recorder: SignatureRecorder, count: int) -> list[Signature]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    found = []
    for _ in range(count):
        optimizer.zero_grad()
        loss = model(torch.randn(16, 32)).pow(2).mean()
        recorder.backward()
        loss.backward()
        optimizer.step()
        found.append(recorder.close())
    return found


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.Dropout(0.1)
    )


def test_equal_steps_match_and_a_dropout_switched_off_does_not() -> None:
    model = _model()
    reader = heap_reader()
    recorder = SignatureRecorder(reader, exact_memory=False)
    assert recorder.available
    _warm, *rest = _steps(model, recorder, 6)
    twin = rest[-1]
    assert all(compare(step, twin) is None for step in rest)
    assert twin.nodes[0] > 0 and twin.nodes[-1] == 0
    for module in model:
        if isinstance(module, nn.Dropout):
            module.p = 0.0  # an "early dropout" recipe ends
    changed = _steps(model, recorder, 1)[0]
    mismatch = compare(changed, twin)
    assert mismatch is not None and mismatch.what == "autograd nodes"
    assert changed.nodes[0] < twin.nodes[0]
    assert "here" in mismatch.describe()


def test_memory_is_compared_exactly_on_a_device_and_within_a_tolerance_on_the_heap() -> None:
    base = Signature(nodes=(10, 0), memory=(4096, 0), exact_memory=True)
    assert compare(Signature((10, 0), (4096, 0), True), base) is None
    off = compare(Signature((10, 0), (4608, 0), True), base)
    assert off is not None and off.what.startswith("memory")
    heap = Signature(nodes=(10, 0), memory=(400_000, 0), exact_memory=False)
    assert compare(Signature((10, 0), (401_500, 1_000), False), heap) is None
    assert compare(Signature((10, 0), (450_000, 0), False), heap) is not None
    # A high of activations widens the heap's tolerance to 1% of it.
    assert compare(Signature((10, 0), (450_000, 0), False), heap, activations_high=10**7) is None
    two = compare(Signature((10, 10, 0), (1, 1, 0), False), heap)
    assert two is not None and two.what == "backward passes"


def test_memory_kept_at_the_close_shows() -> None:
    model = _model()
    recorder = SignatureRecorder(heap_reader(), exact_memory=False)
    *_, twin = _steps(model, recorder, 4)
    kept = []
    for _ in range(3):
        kept.append(torch.randn(256, 256))  # 256 KiB kept by the "job" each step
        step = _steps(model, recorder, 1)[0]
    assert step.memory is not None and twin.memory is not None
    assert step.memory[-1] - twin.memory[-1] > 200 * 1024
    assert compare(step, twin) is not None
