"""The agent's hooks on a job's objects copy and pickle as an inert stand-in of the standard
library (`hooks/copy_safe.py`), and the functions it wraps pickle as torch's own.

In-process: the hook objects alone, then the agent's built parts installed around a tiny model.
"""

from __future__ import annotations

import copy
import functools
import pickle
import sys
import threading
import types
from typing import Any

import torch

from memtui_agent.hooks.copy_safe import (
    COPIED_HOOK_EVENT,
    CopySafeHook,
    homes,
    inert_hook,
    stand_in_for,
)
from memtui_agent.startup.joining import STEP_CODE, JoinAtNextStep
from memtui_agent.startup.parts import build_parts
from memtui_protocol.config import AgentConfig


class Hooks:
    """Like the agent's hook objects: a lock inside, which neither copy nor pickle can take."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.calls: list[tuple[Any, ...]] = []

    def pre(self, module: object, args: object, kwargs: object = None) -> None:
        self.calls.append((module, args, kwargs))


def _is_inert(value: object) -> bool:
    return (
        type(value) is functools.partial
        and value.func is sys.audit
        and value.args == (COPIED_HOOK_EVENT,)
        and not value.keywords
    )


def test_the_hook_calls_the_agents_method_with_what_torch_passes() -> None:
    hooks = Hooks()
    hook = CopySafeHook(hooks.pre)
    assert hook("module", ("args",), {"key": 1}) is None
    assert hook("module", ("args",)) is None
    assert hooks.calls == [("module", ("args",), {"key": 1}), ("module", ("args",), None)]


def test_a_copied_or_pickled_hook_is_the_inert_stand_in() -> None:
    hook = CopySafeHook(Hooks().pre)
    data = pickle.dumps(hook)
    assert b"memtui_agent" not in data and b"Hooks" not in data
    for copied in (copy.deepcopy(hook), copy.copy(hook), pickle.loads(data)):
        assert _is_inert(copied)
        assert copied("module", ("args",), {"key": 1}) is None  # a pre-hook with kwargs
        assert copied("module", ("args",), "output") is None  # a forward hook
    assert _is_inert(inert_hook())


def test_a_copied_module_gets_inert_hooks_and_the_original_keeps_the_agents() -> None:
    hooks = Hooks()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.register_forward_pre_hook(CopySafeHook(hooks.pre), with_kwargs=True)
    model.register_forward_hook(CopySafeHook(hooks.pre), always_call=True)
    twin = copy.deepcopy(model)
    loaded = pickle.loads(pickle.dumps(model))
    for other in (twin, loaded):
        assert all(map(_is_inert, other._forward_pre_hooks.values()))
        assert all(map(_is_inert, other._forward_hooks.values()))
        other(torch.ones(1, 2))
    assert hooks.calls == []  # the copies never call the agent
    model(torch.ones(1, 2))
    assert len(hooks.calls) == 2
    assert all(type(hook) is CopySafeHook for hook in model._forward_pre_hooks.values())


def test_a_wrapper_is_installed_where_pickle_looks_for_the_function() -> None:
    clip = torch.nn.utils.clip_grad_norm_
    defining = sys.modules[clip.__module__]
    assert defining is not torch.nn.utils
    assert homes(torch.nn.utils, "clip_grad_norm_") == [
        (torch.nn.utils, "clip_grad_norm_"),
        (defining, "clip_grad_norm_"),
    ]
    scaler = torch.amp.grad_scaler.GradScaler
    assert homes(scaler, "step") == [(scaler, "step")]
    assert homes(torch.autograd, "backward") == [(torch.autograd, "backward")]
    # Under another name, the wrapper goes where pickle looks too (it bears the original's).
    alias = types.ModuleType("alias")
    alias.renamed = clip  # type: ignore[attr-defined]
    assert homes(alias, "renamed") == [(alias, "renamed"), (defining, "clip_grad_norm_")]

    def local() -> None:  # no module holds it by its name: only where it was asked for
        pass

    alias.local = local  # type: ignore[attr-defined]
    assert homes(alias, "local") == [(alias, "local")]


def test_stand_in_for_gives_the_wrapper_the_originals_names() -> None:
    def wrapper() -> None:
        pass

    stand_in_for(wrapper, torch.nn.utils.clip_grad_norm_)
    original = torch.nn.utils.clip_grad_norm_
    assert (wrapper.__module__, wrapper.__qualname__, wrapper.__name__) == (
        original.__module__,
        original.__qualname__,
        original.__name__,
    )
    assert wrapper.__wrapped__ is original  # type: ignore[attr-defined]


def _wrapped_functions() -> list[Any]:
    """Functions the agent wraps, as the job reaches them now."""
    return [
        torch.nn.utils.clip_grad_norm_,
        torch.nn.utils.clip_grad_value_,
        torch.autograd.backward,
        torch.utils.checkpoint.checkpoint,
        torch.amp.grad_scaler.GradScaler.step,
        torch.optim.Optimizer.__init__,
    ]


def test_under_the_agent_models_copy_and_wrapped_functions_pickle_as_without_it() -> None:
    originals = _wrapped_functions()
    before = pickle.dumps(originals)
    clip_home = sys.modules[torch.nn.utils.clip_grad_norm_.__module__]
    parts = build_parts(AgentConfig(), lambda item: None, lambda *said: None)
    parts.install()
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        assert any(type(hook) is CopySafeHook for hook in model._forward_pre_hooks.values())
        twin = copy.deepcopy(model)
        data = pickle.dumps(model)
        assert b"memtui_agent" not in data
        assert all(map(_is_inert, twin._forward_pre_hooks.values()))
        assert all(map(_is_inert, twin._forward_hooks.values()))
        copy.deepcopy(optimizer)
        wrapped = _wrapped_functions()
        assert all(now is not then for now, then in zip(wrapped, originals, strict=True))
        assert clip_home.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_  # both places
        assert pickle.dumps(wrapped) == before  # the same bytes: references to torch's own
    finally:
        parts.remove()
    assert _wrapped_functions() == originals  # restored, in both places
    assert clip_home.clip_grad_norm_ is originals[0]


def test_a_job_waiting_for_attach_pickles_torchs_functions_as_without_it() -> None:
    """Between `memtui attach` and the next step, joining watches `torch.autograd.backward` (a
    job without an optimizer) or the optimizers' step: both wrappers pickle as torch's own."""
    backward = torch.autograd.backward
    step_code = torch.optim.Optimizer.__dict__[STEP_CODE]
    before = pickle.dumps([backward, step_code])
    for by_optimizer in (False, True):
        joining = JoinAtNextStep(
            [],
            [],
            start=lambda: None,
            started=lambda agent: None,
            failed=lambda why: None,
            describe=lambda step: "",
        )
        joining.arm(by_optimizer=by_optimizer)
        try:
            now = [torch.autograd.backward, torch.optim.Optimizer.__dict__[STEP_CODE]]
            assert now != [backward, step_code]  # one of them is joining's wrapper
            assert pickle.dumps(now) == before
        finally:
            assert joining.cancel()
    assert [torch.autograd.backward, torch.optim.Optimizer.__dict__[STEP_CODE]] == [
        backward,
        step_code,
    ]
