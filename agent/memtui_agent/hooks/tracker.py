"""The hooks: installed, removed, and what each one reports.

Installed globally so that any script is instrumented without code changes: module forward
pre/post hooks, saved-tensor default hooks on the thread that starts the agent and
post-accumulate-grad hooks on every discovered parameter (here: they count), optimizer step
pre/post hooks and a `torch.autograd.backward` wrapper (`step_hooks`), a forward pre/post hook
on each root module (`root_calls`), wrappers around GradScaler, clipping and checkpoint
(`library_wrappers`), DDP/FSDP measurements (`data_parallel`). Every handle is kept and removed
by `remove()`.

The hooks count into the ledger (saved tensors, gradients, weights packed by autograd) and keep
the training phase (`phase.JobPhase`); everything else they see they report: step events to the
step window (`steps.window`), measuring events to the activation gate (`steps.gate`), first
steps to `steps.first_step`. The tracker builds those parts and installs the hooks; it owns no
step logic.

Each hook does constant-time work inside a `try`: an exception disables that hook, is reported
once, and never reaches the training code.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from threading import get_ident
from typing import Any, Protocol

import torch
from torch import Tensor
from torch._C import _current_graph_task_id
from torch.compiler import is_compiling
from torch.nn import Parameter
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from memtui_agent.hooks.data_parallel import DataParallelHooks
from memtui_agent.hooks.hook_arming import GateSwitch, HookArming, forget_when_freed
from memtui_agent.hooks.library_wrappers import (
    CheckpointNotes,
    ClipWarning,
    GradScalerWrappers,
    Wrapper,
    global_hooks_but_ours,
)
from memtui_agent.hooks.phase import JobPhase
from memtui_agent.hooks.root_calls import RootHooks
from memtui_agent.hooks.saved_tensors import Saved, SavedOne, SavedWeight, unpack, unpack_samplers
from memtui_agent.hooks.step_hooks import StepHooks, register_live_optimizers
from memtui_agent.hooks.training_thread import TrainingThread
from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.job.optimizer_book import OptimizerBook
from memtui_agent.memory.allocator import AllocatorReader
from memtui_agent.memory.ledger import (
    GRADIENTS,
    NO_MODULE,
    NODE_SHIFT,
    WEIGHTS,
    Ledger,
    plain_storage,
    storages_of,
)
from memtui_agent.memory.tensor_reads import next_sequence_number
from memtui_agent.steps.budget import Budget
from memtui_agent.steps.failures import ErrorContext
from memtui_agent.steps.first_step import FirstSteps
from memtui_agent.steps.frame import ClosedStep
from memtui_agent.steps.gate import ActivationGate
from memtui_agent.steps.health import HealthMonitor
from memtui_agent.steps.pile_count import PersistentPiles
from memtui_agent.steps.step_closer import StepCloser
from memtui_agent.steps.step_signature import heap_reader
from memtui_agent.steps.window import StepWindow
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig
from memtui_protocol.schema import Phase

Emit = Callable[[schema.Message | ClosedStep], None]
"""Where frames go (the agent's emitter)."""


class Fail(Protocol):
    """How a part of the agent reports its error once (the agent's `report_failure`)."""

    def __call__(self, component: str, exc: BaseException, effect: str = ..., /) -> None: ...


CENSUS_EFFECT = "stopped that census (its step says so); later censuses run"

HOOK_KINDS = ("modules", "pack", "grads", "steps", "loss", "scaler", "distributed", "activations")
"""The parts of the hooks that turn themselves off one by one when they raise."""

HOOK_NEW_PARAMETERS_EVERY = 64
"""Closes between looks for parameters unfrozen since (their gradients are counted at each
close meanwhile; a gradient hook only makes the timing exact)."""


class Tracker:
    """The hooks of one process, and the parts they report to."""

    def __init__(
        self,
        ledger: Ledger,
        emit: Emit,
        fail: Fail,
        config: AgentConfig | None = None,
    ) -> None:
        config = config if config is not None else AgentConfig()
        self.config = config
        self.ledger = ledger
        self._emit = emit
        self._fail = fail
        self.enabled = dict.fromkeys(HOOK_KINDS, True)
        self.registry = ModuleRegistry(emit)
        self._fsdp = False
        """FSDP is in use: its gathered parameters are sampled by the hooks."""
        self.data_parallel = DataParallelHooks(self._set_fsdp, self.enabled, self._disable)
        self.job_phase = JobPhase()
        self._stack = self.job_phase.stack
        """The module stack, read by the hottest hooks without another attribute lookup."""
        self.thread = TrainingThread()
        """The one thread followed (`training_thread`): the installing one until an optimizer
        steps, then the first to step one."""
        self.thread.on_move(self._thread_moved)
        self._synced_generation = 0
        self._seen_params: dict[int, weakref.ref[Any]] = {}
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self.optimizers = OptimizerBook()
        self.arming = HookArming(
            self._module_pre, self._module_post, self._pack, unpack, self._grad_ready
        )
        self.piles = PersistentPiles(self.registry, ledger, self.arming)
        budget = Budget(config.budget)
        self._health = HealthMonitor(config.nan_check)
        switch = GateSwitch(self.arming, self.registry, self.piles, self._stack, self.enabled)
        self.gate = ActivationGate(
            config.activations, switch, self.registry, self._health, budget, heap_reader()
        )
        self.closer = StepCloser(
            ledger, self.registry, self.piles, self._health, budget, self.gate, self, config
        )
        self.closer.census_failed = self._census_failed
        self.window = StepWindow(
            self.closer, self.gate, ledger, emit, partial(register_live_optimizers, self.registry)
        )
        self.roots = RootHooks(
            self.registry,
            self.job_phase,
            self.arming,
            self.gate,
            self.window,
            self._disable,
            self.thread,
        )
        self.step_hooks = StepHooks(
            self.job_phase,
            self.window,
            self.gate,
            FirstSteps(budget, emit, AllocatorReader.active),
            self.optimizers,
            self.registry,
            ledger,
            self.piles,
            self.closer.allocator,
            self.sync_objects,
            self.enabled,
            self._disable,
            self.thread,
        )
        self._scaler = GradScalerWrappers(
            self.window, self.optimizers, self.step_hooks, self.enabled, self._disable, self.thread
        )
        self._clip = ClipWarning(self.window, self.thread)
        self._checkpoint = CheckpointNotes(self.window, emit, self.thread)

    # ----- install / remove -----------------------------------------------------------------

    def install(self) -> None:
        """Register every global hook; call on the thread that runs the forward.

        The module hooks find the models on the first step whatever the mode says; the gate
        arms the rest for it (not in `off`).
        """
        self.thread.restart()
        self.arming.arm_modules()
        self.gate.started()
        steps = self.step_hooks
        self._handles.append(register_optimizer_step_pre_hook(steps.optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(steps.optimizer_post))
        self._wrap(torch.autograd, "backward", steps.backward)
        scaler_cls = torch.amp.grad_scaler.GradScaler
        self._wrap(scaler_cls, "step", self._scaler.step)
        self._wrap(scaler_cls, "scale", self._scaler.scale)
        self._wrap(scaler_cls, "update", self._scaler.update)
        self._wrap(scaler_cls, "unscale_", self._scaler.unscale_)
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            self._wrap(torch.nn.utils, name, self._clip.clip)
        self._wrap(torch.utils.checkpoint, "checkpoint", self._checkpoint.checkpoint)
        self._wrap(torch.optim.Optimizer, "__init__", steps.optimizer_init)
        # The module trees change: a close walks them again only then (`pile_watch`).
        module_hooks = torch.nn.modules.module
        note = self.registry.note_tree_change
        for register in (
            module_hooks.register_module_module_registration_hook,
            module_hooks.register_module_parameter_registration_hook,
            module_hooks.register_module_buffer_registration_hook,
        ):
            self._handles.append(register(note))
        self._wrap(torch.nn.Module, "_apply", self._wrap_module_apply)
        if hasattr(module_hooks, "_has_any_global_hook"):
            self._wrap(module_hooks, "_has_any_global_hook", global_hooks_but_ours)

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
                self.gate.parameters_found()
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
                self.gate.parameters_found()
        else:
            raise ValueError(f"no hook kind {kind!r}")

    def remove(self) -> None:
        """Undo `install()`: global, per-root and per-parameter hooks, wrapped functions."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.roots.remove()
        unpack_samplers.clear()
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()
        try:
            self.arming.disarm()
        except RuntimeError:
            pass

    def _wrap(self, owner: Any, name: str, make: Callable[[Wrapper], Wrapper]) -> None:
        original = getattr(owner, name)
        wrapper: Any = make(original)
        wrapper.__wrapped__ = original
        for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
            try:
                setattr(wrapper, attribute, getattr(original, attribute))
            except (AttributeError, TypeError):
                pass
        setattr(owner, name, wrapper)
        self._restore.append((owner, name, original))

    @property
    def owner_thread(self) -> int:
        """The thread followed now."""
        return self.thread.ident

    def _thread_moved(self, old: int) -> None:
        """The first optimizer step came from another thread than the one followed so far: the
        agent follows that thread from here (`training_thread`; this runs there, under its
        lock). What the old thread registered is its own and leaves: its models, optimizers,
        root and gradient hooks (a model the new thread runs too comes back at its next
        forward, under the same names). The open step's forwards ran where the agent was not
        looking (not known), and its losses were the old thread's; the pair on the old thread
        stays there, ignored."""
        try:
            phase = self.job_phase
            self._stack.clear()
            phase.root_depth = 0
            phase.in_backward = 0
            phase.in_optimizer = False
            self.arming.leave_thread(old)
            self.arming.unhook_grads()  # torch calls a copy of a tensor's hooks: safe mid-backward
            self.roots.remove()  # likewise, a module's hooks
            self.registry.forget_objects()
            self._seen_params.clear()
            self.window.forget_losses()
            self.gate.thread_moved()
        except Exception as exc:
            # Runs inside the job's optimizer.step() (`TrainingThread.claim`): never raises
            # there. Half forgotten, the old thread's tensors could still be read: every hook
            # turns off (said once), the job goes on unrecorded.
            for kind in self.enabled:
                self.enabled[kind] = False
            self._fail("hook:thread", exc)

    # ----- what the agent reads -----------------------------------------------------------------

    def phase(self) -> Phase:
        """The training phase right now."""
        return self.job_phase.now()

    @property
    def error_context(self) -> ErrorContext | None:
        """Where the exception now propagating was first seen."""
        return self.job_phase.error_context

    def tick(self) -> schema.Tick:
        """Live piles for the emitter's once-a-second heartbeat."""
        return schema.Tick(
            time=time.time(),
            piles=self.piles.current(),
            phase=self.job_phase.now(),
            step=self.window.closed,
        )

    # ----- module hooks ----------------------------------------------------------------------

    def _module_pre(self, module: Any, args: Any) -> None:
        # Only the followed thread (`training_thread`) is seen: its module stack is what
        # activations are attributed to. Other threads (DataParallel replicas, a second
        # forward thread, a second model trained beside it) would corrupt the stack and
        # register throwaway replicas.
        # While torch.compile traces, hooks must do nothing dynamo cannot trace (a call such as
        # get_ident() would break the graph and leave the model running eagerly).
        if is_compiling() or not self.enabled["modules"] or get_ident() != self.thread.ident:
            return
        try:
            registry = self.registry
            module_id = registry.known_id(module)
            if module_id is None or registry.generation != self._synced_generation:
                # A new tree, or new objects to hook: done only while this thread is followed
                # (`TrainingThread.following`), never after the agent moved to another.
                with self.thread.following() as followed:
                    if not followed:
                        return
                    module_id = registry.lookup(module)
                    if registry.generation != self._synced_generation:
                        self.new_objects()
            stack = self._stack
            if not stack:
                self.job_phase.in_optimizer = False
                if self.arming.pack_missing and _current_graph_task_id() == -1:
                    # An outermost forward under the job's own saved-tensor hooks (checkpoint
                    # over the whole model, save_on_cpu): none of its tensors reach ours.
                    self.gate.forward_unseen()
            stack.append(module_id)
        except Exception as exc:
            self._disable("modules", exc)

    def _module_post(self, module: Any, args: Any, output: Any) -> None:
        if is_compiling() or not self.enabled["modules"] or get_ident() != self.thread.ident:
            return
        try:
            stack = self._stack
            if stack:
                # Hooks run from `_call_impl` itself only when forward raised; on success they
                # run from its inner function (an outer `except` block also sets exc_info()).
                if (
                    sys.exc_info()[1] is not None
                    and sys._getframe(1).f_code.co_name == "_call_impl"
                ):
                    self.job_phase.note_error(Phase.FORWARD, self.registry.name(stack[-1]))
                elif self.gate.probing:
                    self._health.module_output(stack[-1], args, output)
                stack.pop()
            if self._fsdp:
                self.data_parallel.module_returned(module)
        except Exception as exc:
            self._disable("modules", exc)

    # ----- saved tensors -----------------------------------------------------------------------

    def _pack(self, tensor: Any) -> Any:
        # The hottest function of the agent (every saved tensor): a parameter is recognised by
        # its exact type first, because `isinstance(x, Parameter)` runs a Python metaclass hook.
        if is_compiling() or not self.enabled["pack"]:
            return tensor
        if self.arming.left_on and get_ident() in self.arming.left_on:
            return tensor  # a pair left on a thread no longer followed
        try:
            origin = tensor._base
            if origin is None:
                origin = tensor
            kind = type(origin)
            if kind is Parameter or (kind is not Tensor and isinstance(origin, Parameter)):
                seen = self._seen_params.get(id(origin))
                if (seen is None or seen() is not origin) and not self._pack_parameter(origin):
                    return tensor  # FSDP's gathered parameter: kept as FSDP expects
                # A weight, never an activation: autograd keeps it as it would without hooks.
                return SavedWeight(tensor, tensor._version)
            stack = self._stack
            module = stack[-1] if stack else NO_MODULE
            plain = plain_storage(tensor)
            if plain is not None:  # almost every saved tensor: one storage
                key, nbytes, name, _storage = plain
                if not nbytes or not key >> 8:
                    return tensor  # holds no memory
                ledger = self.ledger
                ledger.acquire_activation(key, nbytes, name, module)
                one = SavedOne(tensor.detach(), key, ledger, tensor._version)
                # The node being built is the last one this thread numbered (the next number,
                # less one): a census finds what a retained graph holds from this record,
                # never by unpacking it.
                ledger.saved_nodes[id(one)] = (next_sequence_number() << NODE_SHIFT) | key
                return one
            infos = storages_of(tensor)
            keys = [info[0] for info in infos]
            saved = Saved(tensor.detach(), keys, self.ledger, tensor._version)
            for key, nbytes, dtype, _storage in infos:
                self.ledger.acquire_activation(key, nbytes, dtype, module)
            self.ledger.saved_nodes_multi[id(saved)] = (next_sequence_number() - 1, tuple(keys))
            return saved
        except Exception as exc:
            self._disable("pack", exc)
            return tensor

    def _pack_parameter(self, origin: Any) -> bool:
        """A parameter (or a view of one) not seen before: a weight, never an activation.
        False for FSDP's all-gathered parameter, whose memory is FSDP's (the shard is the
        weight) and which autograd must keep exactly as FSDP expects."""
        if self._fsdp and self.data_parallel.gathered_parameter(origin):
            return False
        # A parameter no module or optimizer has shown us yet: it is a weight.
        self._seen_params[id(origin)] = forget_when_freed(origin, self._seen_params)
        self.ledger.add(WEIGHTS, origin)
        return True

    # ----- gradients ---------------------------------------------------------------------------

    def _grad_ready(self, parameter: Any) -> None:
        if not self.enabled["grads"]:
            return
        try:
            grad = parameter.grad
            if grad is None:
                return
            plain = plain_storage(grad)
            if plain is None or not plain[1] or not plain[0] >> 8:
                self.ledger.add(GRADIENTS, grad)
                return
            key, nbytes, name, storage = plain
            # A view at an offset is not cached: the close derives its storage.
            cached = grad if grad.data_ptr() == key >> 8 else None
            self.ledger.claim(GRADIENTS, key, nbytes, name, storage, cached)
        except Exception as exc:
            self._disable("grads", exc)

    def _wrap_module_apply(self, original: Wrapper) -> Wrapper:
        def _apply(module: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(module, *args, **kwargs)
            finally:
                # `.to()`, `.half()`, `.cuda()`: parameters and buffers converted in place of
                # the old ones (`.data` swapped, `_buffers` written), no registration hook.
                self.registry.note_tree_change(module)

        return _apply

    # ----- new objects -------------------------------------------------------------------------

    def sync_objects(self) -> None:
        """Register and hook what appeared since the last look (new roots, optimizers)."""
        if self.registry.generation != self._synced_generation:
            self.new_objects()

    def new_objects(self) -> None:
        """A new model tree or optimizer appeared: count its weights and hook its parameters.

        Only on the followed thread (`Agent.watch` may be called on any): another thread would
        read the followed thread's gradients while its backward writes them. The followed
        thread does it at its next forward or close instead."""
        with self.thread.following() as followed:
            if not followed:
                return
            self._synced_generation = self.registry.generation
            self.roots.hook_roots()
            self.gate.parameters_found()
            self.data_parallel.discover(self.registry.live_roots())
            self.piles.resync()

    def before_close(self, step: int) -> None:
        """At a close (`steps.step_closer.CloseHooks`): hook parameters found since."""
        if (
            self.registry.generation != self._synced_generation
            or (step - 1) % HOOK_NEW_PARAMETERS_EVERY == 0
        ):
            self._synced_generation = self.registry.generation
            self.gate.parameters_found()

    # ----- data-parallel wrappers --------------------------------------------------------------

    def _set_fsdp(self, on: bool) -> None:
        """FSDP found (or its measurements off): the gathered parameters are sampled by the
        unpack hook, every step measured, the piles walked at every close."""
        self._fsdp = self.gate.fsdp = self.piles.walk_always = on
        unpack_samplers[:] = [self.data_parallel.sample_gathered] if on else []

    def distributed_at_close(self) -> schema.Distributed | None:
        """The wrappers' memory at a close (`steps.step_closer.CloseHooks`)."""
        return self.data_parallel.at_close()

    def _census_failed(self, exc: BaseException) -> None:
        """A census met an error: that census stopped there (its record says so), the next
        ones run; said once."""
        self._fail("census", exc, CENSUS_EFFECT)

    def _disable(self, component: str, exc: BaseException) -> None:
        self.enabled[component] = False
        self._fail(f"hook:{component}", exc)
