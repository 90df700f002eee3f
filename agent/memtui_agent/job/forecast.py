"""Forecast the optimizer state the first `step()` will allocate, before it does.

The failure mode this forecasts (docs/health.md): the forward fits, then `optimizer.step()` dies
of out-of-memory because it allocates the moments for the first time. Optimizers create state
lazily, per parameter that has a gradient, with tensors shaped like the parameter in its dtype,
plus a float32 step counter.
The table below is the per-parameter layout of torch.optim's state (checked against torch 2.13);
an optimizer it does not know gets no forecast rather than a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memtui_agent.memory.ledger import local_tensor
from memtui_protocol.units import format_bytes

if TYPE_CHECKING:  # for annotations only
    import torch

STEP_BYTES = 4
"""`state["step"]` is a float32 scalar tensor in torch.optim (its own storage)."""


@dataclass(frozen=True)
class Forecast:
    """Bytes of state an optimizer's first `step()` will allocate.

    `exact` is False where the state depends on the data: LBFGS keeps one pair of flat
    vectors per iteration that improved the objective, up to its history, so only a bound is
    known (`bytes` is then the most it can allocate).
    """

    bytes: int
    exact: bool = True

    def describe(self) -> str:
        """`1.00 MiB (1,048,576 bytes)`, with `at most` for a bound."""
        text = f"{format_bytes(self.bytes)} ({self.bytes:,} bytes)"
        return text if self.exact else f"at most {text}"

    def matches(self, grown: int) -> bool:
        """Whether `grown` bytes is what was forecast (within the bound for a bound)."""
        return grown == self.bytes if self.exact else 0 <= grown <= self.bytes


def _full(parameter: torch.Tensor) -> int:
    return parameter.numel() * parameter.element_size()


def _adafactor(parameter: torch.Tensor, group: dict[str, Any]) -> int:
    """Factored second moments: one row and one column vector per matrix, full for vectors."""
    size = parameter.element_size()
    if parameter.dim() < 2:
        return _full(parameter) + STEP_BYTES
    shape = tuple(parameter.shape)
    leading = 1
    for extent in shape[:-2]:
        leading *= extent
    return leading * (shape[-2] + shape[-1]) * size + STEP_BYTES


def per_parameter_bytes(
    optimizer: torch.optim.Optimizer, parameter: torch.Tensor, group: dict[str, Any]
) -> int | None:
    """Bytes of state one parameter will get, or None for an optimizer we cannot forecast."""
    name = type(optimizer).__name__
    parameter = local_tensor(parameter)  # state is shaped like this rank's shard (FSDP, TP)
    full = _full(parameter)
    if name in ("Adam", "AdamW"):
        extra = full if group.get("amsgrad") else 0
        return 2 * full + extra + STEP_BYTES
    if name in ("Adamax", "RAdam", "Adadelta"):
        return 2 * full + STEP_BYTES
    if name == "NAdam":
        return 2 * full + 2 * STEP_BYTES
    if name == "SGD":
        return full if group.get("momentum", 0) else 0
    if name == "RMSprop":
        extra = (full if group.get("momentum", 0) else 0) + (full if group.get("centered") else 0)
        return full + extra + STEP_BYTES
    if name == "Adagrad":
        return full + STEP_BYTES
    if name == "Adafactor":
        return _adafactor(parameter, group)
    if name == "ASGD":
        return full + 3 * STEP_BYTES
    if name == "Rprop":
        return 2 * full + STEP_BYTES
    return None


def _lbfgs(optimizer: torch.optim.Optimizer) -> Forecast | None:
    """LBFGS (one state for all parameters, in torch 2.x's layout): the flat direction `d` and
    `prev_flat_grad`, and per iteration that updates the history one flat `y` and `s` and two
    scalars (`ro`, `al`), plus the scalar `H_diag`; at most `min(max_iter - 1, history_size)`
    such iterations in the first step. Flat vectors have the gradients' dtype."""
    if len(optimizer.param_groups) != 1:
        return None
    group = optimizer.param_groups[0]
    parameters = group["params"]
    if not parameters or optimizer.state.get(parameters[0]):
        return None  # nothing to step, or state already there (a resumed run): no forecast
    # The flat gradient covers every parameter (zeros where a gradient is missing).
    size = parameters[0].element_size()
    flat = sum(p.numel() for p in parameters) * size
    history = max(0, min(int(group["max_iter"]) - 1, int(group["history_size"])))
    return Forecast(flat * (2 + 2 * history) + size * (1 + 2 * history), exact=False)


def forecast_first_step(optimizer: torch.optim.Optimizer, closure: bool = False) -> Forecast | None:
    """State bytes the optimizer will hold after its first step, counting only parameters that
    have a gradient now (the ones the step will initialise). None if the type is unknown.

    With a `closure` (Lightning, LBFGS) the gradients appear inside `step()`, after this runs:
    every parameter that requires a gradient is counted, the parameters the closure's backward
    reaches in a usual training step. Parameters that already have state (a loaded checkpoint)
    add nothing.
    """
    if type(optimizer).__name__ == "LBFGS":
        return _lbfgs(optimizer)
    total = 0
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if id(parameter) in seen:
                continue
            if parameter.grad is None and not (closure and parameter.requires_grad):
                continue
            seen.add(id(parameter))
            if optimizer.state.get(parameter):
                continue
            size = per_parameter_bytes(optimizer, parameter, group)
            if size is None:
                return None
            total += size
    return Forecast(total)
