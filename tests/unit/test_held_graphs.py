"""Graphs that outlive their step are seen exactly, whether or not the hooks were armed."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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
    return {name: value.float() if value.dtype is torch.bfloat16 else value
            for name, value in outputs.items()}


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
