"""The hooks: they feed the ledger, follow the training phase and close steps.

Installed globally so that any script is instrumented without code changes: module forward
pre/post hooks, optimizer step pre/post hooks, saved-tensor default hooks on the thread that
starts the agent, post-accumulate-grad hooks on every discovered parameter, and thin wrappers
around `torch.autograd.backward` (to see the loss) and `GradScaler.step`/`scale` (to notice a
skipped update, which fires no optimizer hook). Every handle is kept and removed by `remove()`.

Each hook does constant-time work inside a `try`: an exception disables that hook, is reported
once, and never reaches the training code.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from threading import get_ident
from typing import Any

import msgspec
import torch
from torch import Tensor
from torch.compiler import is_compiling
from torch.nn import Parameter
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from memtui_agent.hooks.hook_arming import HookArming, forget_when_freed
from memtui_agent.hooks.library_wrappers import LibraryWrappers
from memtui_agent.hooks.root_calls import RootCalls
from memtui_agent.hooks.saved_tensors import Saved, SavedOne, SavedWeight, unpack, unpack_samplers
from memtui_agent.job.distributed import DistributedMemory
from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.job.optimizer_book import (
    OptimizerBook,
    OptimizerRecord,
    caller_frame,
    live_optimizers,
)
from memtui_agent.memory.gradient_batch import GradientBatch, gather
from memtui_agent.memory.ledger import (
    GRADIENTS,
    NO_MODULE,
    OPTIMIZER_STATE,
    WEIGHTS,
    Ledger,
    plain_storage,
    storages_of,
)
from memtui_agent.steps.activation_policy import FIRST_STEPS, ActivationPolicy
from memtui_agent.steps.failures import ErrorContext
from memtui_agent.steps.pending import PendingStep
from memtui_agent.steps.pile_watch import PileWatch
from memtui_agent.steps.step_closer import StepCloser
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig

MAX_LOSSES_PER_STEP = 256


class Tracker(LibraryWrappers, RootCalls):
    """Hook state for one process: phase, module stack, current step, pending losses."""

    def __init__(
        self,
        ledger: Ledger,
        emit: Callable[[Any], None],
        fail: Callable[[str, BaseException], None],
        config: AgentConfig | None = None,
    ) -> None:
        config = config if config is not None else AgentConfig()
        self.config = config
        """When saved-tensor hooks are armed (`--activations`: schema.ActivationMode)."""
        self.ledger = ledger
        self._emit = emit
        self._fail = fail
        self.registry = ModuleRegistry(emit)
        self.piles = PileWatch(self.registry, ledger)
        self.distributed = DistributedMemory()
        self._fsdp = False
        self.closer = StepCloser(ledger, self.registry, emit, config)
        self._scaled_backward = False
        self._unscaled = False
        self._warned_clip = False
        self._noted_checkpoint: set[str] = set()
        self.closed_steps = 0
        self.microbatches = 0
        self.step_started = time.time()
        self._stack: list[int] = []
        self._in_backward = 0
        self._in_optimizer = False
        self.optimizers = OptimizerBook()
        self.trigger: schema.StepTrigger | None = None
        """What closes steps: None until the first top-level backward or optimizer step."""
        self._held_skip: tuple[PendingStep, Any] | None = None
        self._losses: list[Any] = []
        self._scaled_loss: tuple[int, Any] | None = None
        self._scale: Any = None
        self._seen_params: dict[int, weakref.ref[Any]] = {}
        self._handles: list[Any] = []
        self._restore: list[tuple[Any, str, Any]] = []
        self.arming = HookArming(
            self._module_pre, self._module_post, self._pack, unpack, self._grad_ready
        )
        self.policy = ActivationPolicy(config.activations)
        self._root_hooked: dict[int, tuple[weakref.ref[Any], list[Any]]] = {}
        """id(root module) -> (weakref, its pre/post hook handles)."""
        self.gradient_summary: tuple[int, dict[str, schema.DtypeStat]] | None = None
        """The gradients pile at the last unarmed close (bytes, dtype inventory), counted
        outside the ledger; None when the ledger holds the gradients."""
        self._root_depth = 0
        """Root calls in progress on the training thread (a root called inside another counts
        as nested, not as a new top-level call)."""
        self.owner_thread = get_ident()
        self._synced_generation = 0
        self.enabled = {
            "modules": True,
            "pack": True,
            "grads": True,
            "steps": True,
            "loss": True,
            "scaler": True,
            "distributed": True,
            "activations": True,
        }
        self.error_context: ErrorContext | None = None
        self.pending_alerts: list[schema.Alert] = []

    # ----- install / remove -----------------------------------------------------------------

    def install(self) -> None:
        """Register every global hook; call on the thread that runs the forward.

        The first step is measured whatever the mode says (the models are found there); `off`
        arms only the module hooks that find them.
        """
        self.owner_thread = get_ident()
        self.arming.arm_modules()
        if self.policy.mode is not schema.ActivationMode.OFF:
            self.arming.push_pack()
            self.policy.first_armed()
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_post))
        self._wrap(torch.autograd, "backward", self._wrap_backward)
        scaler_cls = torch.amp.grad_scaler.GradScaler
        self._wrap(scaler_cls, "step", self._wrap_scaler_step)
        self._wrap(scaler_cls, "scale", self._wrap_scaler_scale)
        self._wrap(scaler_cls, "update", self._wrap_scaler_update)
        self._wrap(scaler_cls, "unscale_", self._wrap_scaler_unscale)
        for name in ("clip_grad_norm_", "clip_grad_value_"):
            self._wrap(torch.nn.utils, name, self._wrap_clip)
        self._wrap(torch.utils.checkpoint, "checkpoint", self._wrap_checkpoint)
        self._wrap(torch.optim.Optimizer, "__init__", self._wrap_optimizer_init)
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
                self._hook_new_parameters()
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
                self._hook_new_parameters()
        else:
            raise ValueError(f"no hook kind {kind!r}")

    def remove(self) -> None:
        """Undo `install()`: global, per-root and per-parameter hooks, wrapped functions."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for _ref, handles in list(self._root_hooked.values()):
            for handle in handles:
                handle.remove()
        self._root_hooked.clear()
        unpack_samplers.clear()
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()
        try:
            self.arming.disarm()
        except RuntimeError:
            pass

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        wrapper = make(original)
        wrapper.__wrapped__ = original
        for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
            try:
                setattr(wrapper, attribute, getattr(original, attribute))
            except (AttributeError, TypeError):
                pass
        setattr(owner, name, wrapper)
        self._restore.append((owner, name, original))

    # ----- phase -----------------------------------------------------------------------------

    def phase(self) -> str:
        """The training phase right now."""
        if self._in_optimizer:
            return schema.Phase.OPTIMIZER.value
        if self._in_backward:
            return schema.Phase.BACKWARD.value
        if self._stack or self._root_depth:
            return schema.Phase.FORWARD.value
        return schema.Phase.BETWEEN.value

    def _note_error(self, phase: str, where: str | None) -> None:
        """Remember where the exception now propagating started (first sighting wins).

        Only the exception's identity is kept, never the object: holding it would pin its
        traceback, and with it every frame's tensors (checkpointing raises through modules).
        """
        error = sys.exc_info()[1]
        noted = self.error_context
        if error is None or (noted is not None and noted.matches(error)):
            return
        self.error_context = ErrorContext.of(error, phase, where)

    # ----- module hooks ----------------------------------------------------------------------

    def _module_pre(self, module: Any, args: Any) -> None:
        # Only the thread that installed the saved-tensor hooks is followed: its module stack
        # is what activations are attributed to. Other threads (DataParallel replicas, a
        # second forward thread) would corrupt the stack and register throwaway replicas.
        # While torch.compile traces, hooks must do nothing dynamo cannot trace (a call such as
        # get_ident() would break the graph and leave the model running eagerly).
        if is_compiling() or not self.enabled["modules"] or get_ident() != self.owner_thread:
            return
        try:
            module_id = self.registry.lookup(module)
            if self.registry.generation != self._synced_generation:
                self._on_new_objects()
            stack = self._stack
            if not stack:
                self._in_optimizer = False
            stack.append(module_id)
        except Exception as exc:
            self._disable("modules", exc)

    def _module_post(self, module: Any, args: Any, output: Any) -> None:
        if is_compiling() or not self.enabled["modules"] or get_ident() != self.owner_thread:
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
                    self._note_error(schema.Phase.FORWARD.value, self.registry.name(stack[-1]))
                elif self.closer.health.watching_modules(self.closed_steps + 1):
                    self.closer.health.module_output(stack[-1], args, output)
                stack.pop()
            if self._fsdp and self.distributed.fsdp.is_fsdp_module(module):
                self._sample_gathered()  # before FSDP's own post-forward hook reshards
        except Exception as exc:
            self._disable("modules", exc)

    # ----- saved tensors -----------------------------------------------------------------------

    def _pack(self, tensor: Any) -> Any:
        # The hottest function of the agent (every saved tensor): a parameter is recognised by
        # its exact type first, because `isinstance(x, Parameter)` runs a Python metaclass hook.
        if is_compiling() or not self.enabled["pack"]:
            return tensor
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
                return SavedOne(tensor.detach(), key, ledger, tensor._version)
            infos = storages_of(tensor)
            saved = Saved(
                tensor.detach(), [info[0] for info in infos], self.ledger, tensor._version
            )
            for key, nbytes, dtype, _storage in infos:
                self.ledger.acquire_activation(key, nbytes, dtype, module)
            return saved
        except Exception as exc:
            self._disable("pack", exc)
            return tensor

    def _pack_parameter(self, origin: Any) -> bool:
        """A parameter (or a view of one) not seen before: a weight, never an activation.
        False for FSDP's all-gathered parameter, whose memory is FSDP's (the shard is the
        weight) and which autograd must keep exactly as FSDP expects."""
        if self._fsdp and self.distributed.fsdp.is_gathered_parameter(origin):
            self._sample_gathered()
            return False
        # A parameter no module or optimizer has shown us yet: it is a weight.
        self._seen_params[id(origin)] = forget_when_freed(origin, self._seen_params)
        self.ledger.add(WEIGHTS, origin)
        return True

    # ----- gradients ---------------------------------------------------------------------------

    def _hook_new_parameters(self) -> None:
        if self.arming.armed and self.policy.mode is not schema.ActivationMode.OFF:
            self.arming.hook_grads(self.registry.parameters())

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

    # ----- backward and loss -------------------------------------------------------------------

    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if get_ident() != self.owner_thread:
                return original(tensors, *args, **kwargs)
            outermost = self._in_backward == 0
            if outermost:
                self.microbatches += 1
                self._record_loss(tensors)
                self.closer.allocator.phase_ended("forward")
                self._stack.clear()
                self._in_optimizer = False
            self._in_backward += 1
            try:
                result = original(tensors, *args, **kwargs)
            except BaseException:
                self._note_error(schema.Phase.BACKWARD.value, None)
                raise
            finally:
                self._in_backward -= 1
            if outermost and self.trigger is not schema.StepTrigger.OPTIMIZER:
                self._backward_returned()
            return result

        return backward

    def _backward_returned(self) -> None:
        """A top-level backward returned in a job where no optimizer has stepped yet.

        Whether it ends a step depends on whether an optimizer will step: the first time, the
        heap is searched once for optimizers (created before the agent, or not yet stepped).
        With none, each top-level backward closes a step (manual updates, gradient analysis).
        """
        if not self.enabled["steps"]:
            return
        try:
            if self.trigger is None:
                found = live_optimizers()
                for optimizer in found:
                    self.registry.add_optimizer(optimizer)
                self.trigger = (
                    schema.StepTrigger.OPTIMIZER if found else schema.StepTrigger.BACKWARD
                )
            if self.trigger is schema.StepTrigger.BACKWARD:
                self.close_step(skipped=False)
        except Exception as exc:
            self._disable("steps", exc)

    def _record_loss(self, tensors: Any) -> None:
        if not self.enabled["loss"]:
            return
        try:
            if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1:
                return
            if len(self._losses) >= MAX_LOSSES_PER_STEP:
                return
            scaled = self._scaled_loss
            if scaled is not None and scaled[0] == id(tensors):
                self._scaled_backward = True
                self._losses.append(scaled[1])
            else:
                self._losses.append(tensors.detach())
        except Exception as exc:
            self._disable("loss", exc)

    # ----- optimizer hooks ---------------------------------------------------------------------

    def _optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.enabled["steps"]:
            return
        try:
            top_level = self.optimizers.enter(optimizer, caller_frame(1))
            if top_level:
                self._in_optimizer = True
                self.closer.allocator.phase_ended("backward")
                self._steps_close_at_optimizer()
            self.registry.add_optimizer(optimizer)
            if self.registry.generation != self._synced_generation:
                self._on_new_objects()
            record = self.optimizers.record(optimizer)
            if not record.forecasted:
                record.forecasted = True
                self.policy.measure_next(FIRST_STEPS - 1)  # this step is already under way
                # State some optimizers create up front (Adagrad) is not the first step's doing.
                self.ledger.sync(OPTIMIZER_STATE, self.registry.optimizer_state_tensors())
                # `args` is (optimizer, closure?): torch's step wrapper passes self first.
                closure = (len(args) > 1 and args[1] is not None) or bool(kwargs.get("closure"))
                self.closer.before_first_step(
                    optimizer, record, self.closed_steps + 1, self.current_piles(), closure
                )
        except Exception as exc:
            self._disable("steps", exc)

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.enabled["steps"]:
            return
        try:
            record = self.optimizers.get(optimizer)
            if record is not None and not record.first_step_done:
                growth = self.closer.after_first_step(optimizer, record)
                if growth is not None:
                    self.pending_alerts.append(growth)
            closed = self.optimizers.leave(optimizer, caller_frame(1))
            if closed is not None:
                self._in_optimizer = False
                self.close_step(skipped=False, record=closed)
        except Exception as exc:
            self._disable("steps", exc)

    def _wrap_optimizer_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            original(optimizer, *args, **kwargs)
            # An optimizer now exists: its step(), not backward, will close steps (an
            # accumulation window must not be cut at each backward before its first step).
            if self.enabled["steps"]:
                try:
                    self.policy.measure_next(FIRST_STEPS)
                    self._steps_close_at_optimizer()
                except Exception as exc:
                    self._disable("steps", exc)

        return __init__

    def _wrap_module_apply(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _apply(module: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return original(module, *args, **kwargs)
            finally:
                # `.to()`, `.half()`, `.cuda()`: parameters and buffers converted in place of
                # the old ones (`.data` swapped, `_buffers` written), no registration hook.
                self.registry.note_tree_change(module)

        return _apply

    def _steps_close_at_optimizer(self) -> None:
        """An optimizer exists or stepped: from now on steps close there, not at backward."""
        if self.trigger is schema.StepTrigger.BACKWARD and self.closed_steps:
            self.pending_alerts.append(
                schema.Alert(
                    kind="step_rule",
                    message=f"an optimizer appeared after {self.closed_steps} steps that were "
                    "closed by backward(): from here on each optimizer.step() closes a step",
                )
            )
        self.trigger = schema.StepTrigger.OPTIMIZER

    def _on_new_objects(self) -> None:
        """A new model tree or optimizer appeared: count its weights and hook its parameters."""
        self._synced_generation = self.registry.generation
        self._hook_roots()
        self._hook_new_parameters()
        self._discover_wrappers()
        self.resync()

    # ----- data-parallel wrappers --------------------------------------------------------------

    def _discover_wrappers(self) -> None:
        if not self.enabled["distributed"]:
            return
        try:
            self.distributed.discover(list(self.registry.live_roots()))
            if self.distributed.fsdp.active and not self._fsdp:
                self._fsdp = True
                unpack_samplers[:] = [self._sample_gathered]
        except Exception as exc:
            self._distributed_failed(exc)

    def _sample_gathered(self) -> None:
        try:
            self.distributed.fsdp.sample()
        except Exception as exc:
            self._distributed_failed(exc)

    def _distributed_at_close(self) -> schema.Distributed | None:
        if not self.enabled["distributed"]:
            return None
        try:
            return self.distributed.at_close()
        except Exception as exc:
            self._distributed_failed(exc)
            return None

    def _distributed_failed(self, exc: BaseException) -> None:
        """Turn the DDP/FSDP measurements off everywhere they run, reported once."""
        self._fsdp = False
        unpack_samplers.clear()
        self._disable("distributed", exc)

    # ----- closing a step ----------------------------------------------------------------------

    def resync(self, walk_all: bool = False) -> GradientBatch:
        """Recount the persistent piles from the objects themselves (at each step close).

        Weights and optimizer state are walked again only when they may have changed
        (`pile_watch`) or `walk_all` says so; gradients, new tensors at most steps, are read
        at every close. Returns the gradients, which the health check reads next.
        """
        registry = self.registry
        ledger = self.ledger
        watch = self.piles
        walk_all = walk_all or self._fsdp
        parameters = registry.parameters()
        for pile, key_of in ((WEIGHTS, watch.weights_key), (OPTIMIZER_STATE, watch.state_key)):
            key = key_of()
            if watch.due(pile, key, walk_all):
                if pile == WEIGHTS:
                    changed = ledger.sync(WEIGHTS, registry.weight_tensors(parameters))
                else:
                    changed = ledger.sync(OPTIMIZER_STATE, registry.optimizer_state_tensors())
                watch.walked(pile, key, key_of(), changed)
        armed = self.arming.armed
        if armed:  # the gradient hooks keep the ledger's pile: only the list is needed
            batch = GradientBatch(registry.gradients(parameters))
        else:
            batch = gather(parameters, watch.facts(parameters))
        summary = None
        if not armed:
            # Unarmed (`auto`, between measured steps): the step's fresh gradients are
            # counted without joining the ledger; joining costs a claim and a free callback
            # per gradient per step, most of an unmeasured step's cost.
            summary = batch.summary
            if summary is None or not ledger.pointers_elsewhere(GRADIENTS).isdisjoint(
                batch.pointers
            ):
                summary = ledger.summarize(GRADIENTS, batch.tensors)
        self.gradient_summary = summary
        if summary is None:
            ledger.sync(GRADIENTS, batch.tensors)
        return batch

    def close_step(
        self, skipped: bool, record: OptimizerRecord | None = None, scale_after: Any = None
    ) -> PendingStep:
        """Turn the current window into a step and start the next one.

        `record` is the optimizer whose top-level `step()` (or GradScaler skip) closes it; None
        when a backward closes it (a job with no optimizer). Returns the closed step, already
        handed to the emitter, except a skip, which waits for `GradScaler.update()`.
        """
        self.release_held_skip()
        if self.registry.generation != self._synced_generation or self.closed_steps % 64 == 0:
            # New objects, or a periodic look for parameters unfrozen since (their gradients
            # are counted by `resync` meanwhile; the hook only makes the timing exact).
            self._synced_generation = self.registry.generation
            self._hook_new_parameters()
        gradients = self.resync(walk_all=self.piles.begin_close())
        late = self.late_health()
        self.closed_steps += 1
        extra = list(self.pending_alerts)
        self.pending_alerts.clear()
        pending = self.closer.close(
            step=self.closed_steps,
            t_start=self.step_started,
            skipped=skipped,
            microbatches=self.microbatches,
            losses=self._losses,
            scale=self._scale,
            scale_after=scale_after,
            extra_alerts=extra,
            gradients=gradients.tensors,
            gradient_groups=gradients.groups,
        )
        pending.distributed = self._distributed_at_close()
        pending.late_alerts = late
        summary = self.gradient_summary
        if summary is not None:
            pending.end = msgspec.structs.replace(pending.end, gradients=summary[0])
            pending.dtypes = {**pending.dtypes, "gradients": summary[1]}
        self._close_activations(pending)
        if record is None:
            pending.closed_by = schema.StepTrigger.BACKWARD
        else:
            pending.optimizer = record.name
            pending.optimizer_step = record.steps
        if not skipped:
            self._emit(pending)
        self._losses = []
        self._scale = None
        self.microbatches = 0
        self._scaled_backward = False
        self._unscaled = False
        self.step_started = pending.t_end
        self.ledger.reset_step()
        return pending

    def late_health(self, wait: bool = False) -> list[schema.StepLate]:
        """Alerts of earlier steps whose GPU checks reached the host since (none on CPU)."""
        closer = self.closer
        found = closer.health.collect(closer.named_parameters, self.registry.name, wait)
        return [schema.StepLate(step=step, alerts=alerts) for step, alerts in found]

    def release_held_skip(self) -> None:
        """Emit a skipped step still waiting for its `GradScaler.update()`, as it is."""
        held, self._held_skip = self._held_skip, None
        if held is not None:
            self._emit(held[0])

    def current_piles(self) -> schema.Piles:
        """The piles now. Between measured steps the gradients are counted at each close
        outside the ledger (`resync`): the last close's count stands for them."""
        piles = self.ledger.current()
        summary = self.gradient_summary
        if summary is not None and not self.arming.armed:
            piles = msgspec.structs.replace(piles, gradients=summary[0])
        return piles

    def tick(self) -> schema.Tick:
        """Live piles for the emitter's once-a-second heartbeat."""
        return schema.Tick(
            time=time.time(),
            piles=self.current_piles(),
            phase=self.phase(),
            step=self.closed_steps,
        )

    def _disable(self, component: str, exc: BaseException) -> None:
        self.enabled[component] = False
        self._fail(f"hook:{component}", exc)
