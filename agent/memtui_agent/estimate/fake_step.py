"""Two training steps on fake tensors, measured by the agent itself: `memtui estimate --batch`.

`python -m memtui_agent.estimate.fake_step REQUEST_JSON` builds the user's model and batch under
torch's `FakeTensorMode` (shapes, dtypes, strides and aliasing, no data), then runs the loop a job
runs, `zero_grad`, forward, loss, backward, `optimizer.step()`, twice: the first step allocates the
optimizer state, the second is the steady state. Nothing in it is an estimator of its own: the real
`Tracker` installs its real hooks and feeds the real `Ledger`, which closes the two steps exactly
as in a training job, so the estimate and a later `memtui run` of the same model count the same
storages by the same rules. The one switch is `ledger.count_fake_storages`: fake storages have data
pointer 0 (they are meta storages), so the ledger keys them by their StorageImpl instead; real jobs
never turn it on.

Prints one JSON line, a `FakeStepResult` per requested run; on failure one line on stderr and
exit 2, which `memtui` shows as its own error. torch is imported only in the child: this module
imports it lazily; its request and result types are in `memtui_protocol.estimate`.

Known limitations:
    - Tensors are fake CPU tensors: autocast and kernels are the CPU's. Attention through
      `scaled_dot_product_attention` takes CPU's flash kernel where CUDA takes its own; both
      save the output and a log-sum-exp, not the attention matrix.
    - A model that reads tensor values in Python (`.item()`, data-dependent shapes such as
      `nonzero`) or calls an op with no fake implementation cannot run; the error names the op.
    - `--checkpointing` wraps each block of the model's largest `nn.ModuleList`/`nn.Sequential`
      in `checkpoint(use_reentrant=True)` (or calls a Hugging Face model's
      `gradient_checkpointing_enable` with that variant): that variant recomputes each region
      under the agent's own hooks during backward, so what the recomputation holds is counted.
      A block whose tensor inputs need no gradient (the first layers on raw inputs) runs
      unwrapped, because a reentrant checkpoint would cut its parameters' gradients, and so
      does a block with no parameters (ReLU, pooling, dropout: nothing to gain, and in-place
      ones break under a reentrant checkpoint).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from memtui_agent.estimate.block_profile import checkpoint_named, profile_request
from memtui_agent.estimate.count_params import CountError, one_line, resolve
from memtui_agent.job.blocks import repeated_blocks
from memtui_protocol.estimate import (
    EXIT_FAILED,
    Autocast,
    FakeStepRequest,
    FakeStepResult,
    OptimizerKind,
    StepFigures,
    Variant,
    with_what_if,
)
from memtui_protocol.schema import PILES

if TYPE_CHECKING:  # for annotations only: torch is imported where the step runs
    import torch

_OPTIMIZERS: dict[OptimizerKind, tuple[str, dict[str, Any]]] = {
    OptimizerKind.SGD: ("SGD", {"lr": 1e-3}),
    OptimizerKind.MOMENTUM: ("SGD", {"lr": 1e-3, "momentum": 0.9}),
    OptimizerKind.ADAM: ("Adam", {}),
    OptimizerKind.ADAMW: ("AdamW", {}),
    OptimizerKind.ADAFACTOR: ("Adafactor", {}),
    OptimizerKind.RMSPROP: ("RMSprop", {}),
    OptimizerKind.ADAGRAD: ("Adagrad", {}),
    OptimizerKind.NADAM: ("NAdam", {}),
    OptimizerKind.RADAM: ("RAdam", {}),
    OptimizerKind.ADAMAX: ("Adamax", {}),
}


class FakeStepError(Exception):
    """A failure the user can act on, already phrased as one sentence."""


def _fake_failure(spec: str, exc: BaseException) -> FakeStepError | None:
    """The one-line reason a model cannot run on fake tensors, naming the op; None if `exc`
    is not a fake-tensor limitation."""
    from torch._subclasses import fake_tensor

    func = getattr(exc, "func", None)
    if isinstance(exc, fake_tensor.UnsupportedOperatorException):
        why = "has no fake-tensor implementation"
    elif isinstance(exc, fake_tensor.DataDependentOutputException):
        why = "reads tensor values (e.g. .item()), which fake tensors do not have"
    elif isinstance(exc, fake_tensor.DynamicOutputShapeException):
        why = "has an output shape that depends on tensor values"
    else:
        return None
    return FakeStepError(f"{spec} cannot run on fake tensors: {func} {why}")


def _loss_of(output: Any, spec: str) -> tuple[Any, str | None]:
    """The loss in what the forward returned, and where it was (None: the output itself).

    A one-element tensor is the loss; else the output's `.loss` (Hugging Face outputs) or
    `["loss"]`; else the one scalar tensor that requires grad among the elements of a tuple,
    list or dict (nanoGPT's `(logits, loss)`). None or several such scalars: refused, naming
    what was found, since guessing could measure the backward of the wrong value.
    """
    import torch

    if isinstance(output, torch.Tensor):
        if output.numel() == 1:
            return output, None
        shape = tuple(output.shape)
        raise FakeStepError(
            f"{spec}'s forward returned a tensor of shape {shape}, not a scalar loss: "
            "return the loss, or an output with a .loss"
        )
    named = getattr(output, "loss", None)
    where = ".loss"
    if named is None and isinstance(output, Mapping):
        named, where = output.get("loss"), "['loss']"
    if isinstance(named, torch.Tensor) and named.numel() == 1:
        return named, where
    if isinstance(output, (tuple, list)):
        items = [(f"[{index}]", item) for index, item in enumerate(output)]
    elif isinstance(output, Mapping):
        items = [(f"[{key!r}]", item) for key, item in output.items()]
    else:
        raise FakeStepError(
            f"{spec}'s forward returned {type(output).__name__} with no scalar .loss: "
            "return the loss, or an output with a .loss (give the batch its labels)"
        )
    scalars = [
        (place, item)
        for place, item in items
        if isinstance(item, torch.Tensor) and item.numel() == 1 and item.requires_grad
    ]
    kind = type(output).__name__
    if len(scalars) == 1:
        return scalars[0][1], scalars[0][0]
    if not scalars:
        raise FakeStepError(
            f"{spec}'s forward returned a {kind} of {len(items)} with no scalar tensor that "
            "requires grad: return the loss, or give the batch its labels (targets)"
        )
    places = ", ".join(f"output{place}" for place, _ in scalars)
    raise FakeStepError(
        f"{spec}'s forward returned a {kind} with {len(scalars)} scalar tensors that require "
        f"grad ({places}): return the loss alone, or as .loss"
    )


def _batch_of(spec: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise FakeStepError(
            f"{spec} returned {type(value).__name__}, not a dict of the forward's keyword arguments"
        )
    return dict(value)


def batch_size(batch: Mapping[str, Any]) -> int | None:
    """Dim 0 of the first tensor in the batch: the batch dimension, by convention."""
    import torch

    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


def double_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Every tensor with a dim 0 concatenated with itself: the same samples, twice as many."""
    import torch

    return {
        key: torch.cat([value, value]) if isinstance(value, torch.Tensor) and value.dim() else value
        for key, value in batch.items()
    }


def apply_checkpointing(model: torch.nn.Module) -> None:
    """Activation checkpointing as the estimate assumes it (module docstring: reentrant).

    Raises:
        FakeStepError: the model has no repeated blocks to checkpoint.
    """
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if callable(enable) and getattr(model, "supports_gradient_checkpointing", False):
        enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return
    # Parameter-free layers are not blocks: nothing they save is worth recomputing, and a
    # reentrant checkpoint breaks the in-place ones.
    blocks = repeated_blocks(model)
    if not blocks:
        raise FakeStepError(
            "--checkpointing found no repeated blocks (an nn.ModuleList or nn.Sequential) "
            "to checkpoint in the model"
        )
    for block in blocks:
        checkpoint_forward(block)


def checkpoint_forward(module: torch.nn.Module) -> None:
    """`module`'s forward through `checkpoint(use_reentrant=True)`, whose recomputation runs
    under the agent's hooks and is counted (a call that records no graph runs plainly)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    forward = module.forward

    def checkpointed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not any(t.requires_grad for t in tensors) or not torch.is_grad_enabled():
            return _forward(*args, **kwargs)
        # Reentrant checkpoints take positional tensors only; keywords ride in a partial.
        return checkpoint(functools.partial(_forward, **kwargs), *args, use_reentrant=True)

    module.forward = checkpointed


def to_bfloat16(model: torch.nn.Module) -> None:
    """`model.to(torch.bfloat16)` that also works on fake tensors (whose `_apply` cannot swap
    a parameter in place): each floating parameter replaced by a bf16 one through the module's
    own `__setattr__`, a tied parameter once (its users share the new one), buffers likewise."""
    import torch

    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None or not parameter.is_floating_point():
                continue
            if id(parameter) not in done:
                converted = parameter.detach().to(torch.bfloat16)
                done[id(parameter)] = torch.nn.Parameter(converted, parameter.requires_grad)
            setattr(module, name, done[id(parameter)])
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_floating_point():
                setattr(module, name, buffer.to(torch.bfloat16))


def make_optimizer(
    kind: OptimizerKind, parameters: Iterable[torch.Tensor]
) -> torch.optim.Optimizer:
    """The torch.optim optimizer `--optimizer` names, over the trainable parameters."""
    import torch

    name, options = _OPTIMIZERS[kind]
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        raise FakeStepError("the model has no trainable parameters: nothing to train")
    optimizer: torch.optim.Optimizer = getattr(torch.optim, name)(trainable, **options)
    return optimizer


def forward_keywords(model: torch.nn.Module, batch: Mapping[str, Any]) -> dict[str, Any]:
    """The batch's entries the forward takes by name (all of them if it takes `**kwargs`).

    With `--loss`, the batch may also hold what only the loss reads (targets, masks): those
    are withheld from the forward and reach the loss in the whole batch.
    """
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a forward with no signature to read: pass everything
        return dict(batch)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(batch)
    names = {p.name for p in parameters}
    return {key: value for key, value in batch.items() if key in names}


def train_steps(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    autocast: Autocast | None,
    spec: str,
    steps: int = 2,
    accum: int = 1,
    loss_fn: Any = None,
    loss_spec: str = "--loss",
) -> str | None:
    """Steps of the plain loop, `memtui estimate`'s assumption about the job: `zero_grad`
    (freeing the gradients), then `accum` microbatches of forward and loss under autocast and
    backward (each loss divided by `accum`, gradients accumulating), then `optimizer.step()`.
    Returns where in the forward's output the loss was (`_loss_of`; "--loss" when `loss_fn`
    computed it from the output and the batch)."""
    import torch

    dtype = {Autocast.BF16: torch.bfloat16, Autocast.FP16: torch.float16}.get(autocast)  # type: ignore[arg-type]
    where = None
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for _ in range(accum):
            with torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext():
                loss, where = forward_and_loss(model, batch, spec, loss_fn, loss_spec)
            (loss / accum if accum > 1 else loss).backward()
        optimizer.step()
    return where


def forward_and_loss(
    model: torch.nn.Module,
    batch: Mapping[str, Any],
    spec: str,
    loss_fn: Any = None,
    loss_spec: str = "--loss",
) -> tuple[Any, str | None]:
    """One forward of the batch and its loss, as every run of the child computes it (the
    training steps and the block profile alike): the loss and where it was (`_loss_of`;
    `loss_spec` when `loss_fn` computed it from the output and the whole batch)."""
    if loss_fn is None:
        return _loss_of(model(**batch), spec)
    output = model(**forward_keywords(model, batch))
    return _loss_from(loss_fn(output, batch), loss_spec), loss_spec


def _loss_from(value: Any, spec: str) -> Any:
    """What `--loss` returned, if it is a one-element tensor."""
    import torch

    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value
    shown = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise FakeStepError(f"{spec} returned {shown}, not a one-element loss tensor")


def _step_without_values(optimizer: torch.optim.Optimizer) -> None:
    """Make `optimizer.step()` runnable on fake parameters.

    Optimizers keep their step count in a scalar tensor made from a Python number, and some
    read values back with `.item()` (Adafactor reads its step and the norms of parameters and
    updates), which a fake tensor cannot answer. So the step runs outside the fake mode, where
    such scalars are real (counted as the same 4 bytes) while everything made from a parameter,
    gradient or moment stays fake (fake tensors carry their mode), and a fake tensor's `.item()`
    answers 1: values steer the update's arithmetic, never which tensors it allocates. torch's
    own step wrapper and hooks still run inside, so the tracker sees the same step.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.utils._python_dispatch import TorchDispatchMode

    class ValuesAsOne(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func is torch.ops.aten._local_scalar_dense.default and isinstance(
                args[0], FakeTensor
            ):
                dtype = args[0].dtype
                return True if dtype is torch.bool else 1 if not dtype.is_floating_point else 1.0
            return func(*args, **(kwargs or {}))

    step = optimizer.step

    def step_without_values(*args: Any, **kwargs: Any) -> Any:
        # TorchDispatchMode.__init__ carries no annotations (torch 2.x).
        with unset_fake_temporarily(), ValuesAsOne():  # type: ignore[no-untyped-call]
            return step(*args, **kwargs)

    optimizer.step = step_without_values  # type: ignore[method-assign]  # this optimizer only


def _figures(step: Any) -> StepFigures:
    # Measured at every step (`--activations every`): every pile is counted, unless the model
    # ran its forward under saved-tensor hooks of its own (then nothing here is an estimate).
    if not all(piles.known for piles in (step.end, step.max, step.peak)):
        raise FakeStepError(
            f"step {step.step}'s activations could not be measured (the model saves its "
            "tensors through saved-tensor hooks of its own)"
        )
    end, high, peak = (
        dict(zip(PILES, piles.counted(), strict=True)) for piles in (step.end, step.max, step.peak)
    )
    return StepFigures(end, high, peak)


def run_variant(request: FakeStepRequest, variant: Variant, fake: bool = True) -> FakeStepResult:
    """Build, train two steps on fake tensors under the real tracker, and read its frames.

    `fake=False` trains the same steps on real tensors (allocating them): the reference the
    tests compare the fake run with, in one process.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memtui_agent.memory.ledger import count_fake_storages
    from memtui_agent.startup.parts import build_parts
    from memtui_agent.steps.frame import ClosedStep, HostValues, build_step
    from memtui_protocol import schema
    from memtui_protocol.config import AgentConfig
    from memtui_protocol.schema import ActivationMode, NanCheck

    started = time.perf_counter()
    build_model, build_batch = resolve(request.model, "--model"), resolve(request.batch, "--batch")
    steps: list[schema.Step] = []
    names: dict[int, str] = {}
    failures: list[tuple[str, BaseException]] = []

    def emit(item: Any) -> None:
        if isinstance(item, ClosedStep):  # its frame, without reading the fake loss
            steps.append(build_step(item.inputs, HostValues()))
        elif isinstance(item, schema.Names) and item.kind == "module":
            names.update(enumerate(item.names, start=item.first_id))

    def fail(part: str, exc: BaseException, effect: str = "is off") -> None:
        failures.append((part, exc))

    with contextlib.ExitStack() as undo:
        undo.enter_context(warnings.catch_warnings())
        # The ledger reads fake storages' data_ptr() (0), which torch flags as deprecated.
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        count_fake_storages(fake)
        undo.callback(count_fake_storages, False)
        # Every hook on both steps: the estimate is the measured step, never a carried one.
        config = AgentConfig(nan_check=NanCheck.OFF, activations=ActivationMode.EVERY)
        parts = build_parts(config, emit, fail)
        parts.install()
        undo.callback(parts.remove)
        undo.enter_context(
            FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
        )
        model = _call(build_model, request.model)
        if not isinstance(model, torch.nn.Module):
            raise FakeStepError(
                f"{request.model} returned {type(model).__name__}, not a torch.nn.Module"
            )
        model.train()
        if request.checkpointing or variant is Variant.CHECKPOINTED:
            apply_checkpointing(model)
        if request.checkpoint_modules:
            checkpoint_named(model, request.checkpoint_modules)
        batch = _batch_of(request.batch, _call(build_batch, request.batch))
        if variant is Variant.DOUBLE_BATCH:
            batch = double_batch(batch)
        if request.weights_bf16:
            to_bfloat16(model)
            batch = {
                key: value.to(torch.bfloat16)
                if isinstance(value, torch.Tensor) and value.is_floating_point()
                else value
                for key, value in batch.items()
            }
        loss_fn = None if request.loss is None else resolve(request.loss, "--loss")
        optimizer = make_optimizer(request.optimizer, model.parameters())
        if fake:
            _step_without_values(optimizer)
        try:
            loss_from = train_steps(
                model,
                batch,
                optimizer,
                request.autocast,
                request.model,
                accum=request.accum,
                loss_fn=loss_fn,
                loss_spec=request.loss or "--loss",
            )
        except FakeStepError:
            raise
        except Exception as exc:
            reason = _fake_failure(request.model, exc)
            if reason is not None:
                raise reason from None
            raise FakeStepError(
                f"a training step of {request.model} raised {one_line(exc)}"
            ) from None
        params = {id(p): p for p in model.parameters()}.values()
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        size = batch_size(batch)
    if failures:
        part, failure = failures[0]
        raise FakeStepError(f"the agent's {part} failed on fake tensors: {one_line(failure)}")
    if len(steps) != 2:
        raise FakeStepError(f"expected two closed steps, the tracker closed {len(steps)}")
    first, steady = steps
    return FakeStepResult(
        variant=variant.value,
        params=total,
        trainable=trainable,
        batch_size=size,
        first=_figures(first),
        steady=_figures(steady),
        top_modules=[(names.get(m.module, "<no module>"), m.bytes) for m in steady.top_activations],
        dtypes={pile: {d: s.bytes for d, s in by.items()} for pile, by in steady.dtypes.items()},
        seconds=round(time.perf_counter() - started, 3),
        loss_from=None
        if loss_from is None
        else loss_from
        if loss_from == request.loss
        else f"output{loss_from}",
    )


def _call(factory: Any, spec: str) -> Any:
    """Call a user's factory; its own errors become one line naming it."""
    try:
        return factory()
    except Exception as exc:
        reason = _fake_failure(spec, exc)
        if reason is not None:
            raise reason from None
        raise FakeStepError(f"{spec} raised {one_line(exc)}") from None


def main(argv: list[str] | None = None) -> int:
    """Run the request's variants and print one JSON line; user output goes to stderr."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m memtui_agent.estimate.fake_step REQUEST_JSON", file=sys.stderr)
        return EXIT_FAILED
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    request = FakeStepRequest.from_json(args[0])
    try:
        import torch  # noqa: F401
    except ImportError:
        print("--batch needs torch in this Python", file=sys.stderr)
        return EXIT_FAILED
    results = []
    try:
        with contextlib.redirect_stdout(sys.stderr):
            for variant in request.variants:
                try:
                    if variant is Variant.BLOCKS:
                        results.append(profile_request(request))
                        continue
                    results.append(asdict(run_variant(request, variant)))
                except FakeStepError as exc:
                    if variant is Variant.AS_GIVEN:
                        raise
                    results.append({"variant": variant.value, "error": str(exc)})
            for what_if in request.what_ifs:
                changed, variant = with_what_if(request, what_if)
                try:
                    result = asdict(run_variant(changed, variant))
                except FakeStepError as exc:
                    result = {"variant": variant.value, "error": str(exc)}
                results.append({**result, "what_if": what_if.value})
    except (FakeStepError, CountError) as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    except SystemExit as exc:
        print(f"{request.model} called sys.exit({exc.code!r})", file=sys.stderr)
        return EXIT_FAILED
    except RecursionError:
        print(f"{request.model} recursed too deeply", file=sys.stderr)
        return EXIT_FAILED
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
