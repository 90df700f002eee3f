"""Graphs that outlive their step are seen exactly, whether or not the hooks were armed."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from memtui_agent.hooks.saved_tensors import SavedOne, UnhookedSaves, unpack
from memtui_agent.memory.ledger import NO_MODULE, NODE_SHIFT, Ledger, plain_storage
from memtui_agent.memory.tensor_reads import next_sequence_number
from memtui_agent.steps.held_graphs import HeldGraphs


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def test_a_backpropagated_graph_is_not_held_and_an_accumulated_total_is() -> None:
    model, watch = _model(), HeldGraphs()
    out = model(torch.randn(4, 8))
    watch.mark(out, step=1, armed=False)
    out.sum().backward()
    assert watch.held().graphs == 0
    total: Any = 0.0
    for step in (2, 3):
        out = model(torch.randn(4, 8))
        watch.mark(out, step=step, armed=step == 3)
        total += out.sum()  # validation without no_grad: the graph stays
    held = watch.held()
    assert (held.graphs, held.unarmed, held.oldest_step) == (2, 1, 2)
    del out, total
    assert watch.held().graphs == 0


def test_retain_graph_keeps_buffers_and_a_model_output_dict_is_marked() -> None:
    model, watch = _model(), HeldGraphs()
    out = model(torch.randn(4, 8))
    aux = out * 2
    watch.mark({"logits": out, "aux": [aux]}, step=1, armed=True)
    watch.retaining = True
    out.sum().backward(retain_graph=True)
    watch.retaining = False
    # Both nodes keep their buffers: one ran with retain_graph, the other never ran.
    assert watch.held().graphs == 2
    del aux
    assert watch.held().graphs == 1
    del out
    assert watch.held().graphs == 0


def test_a_graph_crossing_into_the_next_step_is_held_until_its_backward() -> None:
    """A GAN whose critic graph is built in one step and backpropagated in the next."""
    critic, watch = _model(), HeldGraphs()
    pending = critic(torch.randn(4, 8))
    watch.mark(pending, step=1, armed=False)
    assert watch.held().graphs == 1  # at step 1's close
    pending.mean().backward()
    fresh = critic(torch.randn(4, 8))
    watch.mark(fresh, step=2, armed=False)
    held = watch.held()
    assert (held.graphs, held.oldest_step) == (1, 2)
    # What the census is told: the held graph's output node, and that no pack hook saw it.
    (call,) = watch.calls().values()
    assert not call.armed and call.first <= call.last


def test_outputs_are_found_without_running_any_code_of_theirs() -> None:
    """A sequence or mapping subclass of the job's is read through the builtin's own methods."""

    class Loud(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            raise AssertionError("iterated")

        def __getitem__(self, index: Any) -> Any:
            raise AssertionError("indexed")

    class Outputs(dict):  # type: ignore[type-arg]
        def values(self) -> Any:
            raise AssertionError("values")

    model, watch = _model(), HeldGraphs()
    out = model(torch.randn(4, 8))
    watch.mark(Outputs(logits=Loud([out])), step=1, armed=True)
    assert watch.held().graphs == 1


def _fp32_outputs(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """What accelerate's `convert_outputs_to_fp32` makes of a bf16 model that computes its own
    loss: the bf16 logits copied to fp32 after the forward, a copy the loss never used."""
    logits = model(x).bfloat16()
    loss = nn.functional.cross_entropy(logits.float(), y)
    outputs = {"loss": loss, "logits": logits}
    return {
        name: value.float() if value.dtype is torch.bfloat16 else value
        for name, value in outputs.items()
    }


def test_an_output_backward_never_reaches_is_not_a_held_graph() -> None:
    """The fp32 copy's node is never run by backward, but it saves nothing: the graph behind it
    is the loss's, which backward freed. Marked at its node, it looked held at every close."""
    model, watch = _model(), HeldGraphs()
    for step in (1, 2):
        first = torch._C._autograd._get_sequence_nr()
        outputs = _fp32_outputs(model, torch.randn(4, 8), torch.randint(0, 2, (4,)))
        watch.mark(outputs, step=step, armed=step == 2, first=first)
        outputs["loss"].backward()
        assert watch.held().graphs == 0  # `outputs` (the fp32 logits) is still alive here
        assert watch.calls() == {}


def test_an_unreached_output_that_saved_tensors_is_still_held() -> None:
    """An output whose own branch saved tensors (a sigmoid of the features, never in the loss)
    keeps them after backward: that graph is held."""
    model, watch = _model(), HeldGraphs()
    first = torch._C._autograd._get_sequence_nr()
    features = model(torch.randn(4, 8))
    outputs = (features.sum(), torch.sigmoid(features).float())
    watch.mark(outputs, step=1, armed=True, first=first)
    outputs[0].backward()
    assert watch.held().graphs == 1
    del outputs
    assert watch.held().graphs == 0


def test_a_copy_of_an_earlier_graph_is_not_this_calls_graph() -> None:
    """A call that only converts a tensor another call made (its node numbered before the call)
    built no graph that saves anything."""
    model, watch = _model(), HeldGraphs()
    features = model(torch.randn(4, 8))
    first = torch._C._autograd._get_sequence_nr()
    copy = features.bfloat16().float()
    watch.mark(copy, step=1, armed=False, first=first)
    assert watch.held().graphs == 0
    del copy


class _Scaled(nn.Module):
    """Attention's shape of scaling: Python numbers in the graph (`/ math.sqrt(d)`, `* 0.5`),
    which autograd saves as 0-dim float64 tensors without calling any saved-tensor hook."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = (self.q(x) @ self.k(x).transpose(-1, -2)) / math.sqrt(8)
        out: torch.Tensor = (scores.softmax(-1) * 0.5).sum()
        return out


def _counted(ledger: Ledger) -> Any:
    """The agent's pack hook in small: each saved tensor an activation, its node recorded."""

    def pack(tensor: torch.Tensor) -> SavedOne:
        found = plain_storage(tensor)
        assert found is not None
        key, nbytes, name, _storage = found
        ledger.acquire_activation(key, nbytes, name, NO_MODULE)
        one = SavedOne(tensor.detach(), key, ledger, tensor._version)
        ledger.saved_nodes[id(one)] = (next_sequence_number() << NODE_SHIFT) | key
        return one

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _saved_bytes(total: torch.Tensor, model: nn.Module) -> int:
    """The job's own count: every storage the kept graph saved, parameters aside."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    pending, visited = [total.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_") and isinstance(
                value := getattr(node, name), torch.Tensor
            ):
                storage = value.untyped_storage()
                if storage.data_ptr() not in weights:
                    seen[storage.data_ptr()] = storage.nbytes()
        pending.extend(edge[0] for edge in node.next_functions)
    return sum(seen.values())


@pytest.mark.parametrize("adopting", [True, False])
def test_a_kept_graph_is_in_the_activations_pile_to_the_byte(adopting: bool) -> None:
    """A validation total kept without no_grad: with the numbers adopted, the pile is the
    graph's own count (it was 16 B short per graph without); released with the graph; and the
    gradients through adopted numbers are bit for bit those of a run without any hook."""
    model, watch, ledger = _Scaled(), HeldGraphs(), Ledger()
    unhooked = UnhookedSaves(ledger, NO_MODULE)
    total: Any = 0.0
    with _counted(ledger):
        for step in (1, 2, 3):
            first = next_sequence_number()
            loss = model(torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(step)))
            watch.mark(loss, step, True, first, unhooked if adopting else None)
            total = total + loss
    truth = _saved_bytes(total, model)
    counted = ledger.current().activations
    assert counted == truth if adopting else counted == truth - 3 * 16
    total.backward()
    assert ledger.current().activations == 0
    assert watch.held().graphs == 0
    with_hooks = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    plain: Any = 0.0
    for step in (1, 2, 3):
        plain = plain + model(torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(step)))
    plain.backward()
    theirs = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(theirs) == len(with_hooks) == 4
    for mine, their in zip(with_hooks, theirs, strict=True):
        assert torch.equal(mine, their)


def test_values_with_hooks_are_never_asked_again() -> None:
    """Only nodes whose saves the pack hook never saw are asked: a graph of plain layers asks
    nothing (trying a value that has hooks costs an error inside torch)."""
    model, watch, ledger = _model(), HeldGraphs(), Ledger()
    asked: list[object] = []

    class Counting(UnhookedSaves):
        def adopt(self, saved: object) -> bool:
            asked.append(saved)
            return super().adopt(saved)

    with _counted(ledger):
        first = next_sequence_number()
        out = model(torch.randn(4, 8))
        watch.mark(out, 1, True, first, Counting(ledger, NO_MODULE))
    assert asked == []
    del out
