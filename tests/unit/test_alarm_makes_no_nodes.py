"""The NaN alarm's own reads make no autograd node in the job.

On an alarm the agent asks which weights are non-finite. `torch.isfinite` of a parameter that
requires grad takes an autograd sequence number, which the repeat proof counts as a node the
job made: the step of the NaN then "recorded 15 nodes here (9, 6 before and after each
backward)" against 9 and raised a false `activations_vary` note on every NaN run.
"""

from __future__ import annotations

import torch

from memtui_agent.steps.health import HealthMonitor


def _sequence_number() -> int:
    """The autograd sequence number the next node would take, read through a node of our own."""
    node = torch.ones(1, requires_grad=True).clone().grad_fn
    assert node is not None
    return int(node._sequence_nr())


def test_naming_non_finite_weights_makes_no_autograd_node() -> None:
    first = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(first, torch.nn.Linear(4, 1))
    with torch.no_grad():
        first.weight[0, 0] = float("nan")
    named = list(model.named_parameters())
    before = _sequence_number()
    bad = HealthMonitor._nonfinite_names(named)
    after = _sequence_number()
    assert bad == ["0.weight"]
    assert after - before == 1  # only the probe's own clone between the two reads
