"""What each repeated block of a model saves, holds as input and costs: `--budget`'s input.

`memtui estimate --budget` plans which blocks to wrap in activation checkpointing. The plan is
chosen greedily from this profile and then measured by the agent's own ledger (a fake step with
exactly those blocks wrapped, `wrap_modules`), so the profile only has to rank the blocks: it is
one forward and backward on fake tensors, outside the agent's hooks, that records per block of
the model's largest `nn.ModuleList`/`nn.Sequential` (`repeated_blocks`):

- `saved`: the bytes of distinct storages autograd saves while the block's forward runs
  (parameters and their views excluded: they are weights, not activations);
- `kept`: the bytes of the block's tensor inputs, which a checkpoint keeps instead;
- `forward_flops`: the block's forward FLOPs as torch's `FlopCounterMode` counts them
  (matrix products, convolutions, attention; elementwise ops count 0), beside the whole step's
  forward and backward FLOPs: the recomputation's share of the step.

torch is imported lazily (this module runs only in the estimate's child).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from memtui_protocol.estimate import Autocast, FakeStepRequest, Variant

if TYPE_CHECKING:  # annotations only
    import torch


@dataclass
class BlockFigures:
    """One repeated block, by its qualified name."""

    name: str
    saved: int
    kept: int
    forward_flops: int


@dataclass
class BlockProfile:
    """The blocks in forward order, and the step's FLOPs (forward and backward)."""

    container: str
    blocks: list[BlockFigures]
    step_flops: int


def _flops(counter: Any) -> int:
    return int(counter.get_total_flops())


def profile_blocks(
    model: torch.nn.Module, forward_loss: Callable[[], Any], autocast: Any
) -> BlockProfile | None:
    """One forward and backward of `model` (fake tensors: the caller's mode) with each
    block's saved bytes, inputs and FLOPs; None when the model has no repeated blocks.

    `forward_loss()` runs the forward on the batch and returns the loss, as the training
    steps do (`forward_and_loss`); `autocast` is a context manager for the forward.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from memtui_agent.job.blocks import repeated_blocks, repeated_container

    container = repeated_container(model)
    if container is None:
        return None
    prefix = {id(module): name for name, module in model.named_modules()}
    blocks = repeated_blocks(model)
    figures = {id(block): BlockFigures(prefix[id(block)], 0, 0, 0) for block in blocks}
    weights = {p.untyped_storage()._cdata for p in model.parameters()}
    current: list[int] = []
    seen: dict[int, set[int]] = {key: set() for key in figures}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if current:
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key not in weights and key not in seen[current[-1]]:
                seen[current[-1]].add(key)
                figures[current[-1]].saved += storage.nbytes()
        return tensor

    def enter(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not current:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            figures[id(module)].kept = sum(t.untyped_storage().nbytes() for t in tensors)
        current.append(id(module))
        counter = FlopCounterMode(display=False)
        counter.__enter__()
        counters.append(counter)

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        current.pop()
        counter = counters.pop()
        counter.__exit__(None, None, None)
        figures[id(module)].forward_flops += _flops(counter)

    counters: list[Any] = []
    with contextlib.ExitStack() as undo:
        for block in blocks:
            undo.callback(block.register_forward_pre_hook(enter, with_kwargs=True).remove)
            undo.callback(block.register_forward_hook(leave).remove)
        step = FlopCounterMode(display=False)
        with step, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with autocast:
                loss = forward_loss()
            loss.backward()
    return BlockProfile(
        prefix[id(container)], [figures[id(block)] for block in blocks], _flops(step)
    )


def profile_request(request: FakeStepRequest) -> dict[str, Any]:
    """The request's model and batch built afresh under their own `FakeTensorMode` and
    profiled (`profile_blocks`): the `Variant.BLOCKS` entry of the child's answer, with an
    `error` when the model has no repeated blocks."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memtui_agent.estimate.count_params import one_line, resolve
    from memtui_agent.estimate.fake_step import _batch_of, _call, forward_and_loss

    variant = Variant.BLOCKS.value
    dtype = {Autocast.BF16: torch.bfloat16, Autocast.FP16: torch.float16}.get(request.autocast)  # type: ignore[arg-type]
    build_model, build_batch = resolve(request.model, "--model"), resolve(request.batch, "--batch")
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = _call(build_model, request.model)
            model.train()
            batch = _batch_of(request.batch, _call(build_batch, request.batch))
            cast = (
                torch.autocast("cpu", dtype=dtype)
                if dtype is not None
                else contextlib.nullcontext()
            )
            loss_fn = None if request.loss is None else resolve(request.loss, "--loss")
            profile = profile_blocks(
                model,
                lambda: forward_and_loss(
                    model, batch, request.model, loss_fn, request.loss or "--loss"
                )[0],
                cast,
            )
    except Exception as exc:  # the step itself ran: a profile that fails only costs the plan
        return {"variant": variant, "error": f"the blocks could not be profiled: {one_line(exc)}"}
    if profile is None:
        return {
            "variant": variant,
            "error": "the model has no repeated blocks (an nn.ModuleList or nn.Sequential) "
            "to checkpoint",
        }
    return {"variant": variant, **asdict(profile)}


def checkpoint_named(model: torch.nn.Module, names: list[str]) -> None:
    """Each named module's forward through `checkpoint(use_reentrant=True)`: the reentrant
    variant recomputes under the agent's hooks, so the measured step counts what the
    recomputation holds (the non-reentrant variant, which users are told to use, holds the
    same tensors but hides them from the hooks). A module whose tensor inputs need no
    gradient runs unwrapped (a reentrant checkpoint would cut its parameters' gradients).

    Raises:
        FakeStepError: a name the model does not have.
    """
    from memtui_agent.estimate.fake_step import FakeStepError, checkpoint_forward

    modules = dict(model.named_modules())
    for name in names:
        module = modules.get(name)
        if module is None:
            raise FakeStepError(f"the model has no module named {name!r} to checkpoint")
        checkpoint_forward(module)
