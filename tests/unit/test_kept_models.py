"""Models the job keeps beside the one it trains are in the weights, and copying a model under
memtui works as without it.

A distillation job keeps an EMA of its student (`torch.optim.swa_utils.AveragedModel`, a
`copy.deepcopy` of the student) or a teacher, called from some step on under `no_grad`: no
optimizer trains it, and its first call may come on a step whose module hooks are off
(`--activations auto` between measured steps, `off` after the first step). In-process: a
tiny student on the CPU, the agent built with `build_parts`, each close's weights read from what
the step window hands the emitter.
"""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from memtui_agent.startup.parts import AgentParts, build_parts
from memtui_agent.steps.frame import ClosedStep
from memtui_protocol.config import AgentConfig
from memtui_protocol.schema import ActivationMode


class Said:
    """The agent's `report_failure`, recorded."""

    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []

    def __call__(self, component: str, exc: BaseException, effect: str = "", /) -> None:
        self.failures.append((component, str(exc)))


def _weights_of(*modules: nn.Module) -> int:
    """The job's own count: unique storages of the modules' parameters and buffers."""
    seen: dict[int, int] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _installed(mode: ActivationMode, frames: list[ClosedStep], said: Said) -> AgentParts:
    def emit(item: object) -> None:
        if isinstance(item, ClosedStep):
            frames.append(item)

    parts = build_parts(AgentConfig(activations=mode), emit, said)
    parts.install()
    return parts


def _distill(steps: int, ema_from: int) -> list[int]:
    """Train a student; from step `ema_from` an AveragedModel of it is built, called as the
    teacher and updated after each step. The job's own weights count at each close."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    ema: AveragedModel | None = None
    truth: list[int] = []
    for step in range(1, steps + 1):
        if step == ema_from:
            ema = AveragedModel(student, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        x = torch.randn(4, 8)
        out = student(x)
        loss = out.square().mean()
        if ema is not None:
            with torch.no_grad():
                target = ema(x)
            loss = loss + (out - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        truth.append(_weights_of(student) + (_weights_of(ema) if ema is not None else 0))
        if ema is not None:
            ema.update_parameters(student)
    return truth


@pytest.mark.parametrize("mode", list(ActivationMode))
@pytest.mark.parametrize("ema_from", [1, 9])
def test_an_ema_model_is_in_the_weights_from_its_first_call(
    mode: ActivationMode, ema_from: int
) -> None:
    """Built before the first forward or after the measured first steps, in every mode, the
    AveragedModel's parameters and buffer are weights from the step that first calls it."""
    frames: list[ClosedStep] = []
    said = Said()
    parts = _installed(mode, frames, said)
    try:
        truth = _distill(14, ema_from)
    finally:
        parts.remove()
    weights = [frame.inputs.reading.ledger.end.weights for frame in frames]
    assert weights == truth
    assert truth[ema_from - 1] > truth[0] or ema_from == 1
    assert said.failures == []


def _job_hook(module: nn.Module, args: tuple[object, ...]) -> None:
    """The job's own forward pre-hook (a plain function: it pickles)."""


def _teacher_taught(steps: int, teacher_from: int, teacher: nn.Module) -> list[int]:
    """Train a student; from step `teacher_from` the frozen `teacher` (built before the agent
    started, never trained, never copied) is called under `no_grad` for the student's target."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    truth: list[int] = []
    for step in range(1, steps + 1):
        x = torch.randn(4, 8)
        out = student(x)
        loss = out.square().mean()
        if step >= teacher_from:
            with torch.no_grad():
                target = teacher(x)
            loss = loss + (out - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        truth.append(_weights_of(student) + (_weights_of(teacher) if step >= teacher_from else 0))
    return truth


@pytest.mark.parametrize("mode", list(ActivationMode))
def test_a_teacher_first_called_on_an_unmeasured_step_is_in_the_weights(
    mode: ActivationMode,
) -> None:
    """A teacher built before the agent starts and first called at step 9 (its module hooks
    off then under `auto` and `off`) is weights from step 9's close on."""
    teacher = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).requires_grad_(False)
    frames: list[ClosedStep] = []
    said = Said()
    parts = _installed(mode, frames, said)
    try:
        truth = _teacher_taught(14, 9, teacher)
    finally:
        parts.remove()
    assert [frame.inputs.reading.ledger.end.weights for frame in frames] == truth
    assert said.failures == []


def _trained_under_agent(mode: ActivationMode) -> tuple[nn.Module, AgentParts, Said]:
    said = Said()
    parts = _installed(mode, [], said)
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_forward_pre_hook(_job_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    return model, parts, said


def _hook_modules(module: nn.Module) -> list[str]:
    hooks: list[Any] = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return [getattr(hook, "__module__", "") or "" for hook in hooks]


@pytest.mark.parametrize("mode", list(ActivationMode))
def test_a_model_under_memtui_deep_copies_and_pickles_as_without_it(mode: ActivationMode) -> None:
    """`copy.deepcopy` and `torch.save` of a root (which holds memtui's root hooks) work, and
    the copy holds the job's own hook only; the model itself keeps memtui's."""
    model, parts, said = _trained_under_agent(mode)
    try:
        assert any(name.startswith("memtui_agent.") for name in _hook_modules(model))
        copied = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        pickled = pickle.loads(pickle.dumps(model))
    finally:
        parts.remove()
    for other in (copied, pickled):
        assert not any(name.startswith("memtui_agent.") for name in _hook_modules(other))
        assert len(other._forward_pre_hooks) == 1  # the job's own
        assert not other._forward_pre_hooks_with_kwargs and not other._forward_hooks_always_called
        assert torch.equal(other.get_parameter("0.weight"), model.get_parameter("0.weight"))
    assert said.failures == []
