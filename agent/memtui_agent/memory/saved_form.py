"""What the agent's saved-tensor wrappers keep of a saved tensor (`hooks.saved_tensors`), and the
calibration of their heap cost keeps alike (`steps.hook_share`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for annotations only
    import torch


def held_form(tensor: torch.Tensor, node: int) -> torch.Tensor:
    """What a wrapper keeps of a saved `tensor`, for the node numbered `node` being built.

    The node's own output (its `grad_fn` is that node, as for `exp`, or an in-place op's
    result) is kept as `tensor.detach()`: the tensor itself would close a reference cycle
    through the graph (output -> node -> wrapper -> output) and the wrapper would never be
    freed. Any other tensor is kept as it is, as autograd keeps it without hooks: its history
    is older than the node, so no cycle, and no tensor is made per saved tensor. That keeps
    the heap of a measured step as it would be without the agent but for the hook objects
    (`steps.hook_share`): a detached alias per saved input was about 240 bytes each, and
    whether autograd alone would have kept the original whole depended on what the job
    dropped. The alias and the tensor share one version counter, so unpacking makes the
    check autograd skips under saved-tensor hooks either way (`unpack`). Autograd rebuilds
    the unpacked tensor's history from its own records, so what is kept changes no gradient.
    """
    function = tensor.grad_fn
    if function is not None and function._sequence_nr() == node:
        return tensor.detach()
    return tensor
