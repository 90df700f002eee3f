"""The hooks: installed, removed, and the one thread they follow.

Installed globally so that any script is instrumented without code changes: module forward
pre/post hooks, saved-tensor default hooks on the thread that starts the agent and
post-accumulate-grad hooks on every discovered parameter (`counting`, armed by `hook_arming`),
optimizer step pre/post hooks and a `torch.autograd.backward` wrapper (`step_hooks`), a forward
pre/post hook on each root module (`root_calls`), wrappers around GradScaler, clipping and
checkpoint (`library_wrappers`), DDP/FSDP measurements (`data_parallel`). Every handle is kept
and removed by `remove()`.

The hooks count into the ledger and keep the training phase (`phase.JobPhase`); everything else
they see they report: step events to the step window (`steps.window`), measuring events to the
activation gate (`steps.gate`), first steps to `steps.first_step`. Every part, hooks included,
is built in one place (`startup.parts.build_parts`); the tracker installs and removes the hooks
it is handed, and owns no step logic.

Each hook does constant-time work inside a `try`: an exception disables that hook, is reported
once, and never reaches the training code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from memtui_agent.hooks.context import HookContext
from memtui_agent.hooks.copy_safe import homes, stand_in_for
from memtui_agent.hooks.counting import CountingHooks
from memtui_agent.hooks.hook_arming import HookArming
from memtui_agent.hooks.library_wrappers import (
    CheckpointNotes,
    ClipWarning,
    DataLoaderWrappers,
    GradScalerWrappers,
    SavedHooksDisabled,
    Wrapper,
    global_hooks_but_ours,
    script_without_ours,
    state_without_ours,
)
from memtui_agent.hooks.root_calls import RootHooks
from memtui_agent.hooks.saved_tensors import unpack_samplers
from memtui_agent.hooks.step_hooks import StepHooks
from memtui_agent.hooks.switches import Fail
from memtui_agent.steps.failures import ErrorContext
from memtui_protocol.schema import Phase

if TYPE_CHECKING:  # for annotations only
    from torch.utils.hooks import RemovableHandle


@dataclass(frozen=True)
class HookSet:
    """The hooks one tracker installs, built beside the parts they report to."""

    arming: HookArming
    counting: CountingHooks
    roots: RootHooks
    steps: StepHooks
    scaler: GradScalerWrappers
    clip: ClipWarning
    checkpoint: CheckpointNotes
    saved_off: SavedHooksDisabled | None = None
    loaders: DataLoaderWrappers | None = None


class Tracker:
    """Installs and removes the hooks of one process, and follows their thread."""

    def __init__(self, context: HookContext, hooks: HookSet, fail: Fail) -> None:
        """`fail` reports a half-done move to another thread (`_thread_moved`)."""
        self._context = context
        self.hooks = hooks
        """The hooks installed (each kind's own object, for tests and benchmarks)."""
        self.arming = hooks.arming
        self._fail = fail
        self._handles: list[RemovableHandle] = []
        self._restore: list[tuple[ModuleType | type, str, Wrapper]] = []
        """(module or class, attribute, the original function) for each wrapper installed."""
        context.thread.on_move(self._thread_moved)

    # ----- install / remove -----------------------------------------------------------------

    def install(self) -> None:
        """Register every global hook; call on the thread that runs the forward.

        The module hooks find the models on the first step whatever the mode says; the gate
        arms the rest for it (not in `off`).
        """
        self._context.thread.restart()
        self.arming.arm_modules()
        self.hooks.roots.outside()
        self._context.gate.started()
        steps = self.hooks.steps
        scaler = self.hooks.scaler
        self._handles.append(register_optimizer_step_pre_hook(steps.optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(steps.optimizer_post))
        self._wrap(torch.autograd, "backward", steps.backward)
        scaler_cls = torch.amp.grad_scaler.GradScaler
        self._wrap(scaler_cls, "step", scaler.step)
        self._wrap(scaler_cls, "scale", scaler.scale)
        self._wrap(scaler_cls, "update", scaler.update)
        self._wrap(scaler_cls, "unscale_", scaler.unscale_)
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            self._wrap(torch.nn.utils, name, self.hooks.clip.clip)
        self._wrap(torch.utils.checkpoint, "checkpoint", self.hooks.checkpoint.checkpoint)
        if self.hooks.saved_off is not None:
            autograd = torch._C._autograd
            self._wrap(autograd, "_saved_tensors_hooks_disable", self.hooks.saved_off.disable)
            self._wrap(autograd, "_saved_tensors_hooks_enable", self.hooks.saved_off.enable)
        self._wrap(torch.optim.Optimizer, "__init__", steps.optimizer_init)
        # The module trees change: a close walks them again only then (`pile_watch`).
        module_hooks = torch.nn.modules.module
        note = self._context.registry.note_tree_change
        for register in (
            module_hooks.register_module_module_registration_hook,
            module_hooks.register_module_parameter_registration_hook,
            module_hooks.register_module_buffer_registration_hook,
        ):
            self._handles.append(register(note))
        self._wrap(torch.nn.Module, "_apply", self._wrap_module_apply)
        # A copy or a pickle of a model (AveragedModel, an EMA, torch.save) is the job's own,
        # without the agent's per-root hooks.
        self._wrap(torch.nn.Module, "__getstate__", state_without_ours)
        # `torch.jit.script(model)` compiles every hook of the tree: the job's, not the agent's.
        self._wrap(torch.jit._recursive, "create_script_module", script_without_ours)
        if hasattr(module_hooks, "_has_any_global_hook"):
            self._wrap(module_hooks, "_has_any_global_hook", global_hooks_but_ours)
        if self.hooks.loaders is not None:
            iterator_cls = torch.utils.data.dataloader._MultiProcessingDataLoaderIter
            self._wrap(iterator_cls, "__init__", self.hooks.loaders.iterator_init)

    @contextmanager
    def without(self, kind: str) -> Iterator[None]:
        """Run with one kind of hook taken out ("modules", "grads", "pack" or "all").

        For measuring what each kind costs inside real training steps, in one process
        (`benchmarks/ablation.py`); call it between steps, on the thread that runs them.
        """
        arming = self.arming
        if kind == "modules":
            arming.disarm_modules()
            try:
                yield
            finally:
                arming.arm_modules()
        elif kind == "grads":
            arming.unhook_grads()
            try:
                yield
            finally:
                self._context.gate.parameters_found()
        elif kind == "pack":
            arming.pop_pack()
            try:
                yield
            finally:
                arming.push_pack()
        elif kind == "all":
            self.remove()
            try:
                yield
            finally:
                self.install()
                self._context.gate.parameters_found()
        else:
            raise ValueError(f"no hook kind {kind!r}")

    def remove(self) -> None:
        """Undo `install()`: global, per-root and per-parameter hooks, wrapped functions."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.hooks.roots.remove()
        unpack_samplers.clear()
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()
        try:
            self.arming.disarm()
        except RuntimeError:
            pass

    def _wrap(
        self, owner: ModuleType | type, name: str, make: Callable[[Wrapper], Wrapper]
    ) -> None:
        original: Wrapper = getattr(owner, name)
        # A plain function, given the original's names and `__wrapped__` (`stand_in_for`: so
        # pickle saves it as the original): a Callable has no such attributes for mypy.
        wrapper: Any = make(original)
        stand_in_for(wrapper, original)
        for place, attribute in homes(owner, name):
            setattr(place, attribute, wrapper)
            self._restore.append((place, attribute, original))

    # ----- what the agent reads -----------------------------------------------------------------

    @property
    def owner_thread(self) -> int:
        """The thread followed now."""
        return self._context.thread.ident

    def pack_removable(self) -> bool:
        """Whether the agent's saved-tensor pair is on top here and may be popped (detach)."""
        return self.arming.pack_removable

    def phase(self) -> Phase:
        """The training phase right now."""
        return self._context.phase.now()

    def error_context(self) -> ErrorContext | None:
        """Where the exception now propagating was first seen."""
        return self._context.phase.error_context

    def feed_module_pre(self, module: torch.nn.Module, args: tuple[object, ...]) -> None:
        """Run the module pre-hook by hand (an attach joining at a forward already begun)."""
        self.hooks.counting.module_pre(module, args)

    def _thread_moved(self, old: int) -> None:
        """The first optimizer step came from another thread than the one followed so far: the
        agent follows that thread from here (`training_thread`; this runs there, under its
        lock). What the old thread registered is its own and leaves: its models, optimizers,
        root and gradient hooks (a model the new thread runs too comes back at its next
        forward, under the same names). The open step's forwards ran where the agent was not
        looking (not known), and its losses were the old thread's; the pair on the old thread
        stays there, ignored."""
        context, hooks = self._context, self.hooks
        try:
            phase = context.phase
            phase.stack.clear()
            phase.root_depth = 0
            phase.in_backward = 0
            phase.in_optimizer = False
            hooks.arming.leave_thread(old)
            hooks.arming.unhook_grads()  # torch calls a copy of a tensor's hooks: safe mid-backward
            hooks.roots.remove()  # likewise, a module's hooks
            hooks.roots.outside()
            context.registry.forget_objects()
            hooks.counting.forget_parameters()
            context.window.forget_losses()
            context.gate.thread_moved()
        except Exception as exc:
            # Runs inside the job's optimizer.step() (`TrainingThread.claim`): never raises
            # there. Half forgotten, the old thread's tensors could still be read: every hook
            # turns off (said once), the job goes on unrecorded.
            context.switches.all_off()
            self._fail("hook:thread", exc)

    def _wrap_module_apply(self, original: Wrapper) -> Wrapper:
        # `Module._apply(fn, recurse)`'s arguments passed through as torch gives them, its
        # result returned: the wrapper looks into neither.
        def _apply(module: torch.nn.Module, *args: object, **kwargs: object) -> object:
            try:
                return original(module, *args, **kwargs)
            finally:
                # `.to()`, `.half()`, `.cuda()`: parameters and buffers converted in place of
                # the old ones (`.data` swapped, `_buffers` written), no registration hook.
                self._context.registry.note_tree_change(module)

        return _apply
