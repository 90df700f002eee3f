"""The census names what holds memory no pile explains, with bytes equal to an independent count.

Each case builds the holder a user writes (a list of non-detached logits, a validation total
accumulated without `torch.no_grad()`, a module's dict cache, a hook storing outputs in a
closure, a bounded deque) and checks the census against storages counted here, by hand or
through a saved-tensor hook of the test's that counts what autograd saves and hands each tensor
on to the agent's own pack hook (the census knows what a graph saved only from that hook's
records: it never reads a graph's `_saved_*`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import nn

from memtui_agent.hooks.saved_tensors import unpack
from memtui_agent.memory.census import take_census
from memtui_agent.memory.ledger import Ledger, storages_of
from memtui_agent.memory.tensor_reads import next_sequence_number
from memtui_agent.startup.parts import build_parts
from memtui_agent.steps.held_graphs import HeldGraphs
from memtui_protocol.config import AgentConfig
from memtui_protocol.schema import CensusStop, LeakKind


def _keys(*tensors: torch.Tensor) -> dict[int, int]:
    return {key: nbytes for t in tensors for key, nbytes, _d, _s in storages_of(t)}


def _weights(model: nn.Module) -> set[int]:
    return set(_keys(*model.parameters(), *model.buffers()))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class SavedCount:
    """The test's own count of what autograd saves (unique storages, parameters left out), each
    tensor then packed by the agent's real pack hook (`Tracker._pack`) into `ledger`."""

    def __init__(self, parameters: set[int]) -> None:
        self.parameters = parameters
        self.storages: dict[int, int] = {}
        self.ledger = Ledger()
        parts = build_parts(AgentConfig(), lambda message: None, _no_failure, self.ledger)
        self.counting = parts.tracker.hooks.counting

    def pack(self, tensor: torch.Tensor) -> Any:
        for key, nbytes, _dtype, _storage in storages_of(tensor):
            if key not in self.parameters:
                self.storages[key] = nbytes
        return self.counting.pack(tensor)

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, unpack)


def _no_failure(component: str, exc: BaseException, effect: str = "") -> None:
    raise AssertionError(f"{component}: {exc}")


def test_a_list_of_logits_kept_after_backward_is_tensors_held_by_the_list() -> None:
    model = _model()
    history: list[torch.Tensor] = []
    for _ in range(5):
        logits = model(torch.randn(8, 16))
        logits.sum().backward()
        history.append(logits)  # not detached: its graph ran backward, its buffers are freed
    census = take_census([("history", history), ("model", model)], excluded=_weights(model))
    holding = census.holdings["history"]
    assert holding.kind is LeakKind.TENSORS
    assert holding.tensors == 5 and holding.attached == 5
    assert holding.container == "list"
    assert holding.storages == _keys(*history)
    assert holding.bytes == 5 * 8 * 4 * 4
    assert census.complete


def test_a_validation_total_without_no_grad_is_a_retained_graph_of_every_batch() -> None:
    model = _model()
    count = SavedCount(_weights(model))
    val_total: Any = 0.0
    with count.hooks():
        for _ in range(3):
            x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
            val_total += nn.functional.cross_entropy(model(x), y)
    census = take_census(
        [("val_total", val_total), ("model", model)],
        excluded=_weights(model),
        saved=count.ledger.saved_by_node(),
    )
    holding = census.holdings["val_total"]
    assert holding.kind is LeakKind.RETAINED_GRAPH
    assert holding.storages == _keys(val_total)
    expected = {k: v for k, v in count.storages.items() if k not in holding.storages}
    assert holding.graph_storages == expected
    assert sum(expected.values()) > 3 * 8 * 32 * 4  # every batch's activations, not one
    assert census.unattributed == 0


class ScaleHalf(nn.Module):
    """Scales half of its input in place through a view: autograd hides the node that saved
    for it inside `CopySlices`, which the walk cannot see into."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1
        y[:, :8].mul_(x[:, 8:])
        return y.sin()


def test_storages_saved_for_a_hidden_node_go_to_the_root_call_that_saved_them() -> None:
    """Matched by the root call's numbers (held_graphs' marker), not left unattributed."""
    model = nn.Sequential(nn.Linear(16, 16), ScaleHalf())
    weights = _weights(model)
    count = SavedCount(weights)
    held = HeldGraphs()
    with count.hooks():
        first = next_sequence_number()
        kept = model(torch.randn(4, 16))
        held.mark(kept, step=1, armed=True, first=first)
    saved = count.ledger.saved_by_node()
    without = take_census([("kept", kept)], excluded=weights, saved=saved)
    assert without.unattributed > 0  # the hidden node's storages: no node of the walk has them
    census = take_census([("kept", kept)], excluded=weights, saved=saved, calls=held.calls())
    holding = census.holdings["kept"]
    expected = {k: v for k, v in count.storages.items() if k not in holding.storages}
    assert holding.graph_storages == expected and census.unattributed == 0


def test_a_graph_built_while_the_hooks_were_off_is_named_with_its_bytes_not_known() -> None:
    """No record of what it saved exists: the holder says so instead of a figure without it."""
    model = _model()
    held = HeldGraphs()
    first = next_sequence_number()
    kept = model(torch.randn(4, 16))  # no pack hook at all: carried, unarmed
    held.mark(kept, step=1, armed=False, first=first)
    census = take_census([("kept", kept)], excluded=_weights(model), calls=held.calls())
    holding = census.holdings["kept"]
    assert holding.unknown_graphs == 1 and holding.kind is LeakKind.RETAINED_GRAPH
    assert holding.graph_storages == {} and holding.storages == _keys(kept)


def test_a_module_cache_and_a_hook_closure_are_named_by_where_the_user_wrote_them() -> None:
    model = _model()
    cache: dict[int, torch.Tensor] = {}
    model.cache = cache  # type: ignore[assignment]  # a Module attribute that is neither
    for step in range(3):
        cache[step] = torch.randn(64)
    outputs: list[torch.Tensor] = []

    def make_hook() -> Any:
        def store(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            outputs.append(output.detach())

        return store

    model[0].register_forward_hook(make_hook())
    with torch.no_grad():
        model(torch.randn(2, 16))
        model(torch.randn(2, 16))
    census = take_census([("model", model)], excluded=_weights(model))
    assert set(census.holdings) == {
        "model.cache",
        "outputs (closure of test_a_module_cache_and_a_hook_closure_are_named_by_where_the_"
        "user_wrote_them.<locals>.make_hook.<locals>.store)",
    }
    assert census.holdings["model.cache"].bytes == 3 * 64 * 4
    assert census.holdings["model.cache"].tensors == 3
    hooked = next(h for name, h in census.holdings.items() if name.startswith("outputs"))
    assert hooked.bytes == 2 * 2 * 32 * 4


def test_piles_and_shared_storages_are_counted_once_and_a_deque_is_bounded() -> None:
    model = _model()
    base = torch.randn(100)
    recent: deque[torch.Tensor] = deque(maxlen=4)
    recent.extend([base[:10], base[10:20]])  # two views of one storage
    weights = _weights(model)
    census = take_census(
        [("recent", recent), ("again", [base]), ("model", model)], excluded=weights
    )
    assert census.holdings["recent"].bytes == 400
    assert census.holdings["recent"].bounded == 4
    assert "again" not in census.holdings  # the same storage, already filed
    assert not any(key in weights for h in census.holdings.values() for key in h.storages)


def test_the_walk_is_bounded_and_says_so() -> None:
    big = [[torch.randn(1)] for _ in range(1000)]
    census = take_census([("big", big)], max_objects=50)
    assert not census.complete and census.stopped is CensusStop.OBJECTS
    assert census.visited <= 50
    assert sum(h.tensors for h in census.holdings.values()) < 1000
    whole = take_census([("big", big)])
    assert whole.holdings["big"].tensors == 1000 and whole.stopped is None and whole.complete


def _reachable(*tensors: torch.Tensor) -> list[Any]:
    """The test's own walk of the autograd nodes reachable from `tensors` (`next_functions`),
    the parameters' `AccumulateGrad` nodes aside."""
    seen: dict[int, Any] = {}
    pending = [t.grad_fn for t in tensors]
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        pending.extend(edge[0] for edge in node.next_functions)
    return [node for node in seen.values() if type(node).__name__ != "AccumulateGrad"]


def _accumulate(model: nn.Module, total: Any, steps: int) -> Any:
    """`total_loss += loss` after backward, `steps` times."""
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).square().mean()
        loss.backward()
        total += loss
    return total


def test_a_loss_total_after_backward_counts_every_steps_nodes_and_a_value_derived_its_own() -> None:
    """Backward freed what the graphs saved; what `total_loss` keeps is its chain of nodes, all
    of them filed under it even when a value derived from it (`avg`) is found first; a value
    derived from its current root stops there (`latest`)."""
    model = _model()
    count = SavedCount(_weights(model))
    with count.hooks():
        total_loss = _accumulate(model, 0.0, 3)
        avg = total_loss / 3
        total_loss = _accumulate(model, total_loss, 2)
        latest = total_loss * 2
    census = take_census(
        [("avg", avg), ("latest", latest), ("total_loss", total_loss), ("model", model)],
        excluded=_weights(model),
        saved=count.ledger.saved_by_node(),
    )
    holding = census.holdings["total_loss"]
    assert holding.kind is LeakKind.TENSORS and holding.graph_storages == {}
    assert holding.nodes == len(_reachable(total_loss)) > 5 * 7
    assert census.holdings["avg"].nodes == 1  # its own node: what lies beneath is the total's
    assert census.holdings["latest"].nodes == 1
    assert holding.roots == (total_loss.grad_fn._sequence_nr(),)


def test_a_census_following_an_earlier_one_says_which_roots_live_on_beneath_their_holder() -> None:
    """An accumulating total's old root is still reached from it; a value recomputed since
    (`avg`) lost its old root, though the total's chain reaches what that root reached."""
    model = _model()
    total_loss = _accumulate(model, 0.0, 2)
    avg = total_loss / 2
    before = take_census([("total_loss", total_loss), ("avg", avg)])
    follow = {root: h.holder for h in before.holdings.values() for root in h.roots}
    old_total, old_avg = before.holdings["total_loss"].roots, before.holdings["avg"].roots
    total_loss = _accumulate(model, total_loss, 2)
    avg = total_loss / 4
    after = take_census([("total_loss", total_loss), ("avg", avg)], follow=follow)
    assert set(old_total) <= after.alive and not set(old_avg) & after.alive
    assert after.holdings["total_loss"].nodes > before.holdings["total_loss"].nodes
