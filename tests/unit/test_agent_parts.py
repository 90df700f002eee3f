"""One place builds the agent (`startup.parts.build_parts`), one switch turns its hooks off, and
the agent asks its parts by name, with one explicit "not started" state.

In-process and fast: a tiny model trained a step or two on the CPU, no interpreter.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import torch

from memtui_agent.hooks.step_hooks import StepHooks
from memtui_agent.startup import agent as agent_module
from memtui_agent.startup.agent import Agent
from memtui_agent.startup.agent_state import NOT_STARTED, NotStarted, Parts, Position
from memtui_agent.startup.parts import AgentParts, build_parts
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig


class Said:
    """The agent's `report_failure`, recorded."""

    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []

    def __call__(self, component: str, exc: BaseException, effect: str = "", /) -> None:
        self.failures.append((component, str(exc)))


def _train(steps: int) -> torch.nn.Module:
    """A few steps; the model is returned so that its weights stay in the piles."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    return model


def _installed(said: Said) -> AgentParts:
    parts = build_parts(AgentConfig(), lambda item: None, said)
    parts.install()
    return parts


def test_built_parts_close_steps_and_answer_by_name() -> None:
    said = Said()
    parts = _installed(said)
    try:
        model = _train(2)
    finally:
        parts.remove()
    assert parts.steps_recorded() == (2, 2)
    position = parts.position()
    assert (position.step, position.closed) == (3, 2)
    assert position.piles is not None and position.piles.weights == (16 + 4) * 4
    assert parts.last_oom() is None  # no allocator failure seen
    assert said.failures == []
    del model


def test_one_shared_switch_turns_a_kind_of_hook_off_everywhere() -> None:
    """The step hooks, the GradScaler wrappers and the backward wrapper read the same switch:
    turned off once (said once), no step closes; the other kinds go on counting."""
    said = Said()
    parts = build_parts(AgentConfig(), lambda item: None, said)
    parts.context.switches.disable("steps", RuntimeError("planted"))
    parts.install()
    try:
        model = _train(2)
    finally:
        parts.remove()
    assert said.failures == [("hook:steps", "planted")]
    assert parts.steps_recorded() == (0, 0)
    piles = parts.position().piles
    assert piles is not None and piles.weights == (16 + 4) * 4  # the module hooks counted
    del model


def test_disable_turns_every_hook_off_and_removes_them() -> None:
    """A forked child's parts: every switch off, and torch's functions are its own again."""
    original = torch.autograd.backward
    parts = _installed(Said())
    assert torch.autograd.backward is not original
    parts.disable()
    assert torch.autograd.backward is original
    assert not any(parts.context.switches.values())


def test_hooks_take_one_context_instead_of_a_parameter_list() -> None:
    """StepHooks took 13 parameters; a context, its first-step helper, the allocator reader
    and the object sync are what it takes now."""
    assert list(inspect.signature(StepHooks).parameters) == [
        "context",
        "first_steps",
        "allocator",
        "sync_objects",
    ]


def test_an_agent_that_never_started_holds_the_not_started_parts() -> None:
    agent = Agent(AgentConfig(socket=False))
    assert agent.parts is NOT_STARTED
    assert agent._tick() is None
    agent.watch(torch.nn.Linear(2, 2), None)  # nothing to register it with: no error
    agent.finish(exit_code=0)  # no emitter, no parts: nothing to write, nothing raised


def test_not_started_answers_nothing_known() -> None:
    parts: Parts = NotStarted()
    assert parts.position() == Position()
    assert parts.final_leaks({}, None) == [] and parts.late_health() == []
    assert parts.last_oom() is None and parts.unfinished_alloc_events() is None
    assert not parts.readable_at_end() and not parts.alloc_events_never_started()
    assert parts.steps_recorded() == (0, 0) and parts.owner_thread() is None
    alert = schema.Alert(kind=schema.AlertKind.ATTACHED, message="x")
    parts.join_steps(schema.StepTrigger.OPTIMIZER, 3, alert)  # nothing to join
    parts.remove()
    parts.disable()


def _reaches_through(tree: ast.AST) -> list[str]:
    """`self.parts.x.y`, `parts.x.y` or `self.parts.x` not called: reaching through a part."""
    found = []
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.Attribute):
                continue
            base = child.value
            is_parts = (isinstance(base, ast.Name) and base.id == "parts") or (
                isinstance(base, ast.Attribute)
                and base.attr == "parts"
                and isinstance(base.value, ast.Name)
                and base.value.id == "self"
            )
            called = isinstance(node, ast.Call) and node.func is child
            if is_parts and not called:
                found.append(ast.unparse(node))
    return found


def test_the_agent_asks_its_parts_and_never_reaches_through_them() -> None:
    tree = ast.parse(Path(inspect.getfile(agent_module)).read_text())
    assert _reaches_through(tree) == []
    source = ast.unparse(tree)
    assert "tracker" not in source
    assert "parts is None" not in source and "parts is not None" not in source


def test_the_reach_through_check_sees_a_reach_through() -> None:
    """The check above is not vacuous."""
    planted: Any = ast.parse("x = self.parts.closer.gpu_events.last_oom\nparts.window.closed")
    assert len(_reaches_through(planted)) == 2
