"""A step's signature tells a repeat from a step that only looks like one."""

from __future__ import annotations

import gc

import torch
from torch import nn

from memtui_agent.steps.activation_wording import clause
from memtui_agent.steps.step_signature import (
    Difference,
    Signature,
    SignatureRecorder,
    compare,
    heap_reader,
)
from memtui_protocol.schema import Allocator

CPU = Allocator()


def _steps(model: nn.Module, recorder: SignatureRecorder, count: int) -> list[Signature]:
    """`count` steps, with Python's cyclic collector held off: earlier tests' garbage freed in
    the middle of one would move the heap (in a job that makes a step "not known", the safe
    side; here it would test the collector, not the recorder)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    found = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(count):
            optimizer.zero_grad()
            loss = model(torch.randn(16, 32)).pow(2).mean()
            recorder.backward()
            loss.backward()
            optimizer.step()
            found.append(recorder.close(CPU))
    finally:
        gc.enable()
    return found


def _model(width: int = 64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, 64), nn.Dropout(0.1)
    )


def test_equal_steps_match_and_a_dropout_switched_off_does_not() -> None:
    model = _model()
    recorder = SignatureRecorder(heap_reader())
    assert recorder.available
    _warm, *rest = _steps(model, recorder, 6)
    twin = rest[-1]
    assert all(compare(step, twin) is None for step in rest)
    assert twin.nodes[0] > 0 and twin.nodes[-1] == 0
    assert twin.memory is not None
    for module in model:
        if isinstance(module, nn.Dropout):
            module.p = 0.0  # an "early dropout" recipe ends
    changed = _steps(model, recorder, 1)[0]
    mismatch = compare(changed, twin)
    assert mismatch is not None and mismatch.what is Difference.NODES
    assert changed.nodes[0] < twin.nodes[0]
    assert "nodes here" in clause(mismatch, 3) and "in step 3" in clause(mismatch, 3)


def test_same_ops_on_other_sizes_differ_on_the_heap() -> None:
    """What the node count cannot see: the same ops on a wider hidden layer."""
    recorder = SignatureRecorder(heap_reader())
    *_, narrow = _steps(_model(64), recorder, 3)
    *_, wide = _steps(_model(4096), recorder, 3)
    assert wide.nodes == narrow.nodes
    mismatch = compare(wide, narrow)
    assert mismatch is not None and mismatch.what is Difference.HEAP


def test_device_memory_is_compared_exactly_and_the_heap_within_a_tolerance() -> None:
    recorder = SignatureRecorder(None)
    on_device = recorder.close(Allocator(allocated=1 << 20, alloc_bytes=4096, allocations=3))
    assert on_device.memory == (4096, 3) and on_device.exact_memory
    base = Signature(nodes=(10, 0), memory=(4096, 3), exact_memory=True)
    assert compare(Signature((10, 0), (4096, 3), True), base) is None
    off = compare(Signature((10, 0), (4608, 3), True), base)
    assert off is not None and off.what is Difference.DEVICE
    heap = Signature(nodes=(10, 0), memory=(400_000,), exact_memory=False)
    assert compare(Signature((10, 0), (401_500,), False), heap) is None
    assert compare(Signature((10, 0), (450_000,), False), heap) is not None
    # A high of activations widens the heap's tolerance to 1% of it.
    assert compare(Signature((10, 0), (450_000,), False), heap, activations_high=10**7) is None
    two = compare(Signature((10, 10, 0), (1,), False), heap)
    assert two is not None and two.what is Difference.BACKWARDS
    readers = compare(Signature((10, 0), (1,), False), base)
    assert readers is not None and readers.what is Difference.READERS
