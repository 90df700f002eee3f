"""The hooks that mark a step's boundaries: backward, `optimizer.step()`, a GradScaler skip.

A top-level backward is a microbatch (its loss is the step's) and, in a job with no optimizer,
the end of a step; a top-level `optimizer.step()` ends one (a `step()` inside another's belongs
to the outer one, `job.optimizer_book`); so does a GradScaler skip, which fires no optimizer
hook. These hooks keep the training phase and report each boundary to the step window; an
optimizer's first `step()` is also reported to the activation gate (its first steps are
measured) and to `steps.first_step` (its state forecast and growth).
"""

from __future__ import annotations

from collections.abc import Callable
from threading import get_ident
from typing import TYPE_CHECKING

from memtui_agent.hooks.context import HookContext
from memtui_agent.hooks.library_wrappers import Wrapper
from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.job.optimizer_book import caller_frame, live_optimizers
from memtui_agent.memory.allocator import AllocatorReader
from memtui_agent.memory.ledger import OPTIMIZER_STATE
from memtui_agent.steps.first_step import FirstSteps
from memtui_protocol.schema import Phase, StepTrigger

if TYPE_CHECKING:  # for annotations only
    from torch.amp import GradScaler
    from torch.optim import Optimizer


def register_live_optimizers(registry: ModuleRegistry) -> bool:
    """Whether the job holds optimizers (built before the agent, or not stepped yet): one
    search of the heap, at the first backward that needs it. Those that train a parameter of
    the models this thread ran are registered; another thread's optimizer is not (its
    gradients are that thread's to write: `training_thread`), nor one over tensors no model
    holds, which registers when it steps here."""
    found = live_optimizers()
    if not found:
        return False
    mine = {id(parameter) for parameter in registry.parameters()}
    for optimizer in found:
        if any(
            id(parameter) in mine
            for group in optimizer.param_groups
            for parameter in group["params"]
        ):
            registry.add_optimizer(optimizer)
    return True


class StepHooks:
    """The backward wrapper, the optimizer step hooks and `Optimizer.__init__`'s wrapper."""

    def __init__(
        self,
        context: HookContext,
        first_steps: FirstSteps,
        allocator: AllocatorReader,
        sync_objects: Callable[[], None],
    ) -> None:
        """`sync_objects` registers and hooks what appeared since (new roots, optimizers);
        `context.thread` is the one followed: every other thread's backwards and steps pass
        through."""
        self._phase = context.phase
        self._window = context.window
        self._gate = context.gate
        self._first_steps = first_steps
        self._optimizers = context.optimizers
        self._registry = context.registry
        self._ledger = context.ledger
        self._piles = context.piles
        self._allocator = allocator
        self._sync_objects = sync_objects
        self._enabled = context.switches
        self._disable = context.switches.disable
        self._thread = context.thread

    # ----- backward and loss -------------------------------------------------------------------

    def backward(self, original: Wrapper) -> Wrapper:
        # `torch.autograd.backward`'s arguments, as the job passes them: handed on untouched
        # (the loss is read from `tensors` only if it is one tensor, `StepWindow.loss`).
        def backward(tensors: object, *args: object, **kwargs: object) -> object:
            thread = self._thread
            if get_ident() != thread.ident:
                return original(tensors, *args, **kwargs)
            phase = self._phase
            # Before and after the job's backward, only while this thread is still the followed
            # one (`TrainingThread.following`): the first optimizer step of another thread may
            # move the agent there meanwhile, and a close here would read that thread's
            # gradients. The backward itself runs outside the section.
            with thread.following() as followed:
                outermost = followed and phase.in_backward == 0
                if outermost:
                    self._window.backward_started()
                    self._record_loss(tensors)
                    self._allocator.phase_ended(Phase.FORWARD)
                    phase.stack.clear()
                    phase.in_optimizer = False
                    self._backward_starts(args, kwargs)
                if followed:
                    phase.in_backward += 1
            if not followed:  # the job's call, never inside the section
                return original(tensors, *args, **kwargs)
            try:
                result = original(tensors, *args, **kwargs)
            except BaseException:
                if thread.follows():
                    phase.note_error(Phase.BACKWARD, None)
                raise
            finally:
                with thread.following() as followed:
                    # A move meanwhile restarted the count on the new thread (`_thread_moved`).
                    if followed:
                        phase.in_backward -= 1
                        if outermost:
                            self._gate.backward_ended()
            if outermost and self._window.trigger is not StepTrigger.OPTIMIZER:
                with thread.following() as followed:
                    if followed:
                        self._backward_returned()
            return result

        return backward

    def _backward_starts(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        """Tell the gate (its counters, and whether this backward keeps its graph's buffers:
        `backward(tensors, grad_tensors, retain_graph, create_graph)`, retain defaulting to
        create)."""
        if not self._enabled["activations"]:
            return
        try:
            retain = kwargs.get("retain_graph", args[1] if len(args) > 1 else None)
            if retain is None:
                retain = kwargs.get("create_graph", args[2] if len(args) > 2 else False)
            self._gate.backward_starts(bool(retain))
        except Exception as exc:
            self._disable("activations", exc)

    def _record_loss(self, tensors: object) -> None:
        if not self._enabled["loss"]:
            return
        try:
            self._window.loss(tensors)
        except Exception as exc:
            self._disable("loss", exc)

    def _backward_returned(self) -> None:
        if not self._enabled["steps"]:
            return
        try:
            self._window.backward_returned()
        except Exception as exc:
            self._disable("steps", exc)

    # ----- optimizer hooks ---------------------------------------------------------------------

    def optimizer_pre(
        self, optimizer: Optimizer, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        if not self._enabled["steps"] or not self._thread.claim():
            return  # another thread's optimizer: its steps are not this recording's
        try:
            top_level = self._optimizers.enter(optimizer, caller_frame(1))
            if top_level:
                self._phase.in_optimizer = True
                self._allocator.phase_ended(Phase.BACKWARD)
                self._window.optimizer_exists()
            self._registry.add_optimizer(optimizer)
            self._sync_objects()
            record = self._optimizers.record(optimizer)
            if not record.forecasted:
                record.forecasted = True
                self._gate.first_step_begins()
                # State some optimizers create up front (Adagrad) is not the first step's doing.
                self._ledger.sync(OPTIMIZER_STATE, self._registry.optimizer_state_tensors())
                # `args` is (optimizer, closure?): torch's step wrapper passes self first.
                closure = (len(args) > 1 and args[1] is not None) or bool(kwargs.get("closure"))
                self._first_steps.before(
                    optimizer, record, self._window.number, self._piles.current(), closure
                )
        except Exception as exc:
            self._disable("steps", exc)

    def optimizer_post(
        self, optimizer: Optimizer, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        if not self._enabled["steps"] or get_ident() != self._thread.ident:
            return
        try:
            record = self._optimizers.get(optimizer)
            if record is not None and not record.first_step_done:
                growth = self._first_steps.after(optimizer, record)
                if growth is not None:
                    self._window.note(growth)
            closed = self._optimizers.leave(optimizer, caller_frame(1))
            if closed is not None:
                self._phase.in_optimizer = False
                self._window.optimizer_stepped(closed)
        except Exception as exc:
            self._disable("steps", exc)

    def scaler_skipped(self, optimizer: Optimizer, scaler: GradScaler) -> None:
        """GradScaler skipped `optimizer`'s update (no optimizer hook fired): its step closes."""
        self._registry.add_optimizer(optimizer)
        self._sync_objects()
        self._phase.in_optimizer = False
        self._window.scaler_skipped(self._optimizers.count_step(optimizer), scaler)

    def optimizer_init(self, original: Wrapper) -> Wrapper:
        # The job's own constructor arguments (parameters, hyperparameters), handed on.
        def __init__(optimizer: Optimizer, *args: object, **kwargs: object) -> None:
            original(optimizer, *args, **kwargs)
            # An optimizer now exists: its step(), not backward, will close steps. One another
            # thread builds once the followed thread steps is not this recording's.
            if self._enabled["steps"] and (self._thread.follows() or not self._thread.confirmed):
                try:
                    self._gate.optimizer_created()
                    self._window.optimizer_exists()
                except Exception as exc:
                    self._disable("steps", exc)

        return __init__
