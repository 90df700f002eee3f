"""The one followed thread (issue 32): a move never overlaps the old thread's work, and what the
old thread registered leaves with it.

The job-level proof (two threads training at once, many runs, no crash) is
`tests/integration/test_reliability_job_unharmed.py::test_two_models_on_two_threads_follow_one_thread_and_never_crash`;
these pin the parts it relies on, without a training job.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from memtui_agent.hooks.step_hooks import register_live_optimizers
from memtui_agent.hooks.training_thread import TrainingThread
from memtui_agent.job.modules import ModuleRegistry
from memtui_protocol import schema

SAFETY_S = 60.0
"""A safety net for joins: a hang fails the test instead of the run; never the assertion."""


class _SeenLock:
    """The thread's lock, saying when a thread starts waiting for it."""

    def __init__(self, waiting: threading.Event) -> None:
        self._lock = threading.RLock()
        self._waiting = waiting

    def __enter__(self) -> bool:
        self._waiting.set()
        return self._lock.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._lock.__exit__(*exc)


def test_a_move_waits_for_the_old_threads_section_which_then_finds_it_is_not_followed() -> None:
    """The followed thread is inside a section (registering, hooking, closing) when another
    thread steps the first optimizer: the move waits until the section ends, then forgets; a
    section of the old thread after the move is told it is no longer followed."""
    events: list[str] = []
    inside, leave, claiming = threading.Event(), threading.Event(), threading.Event()
    claimed = threading.Event()
    answers: dict[str, bool] = {}
    holder: list[TrainingThread] = []

    def old_thread() -> None:
        thread = TrainingThread()  # installed here: this thread is followed
        thread.lock = _SeenLock(claiming)  # type: ignore[assignment]
        thread.on_move(lambda old: events.append("moved"))
        holder.append(thread)
        with thread.following() as followed:
            answers["before"] = followed
            inside.set()
            leave.wait(SAFETY_S)
            events.append("section ended")
        claimed.wait(SAFETY_S)
        with thread.following() as followed:
            answers["after"] = followed

    first = threading.Thread(target=old_thread)
    first.start()
    assert inside.wait(SAFETY_S)
    thread = holder[0]
    claims: list[bool] = []
    second = threading.Thread(target=lambda: claims.append(thread.claim()))
    second.start()
    assert claiming.wait(SAFETY_S)  # the claim waits for the lock the section holds
    leave.set()
    second.join(SAFETY_S)
    assert claims == [True]
    assert events == ["section ended", "moved"]
    claimed.set()
    first.join(SAFETY_S)
    assert answers == {"before": True, "after": False}
    assert thread.confirmed and thread.ident == second.ident and thread.left == {first.ident}


def test_once_an_optimizer_stepped_sections_take_no_lock() -> None:
    """The followed thread is final once confirmed: a section neither waits for the lock (held
    elsewhere here) nor changes its answer."""
    thread = TrainingThread()
    assert thread.claim()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with thread.lock:
            held.set()
            release.wait(SAFETY_S)

    other = threading.Thread(target=hold)
    other.start()
    assert held.wait(SAFETY_S)
    try:
        with thread.following() as followed:
            assert followed
        answers: list[bool] = []

        def elsewhere() -> None:
            with thread.following() as followed:
                answers.append(followed)

        third = threading.Thread(target=elsewhere)
        third.start()
        third.join(SAFETY_S)
        assert answers == [False]
    finally:
        release.set()
        other.join(SAFETY_S)


def _optimizer(module: nn.Module) -> Any:
    """An optimizer over `module`'s parameters, as the registry reads one (`param_groups`):
    building a real one first imports torch's compiler, seconds on a loaded machine."""
    optimizer = object.__new__(torch.optim.SGD)
    optimizer.param_groups = [{"params": list(module.parameters())}]
    optimizer.state = defaultdict(dict)  # what torch's Optimizer.__init__ sets
    return optimizer


def _names(published: list[schema.Names]) -> list[str]:
    return [name for message in published for name in message.names]


def test_forgotten_trees_leave_and_come_back_under_their_names() -> None:
    """The registry forgets the old thread's models and optimizers; a model the new thread
    runs too comes back under the ids its names have in the stream (no second `Names`), and a
    tree changed since is named afresh."""
    published: list[schema.Names] = []
    registry = ModuleRegistry(published.append)
    shared = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    other = nn.Sequential(nn.Linear(4, 2))
    optimizer = _optimizer(other)
    ids = [registry.lookup(module) for module in shared.modules()]
    other_id = registry.lookup(other)
    registry.add_optimizer(optimizer)
    assert len(registry.parameters()) == 6
    before = _names(published)
    generation = registry.generation

    registry.forget_objects()
    assert list(registry.live_roots()) == [] and list(registry.live_optimizers()) == []
    assert registry.parameters() == [] and registry.known_id(shared) is None
    assert registry.generation > generation

    assert registry.lookup(shared) == ids[0]
    assert [registry.known_id(module) for module in shared.modules()] == ids
    assert _names(published) == before  # nothing published again
    assert {id(p) for p in registry.parameters()} == {id(p) for p in shared.parameters()}
    other.append(nn.Linear(2, 1))  # changed while forgotten: named afresh, never reusing ids
    assert registry.lookup(other) > other_id
    assert _names(published)[len(before) :] == ["Sequential#3", "Sequential#3.0", "Sequential#3.1"]


def test_the_heap_search_registers_only_optimizers_of_the_followed_threads_models() -> None:
    """At the first backward of a job whose optimizers predate the agent, the search of the heap
    finds every optimizer; only one that trains a model this thread ran is registered (another
    thread's gradients are that thread's to write), and any counts as an optimizer existing."""
    registry = ModuleRegistry(lambda names: None)
    mine, theirs = nn.Linear(3, 3), nn.Linear(3, 3)
    registry.lookup(mine)
    own, other = _optimizer(mine), _optimizer(theirs)
    assert register_live_optimizers(registry)
    assert list(registry.live_optimizers()) == [own]
    del other
