"""The agent turns grad mode off for its own reads of the gradients (`steps.grad_norm`) and
must turn it back on whatever is raised there: a Ctrl-C landing inside left a job training on
with grad mode off ("element 0 of tensors does not require grad" at its next backward). Checked
here with the interrupt raised from inside the norm's ops; the narrower window that bug came
through (a signal inside `torch.no_grad()`'s own `__enter__`, which the code no longer uses) has
no deterministic test."""

from __future__ import annotations

import pytest
import torch

from memtui_agent.steps import grad_norm


@pytest.mark.parametrize("numel", [16, 100_000], ids=["small: flattened", "large: foreach"])
def test_a_keyboard_interrupt_inside_the_norm_leaves_grad_mode_as_it_was(
    monkeypatch: pytest.MonkeyPatch, numel: int
) -> None:
    members = [torch.ones(numel), torch.ones(numel)]

    def interrupted(*args: object, **kwargs: object) -> torch.Tensor:
        assert not torch.is_grad_enabled()  # inside the agent's grad-mode change
        raise KeyboardInterrupt

    monkeypatch.setattr(grad_norm, "_flatten", interrupted)
    monkeypatch.setattr(torch, "_foreach_norm", interrupted)
    assert torch.is_grad_enabled()
    with pytest.raises(KeyboardInterrupt):
        grad_norm.group_norm(members, torch.device("cpu"))
    assert torch.is_grad_enabled()


def test_the_norm_records_no_graph_and_restores_grad_mode() -> None:
    members = [torch.ones(8, requires_grad=True) * 2, torch.ones(8, requires_grad=True) * 3]
    norm = grad_norm.group_norm(members, torch.device("cpu"))
    assert norm.grad_fn is None
    assert torch.is_grad_enabled()
    assert norm.item() == pytest.approx((8 * 4 + 8 * 9) ** 0.5)
