"""Wrappers around library calls no hook reports: GradScaler, gradient clipping, checkpoint.

Each wrapper does what the library does and reports what it saw; the step window and the rest
decide what that means:

- GradScaler: a skipped update fires no optimizer hook, so `GradScaler.step` is wrapped to notice
  the skip (`Skips`); `scale` and `unscale_` tell the window which loss was scaled and whether the
  gradients were unscaled, `update` releases a held skip with the scale after it.
- `clip_grad_norm_`/`clip_grad_value_`: a warning when gradients are clipped while still scaled
  (the wrong order: unscale first, then clip; docs/health.md).
- `torch.utils.checkpoint.checkpoint`: said once per variant, since checkpointed regions hide
  their activations from the saved-tensor hooks.
- `torch.nn.modules.module._has_any_global_hook`: memtui's own global module hooks left out, so
  a `torch.compile`d module warns about global hooks only where the job has some of its own.
- `_MultiProcessingDataLoaderIter.__init__`: the DataLoader workers it started, and their
  dataset, handed to `job.data_loaders` (their memory is sampled off the training thread).
- `torch._C._autograd._saved_tensors_hooks_disable`/`_enable`: torch.func's grad, vjp, jacrev and
  hessian disable saved-tensor hooks, which raises when any are on the thread's stack; the
  agent's pair leaves for the region and comes back after it (`SavedHooksDisabled`).

`Tracker._wrap` installs them and restores the originals.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from threading import get_ident
from typing import Any, Protocol

import torch
from torch._C import _current_graph_task_id

from memtui_agent.hooks.context import HookContext
from memtui_agent.hooks.hook_arming import HookArming
from memtui_agent.hooks.training_thread import TrainingThread
from memtui_agent.job.data_loaders import DataLoaders
from memtui_agent.steps.window import StepWindow
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind

Wrapper = Callable[..., Any]

CHECKPOINT_NOTES = {
    "non-reentrant": "activation checkpointing (use_reentrant=False) in use: inside "
    "checkpointed regions the checkpoint's own saved-tensor hooks replace memtui's, so "
    "activations kept or recomputed there are not counted",
    "reentrant": "activation checkpointing (use_reentrant=True) in use: checkpointed regions "
    "run their forward without saving activations; backward recomputes them, and memtui counts "
    "what the recomputation saves while backward holds it",
}
"""What each checkpoint variant means for the activations pile (measured on torch 2.13)."""


class SkipSink(Protocol):
    """Where a noticed skip goes (the tracker: it registers the optimizer, then tells the
    step window)."""

    def scaler_skipped(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
    ) -> None:
        """`scaler.step(optimizer)` returned without stepping `optimizer`."""
        ...


class GradScalerWrappers:
    """`GradScaler.scale`, `step`, `unscale_` and `update`, reporting to the step window."""

    def __init__(self, context: HookContext, skips: SkipSink) -> None:
        """Calls on threads other than the followed one (`context.thread`) pass straight
        through."""
        self._window = context.window
        self._thread = context.thread
        self._optimizers = context.optimizers
        self._skips = skips
        self._enabled = context.switches
        self._disable = context.switches.disable

    def scale(self, original: Wrapper) -> Wrapper:
        def scale(scaler: torch.amp.GradScaler, outputs: Any) -> Any:
            result = original(scaler, outputs)
            if not self._thread.follows():
                return result  # another thread's loss: not this recording's step
            try:
                self._window.loss_scaled(outputs, result)
            except Exception:
                pass
            return result

        return scale

    def step(self, original: Wrapper) -> Wrapper:
        def step(
            scaler: torch.amp.GradScaler,
            optimizer: torch.optim.Optimizer,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            # `scaler.step(optimizer)` steps the optimizer or skips it: either is this thread's
            # claim to be followed (`TrainingThread.claim`), decided before the scale is noted.
            thread = self._thread
            if not (thread.claim() if self._enabled["steps"] else thread.follows()):
                return original(scaler, optimizer, *args, **kwargs)
            record = self._optimizers.get(optimizer)
            steps_before = record.steps if record is not None else 0
            try:
                # The scale this step's backward used; `update()` changes it in place later,
                # and the step may close inside `original` (the optimizer's post hook).
                scale = getattr(scaler, "_scale", None) if scaler.is_enabled() else None
                if scale is not None:
                    self._window.scale_used(scale.detach().clone())
            except Exception as exc:
                self._disable("scaler", exc)
            result = original(scaler, optimizer, *args, **kwargs)
            try:
                record = self._optimizers.get(optimizer)
                stepped = record is not None and record.steps != steps_before
                if not stepped and self._enabled["steps"]:
                    self._skips.scaler_skipped(optimizer, scaler)
            except Exception as exc:
                self._disable("steps", exc)
            return result

        return step

    def update(self, original: Wrapper) -> Wrapper:
        def update(scaler: torch.amp.GradScaler, *args: Any, **kwargs: Any) -> Any:
            result = original(scaler, *args, **kwargs)
            if self._thread.follows():
                self._window.scaler_updated(scaler)
            return result

        return update

    def unscale_(self, original: Wrapper) -> Wrapper:
        def unscale_(scaler: torch.amp.GradScaler, *args: Any, **kwargs: Any) -> Any:
            if self._thread.follows():
                self._window.unscaled()
            return original(scaler, *args, **kwargs)

        return unscale_


class ClipWarning:
    """Warns once when gradients are clipped while GradScaler's scale is still in them (on the
    followed thread: another thread's clipping says nothing of the recorded step)."""

    def __init__(self, window: StepWindow, thread: TrainingThread) -> None:
        self._window = window
        self._thread = thread
        self._warned = False

    def clip(self, original: Wrapper) -> Wrapper:
        def clip(*args: Any, **kwargs: Any) -> Any:
            if not self._warned and self._window.gradients_scaled and self._thread.follows():
                self._warned = True
                self._window.note(
                    schema.Alert(
                        kind=AlertKind.CLIP_BEFORE_UNSCALE,
                        message=f"{original.__name__} ran on gradients still multiplied by the "
                        "GradScaler's scale: call scaler.unscale_(optimizer) first, or the "
                        "clipping threshold applies to scaled gradients",
                        where=original.__name__,
                    )
                )
            return original(*args, **kwargs)

        return clip


class CheckpointNotes:
    """Says once per checkpoint variant what it hides from the activations pile (of the
    followed thread's model: another thread's checkpoints hide nothing recorded)."""

    def __init__(
        self,
        window: StepWindow,
        emit: Callable[[schema.Message], None],
        thread: TrainingThread,
    ) -> None:
        self._window = window
        self._emit = emit
        self._thread = thread
        self._noted: set[str] = set()

    def checkpoint(self, original: Wrapper) -> Wrapper:
        def checkpoint(*args: Any, **kwargs: Any) -> Any:
            # torch 2.x treats a missing use_reentrant as True (with a warning).
            reentrant = kwargs.get("use_reentrant")
            variant = "reentrant" if reentrant is None or reentrant else "non-reentrant"
            if variant not in self._noted and self._thread.follows():
                self._noted.add(variant)
                alert = schema.Alert(
                    kind=AlertKind.CHECKPOINT_LIMIT, message=CHECKPOINT_NOTES[variant]
                )
                self._emit(schema.AlertNow(time=time.time(), step=self._window.number, alert=alert))
            return original(*args, **kwargs)

        return checkpoint


GLOBAL_MODULE_HOOKS = (
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
)
"""The dicts of global module hooks `torch.nn.modules.module._has_any_global_hook` reads (its
two other dicts only flag entries of `_global_forward_hooks`)."""
AGENT_PACKAGE = __name__.split(".", 1)[0] + "."


@contextlib.contextmanager
def _stack_in_view() -> Iterator[None]:
    """The thread's saved-tensor stack as it is, while AOTAutograd traces too: its tracing flag
    hides the top of the stack from `_top_saved_tensors_default_hooks`, not from the check that
    raises, so the agent's pair could not be seen to be taken out."""
    set_tracing = getattr(torch._C._autograd, "_saved_tensors_hooks_set_tracing", None)
    if set_tracing is None:
        yield
        return
    prior = set_tracing(False)
    try:
        yield
    finally:
        set_tracing(prior)


class SavedHooksDisabled:
    """torch's switch that disables saved-tensor hooks, with the agent's pair out meanwhile.

    torch.func's grad, vjp, jacrev and hessian run their function inside it, and torch raises
    ("torch.func.{grad, vjp, jacrev, hessian} don't yet support saved tensor hooks") when any
    saved-tensor hooks are on the calling thread's stack: with the agent's pair pushed for a
    measured step, a job using them died at its first step. On the followed thread, outside a
    backward, the pair leaves as the region begins (only from the top of the stack, as ever)
    and is pushed back as it ends, if the stack is empty again; the gate is told, and the step's
    activations are not known (what the region saves reaches no hook).

    Wrapped are torch's C functions that `torch.autograd.graph.disable_saved_tensors_hooks`
    calls (`_saved_tensors_hooks_disable`, then `_saved_tensors_hooks_enable` as the outermost
    region ends), not that context manager: dynamo, tracing a `torch.compile`d function that uses
    torch.func, models the context manager itself and calls the C functions directly.
    """

    def __init__(self, context: HookContext, arming: HookArming) -> None:
        self._thread = context.thread
        self._gate = context.gate
        self._arming = arming
        self._disable = context.switches.disable
        self._left: int | None = None
        """The thread whose disabled region took the pair out (None: none did)."""

    def _leave(self) -> bool:
        """Pop the agent's pair if it is on top of this thread's stack; whether it left."""
        arming = self._arming
        # Not `is_compiling()`: dynamo, tracing torch.func inside a compiled function, calls
        # torch's C function itself (while its compiling flag is up), and that call raises too.
        if (
            arming.pushed_on != get_ident()
            or get_ident() != self._thread.ident
            or _current_graph_task_id() != -1
        ):
            return False
        try:
            with _stack_in_view():
                if not arming.pop_pack():  # only from the top of the stack
                    return False
            self._gate.hooks_disabled()
            return True
        except Exception as exc:
            self._disable("activations", exc)
            return False

    def _back(self) -> None:
        """Push the pair again where it was (nothing on the stack, hooks enabled)."""
        try:
            if self._arming.modules_armed:
                self._arming.push_pack()
        except Exception as exc:
            self._disable("activations", exc)

    def disable(self, original: Wrapper) -> Wrapper:
        """`torch._C._autograd._saved_tensors_hooks_disable`: the pair leaves first when the
        call would raise because of it (`fail_if_non_empty`, torch's default)."""

        def _saved_tensors_hooks_disable(message: str, fail_if_non_empty: bool = True) -> Any:
            if fail_if_non_empty and self._left is None and self._leave():
                self._left = get_ident()
            return original(message, fail_if_non_empty)

        return _saved_tensors_hooks_disable

    def enable(self, original: Wrapper) -> Wrapper:
        """`torch._C._autograd._saved_tensors_hooks_enable`: the pair comes back after."""

        def _saved_tensors_hooks_enable() -> Any:
            result = original()
            if self._left is not None and self._left == get_ident():
                self._left = None
                self._back()
            return result

        return _saved_tensors_hooks_enable


class DataLoaderWrappers:
    """Notes each DataLoader iterator that starts worker processes (`job.data_loaders`)."""

    def __init__(self, loaders: DataLoaders, fail: Callable[[BaseException], None]) -> None:
        self.loaders = loaders
        self._fail = fail
        self._on = True

    def iterator_init(self, original: Wrapper) -> Wrapper:
        def __init__(iterator: Any, *args: Any, **kwargs: Any) -> None:
            original(iterator, *args, **kwargs)
            if not self._on:
                return
            try:
                self.loaders.started(iterator)
            except Exception as exc:  # the workers go unfollowed; the DataLoader runs as ever
                self._on = False
                self._fail(exc)

        return __init__


def _ours(hook: object) -> bool:
    module = getattr(hook, "__module__", None)
    return isinstance(module, str) and module.startswith(AGENT_PACKAGE)


def global_hooks_but_ours(original: Wrapper) -> Wrapper:
    """`torch.nn.modules.module._has_any_global_hook`, not counting memtui's own hooks.

    torch asks it only before warning, at every call of a `torch.compile`d module
    (`OptimizedModule.__call__`), that global module hooks fire an extra time: memtui's hooks
    made a compiled job print that warning where a plain run prints nothing. A job with global
    module hooks of its own still gets it, from torch, as before.
    """

    def has_any_global_hook() -> Any:
        found = original()
        if not found:
            return found
        hooks = torch.nn.modules.module
        try:
            return any(
                not _ours(hook)
                for name in GLOBAL_MODULE_HOOKS
                for hook in getattr(hooks, name).values()
            )
        except Exception:  # another torch's layout: torch's own answer
            return found

    return has_any_global_hook


ROOT_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
"""A module's dicts that hold (or flag, by the hook's id) the per-root hooks memtui installs
(`root_calls.RootHooks`)."""


def state_without_ours(original: Wrapper) -> Wrapper:
    """`torch.nn.Module.__getstate__`, with memtui's per-root hooks left out of the state.

    `copy.deepcopy(model)` (what `torch.optim.swa_utils.AveragedModel` and every EMA or teacher
    copy does) and `torch.save(model)` read a module's state through `__getstate__`; with the
    root hooks (bound methods of the agent's objects) in it, both failed under memtui ("cannot
    pickle '_thread.RLock' object") where the plain run works, and a copy that did succeed would
    carry the agent's hooks into the job's new module or into a file that needs memtui to load.
    The state handed out is the module's own, as without memtui; the module itself keeps its
    hooks. A module with no hook of ours (all but the roots) pays one dict lookup per hook dict.
    """

    def __getstate__(module: Any) -> Any:
        state = original(module)
        if type(state) is not dict:  # a subclass's own state: nothing of ours is known there
            return state
        ours = [
            key
            for name in ("_forward_pre_hooks", "_forward_hooks")
            for key, hook in (state.get(name) or {}).items()
            if _ours(hook)
        ]
        if not ours:
            return state
        state = dict(state)
        for name in ROOT_HOOK_DICTS:
            hooks = state.get(name)
            if hooks is None or not any(key in hooks for key in ours):
                continue
            state[name] = _without_ours(hooks, set(ours))
        return state

    return __getstate__


def _without_ours(hooks: Any, ours: set[int]) -> Any:
    """A copy of one hook dict (same type, same order) without the keys in `ours`."""
    kept = type(hooks)()
    for key, value in hooks.items():
        if key not in ours:
            kept[key] = value
    return kept


def script_without_ours(original: Wrapper) -> Wrapper:
    """`torch.jit._recursive.create_script_module`, which `torch.jit.script(module)` calls,
    seeing each module's hooks without memtui's per-root ones.

    Scripting compiles every forward hook of every module in the tree (`get_hook_stubs`, and the
    module's concrete type lists them): memtui's root hooks, which no compiler can script, made
    `torch.jit.script` of any model already called fail under memtui (`'CopySafeHook' object
    has no attribute '__name__'`) where the plain run works. For the call's duration each
    module's hook dicts that hold one of ours are swapped for copies without them (same order,
    the job's hooks all there), then the module's own dicts go back: the scripted module is the
    one the job would get without memtui, and the job's module keeps its hooks. A module of the
    tree that another thread calls during the scripting is not seen as a root call then.
    """

    def create_script_module(nn_module: Any, *args: Any, **kwargs: Any) -> Any:
        swapped: list[tuple[dict[str, Any], str, Any]] = []
        try:
            tree: Any = nn_module
            modules: Any = tree.modules() if isinstance(tree, _module_type()) else ()
            for module in modules:
                state = module.__dict__
                ours = {
                    key
                    for name in ("_forward_pre_hooks", "_forward_hooks")
                    for key, hook in (state.get(name) or {}).items()
                    if _ours(hook)
                }
                if not ours:
                    continue
                for name in ROOT_HOOK_DICTS:
                    hooks = state.get(name)
                    if hooks is not None and any(key in hooks for key in ours):
                        swapped.append((state, name, hooks))
                        state[name] = _without_ours(hooks, ours)
        except Exception:  # a tree memtui cannot walk: scripted as it is
            pass
        try:
            return original(nn_module, *args, **kwargs)
        finally:
            for state, name, hooks in reversed(swapped):
                state[name] = hooks

    return create_script_module


def _module_type() -> type[Any]:
    return torch.nn.Module
