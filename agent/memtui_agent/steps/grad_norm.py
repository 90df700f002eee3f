"""The global gradient norm, read in the health check's pass over the gradients.

One tensor per (device, dtype) group: the L2 norm of its gradients, accumulated in float32 (in
float64 for float64 gradients), as `torch.nn.utils.clip_grad_norm_` computes it. A NaN or Inf
element makes the norm NaN or Inf, so a finite norm proves every element finite: on the host
the exact finiteness check (`_amp_foreach_non_finite_check_and_unscale_`) runs only for a group
whose norm is not finite (a finite gradient whose squares overflow float32, above about 1e19,
still reads finite there). On a device both stay (a branch on the norm would wait for it).

How the norm is taken is chosen by cost (docs/numbers.md#divergence): `torch._foreach_norm`
is one fused kernel on a GPU but one reduction per tensor on a CPU, about 1.4 us each (800
small tensors: 1.1 ms against the finiteness check's 0.19 ms), so on a CPU a group of small
tensors is copied into one buffer per `CHUNK` tensors and reduced once (0.33 ms for the 800).
"""

from __future__ import annotations

import torch

SMALL = 4096
"""A CPU group whose tensors hold fewer elements than this on average is flattened."""
CHUNK = 256
"""Tensors flattened into one buffer at a time: with `SMALL`, at most 4 MiB of float32 held
for the copy (bounded memory, whatever the number of gradients)."""

_flatten = torch._C._nn.flatten_dense_tensors


def group_norm(members: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The L2 norm of `members` (one device, one dtype) as a 0-dim tensor on `device`, with no
    host sync; NaN or Inf when some element is."""
    dtype = torch.float64 if members[0].dtype is torch.float64 else torch.float32
    # Gradients of a double backward require grad: record no graph. Not `with torch.no_grad()`:
    # a Ctrl-C landing inside its Python `__enter__`, after grad mode went off, raises before
    # the `with` can undo it, and the job trained on with grad mode off ("element 0 of tensors
    # does not require grad" at its next backward; 1 of 200 SIGINTs in a CI run). Here grad
    # mode changes inside the `try`, and the `finally` restores it whatever is raised.
    previous = torch.is_grad_enabled()
    try:
        torch._C._set_grad_enabled(False)
        if device.type == "cpu" and sum(map(torch.Tensor.numel, members)) < SMALL * len(members):
            norms = [
                torch.linalg.vector_norm(_flatten(members[start : start + CHUNK]), dtype=dtype)
                for start in range(0, len(members), CHUNK)
            ]
        else:
            norms = list(torch._foreach_norm(members, 2, dtype=dtype))
        total: torch.Tensor = (
            norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
        )
    finally:
        torch._C._set_grad_enabled(previous)
    return total
