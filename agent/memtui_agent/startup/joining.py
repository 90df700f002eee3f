"""Starting the agent in a job that is already training: at a step boundary, on the thread that
steps its optimizer.

Two callers: `memtui attach` (`attach/inject.py`, from its bootstrap thread) and a process that a
monitored process started and that turned out to train (`startup/children.py`: a trainer a driver
started, a multiprocessing worker). Both need the same three moves, each one safe to make from
any thread while the job trains:

1. notice where the job's steps end, and which thread ends them: `Optimizer._optimizer_step_code`
   (the empty method torch calls at the end of every optimizer `step()`, for profilers) is
   replaced on the class, an atomic attribute change; in a job with no optimizer
   `torch.autograd.backward` is wrapped the same way. The global optimizer hook tables are not
   touched: torch iterates them while stepping, so adding to them from another thread could
   break the job's step. The training thread is the one that steps, never merely the first to
   run a module (a helper thread running an EMA model or an evaluation would be that);
2. after that thread's first step boundary, a global module forward pre-hook (torch copies that
   table before calling it) waits for that thread's next forward;
3. at that forward the public `start()` runs there, as `memtui run` would have started it, and
   the job's optimizers and models are handed to the agent: every later step is recorded whole.
   A forward inside the job's own saved-tensor hooks is passed over once, for a forward outside
   them; a job that runs every forward inside them (`save_on_cpu`) is joined at its next step.

`cancel()` undoes all of it at once, from any thread (`memtui detach` before the agent started).
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable
from threading import get_ident
from typing import TYPE_CHECKING, Any

import torch
from torch.compiler import is_compiling
from torch.nn.modules.module import register_module_forward_pre_hook

from memtui_agent.hooks.copy_safe import stand_in_for
from memtui_protocol import schema

if TYPE_CHECKING:  # for annotations only
    from torch.utils.hooks import RemovableHandle

STEP_CODE = "_optimizer_step_code"
"""The method torch's optimizers call at the end of each `step()`, empty, kept for profilers."""


def scan_heap() -> tuple[
    list[weakref.ref[torch.optim.Optimizer]], list[weakref.ref[torch.nn.Module]]
]:
    """One walk of the garbage collector's objects: every optimizer, and the outermost modules
    holding parameters they train (weakly: the agent keeps nothing of the job alive)."""
    optimizers: list[torch.optim.Optimizer] = []
    modules: list[torch.nn.Module] = []
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads `__class__`, which some objects turn into
        # a property that warns (torch.distributed.reduce_op) on the job's stderr.
        kind = type(obj)
        if issubclass(kind, torch.optim.Optimizer):
            optimizers.append(obj)
        elif issubclass(kind, torch.nn.Module):
            modules.append(obj)
    trained = {
        id(parameter)
        for optimizer in optimizers
        for group in optimizer.param_groups
        for parameter in group["params"]
    }
    inner = {id(child) for module in modules for child in module.children()}
    roots = [
        module
        for module in modules
        if id(module) not in inner and any(id(p) in trained for p in module.parameters())
    ]
    return [weakref.ref(o) for o in optimizers], [weakref.ref(m) for m in roots]


def job_step(optimizers: list[torch.optim.Optimizer]) -> int | None:
    """Steps the job has taken, from its optimizers' own counters (None when none keeps one).

    Only host values are read: a `step` on the GPU (capturable, fused) would make this wait for
    the device.
    """
    steps = []
    for optimizer in optimizers:
        for state in list(optimizer.state.values()):
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor) and step.device.type == "cpu" and step.numel() == 1:
                steps.append(int(step.item()))
            elif isinstance(step, (int, float)):
                steps.append(int(step))
    return max(steps) if steps else None


def top_saved_tensor_hooks() -> Any:
    """The saved-tensor hooks on top of this thread's stack (None: none pushed)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def in_backward() -> bool:
    """Autograd runs a backward on this thread (a checkpoint recomputing its forward): no
    moment to start or stop the agent, whose saved-tensor pair would land in the middle."""
    return bool(torch._C._current_graph_task_id() != -1)


class JoinAtNextStep:
    """Waits for the job's next step boundary, then starts the agent on the stepping thread.

    Args:
        optimizers, roots: what the job trains, if already known (weakly); found by
            `scan_heap()` at the start when both are empty.
        start: starts the agent (on the training thread); None when it could not.
        started: told the running agent, once it holds the job's objects.
        failed: told why the agent did not start.
        describe: the first frame's words, from the job's steps before the start (or None).
    """

    def __init__(
        self,
        optimizers: list[weakref.ref[torch.optim.Optimizer]],
        roots: list[weakref.ref[torch.nn.Module]],
        *,
        start: Callable[[], Any],
        started: Callable[[Any], None],
        failed: Callable[[str], None],
        describe: Callable[[int | None], str],
    ) -> None:
        self.optimizers = optimizers
        self.roots = roots
        self._start_agent = start
        self._started = started
        self._failed = failed
        self._describe = describe
        self.thread: int | None = None
        """The training thread: the first to end a step (an optimizer step, or a backward)."""
        self.stepped: list[weakref.ref[torch.optim.Optimizer]] = []
        """Optimizers that training thread stepped: the agent is handed those and the models
        they train, never another thread's (hooks/training_thread.py)."""
        self.boundary = False
        self.finished = False
        self._inside_only = False
        """Forwards after the boundary all ran inside the job's own saved-tensor hooks."""
        self._force = False
        self._lock = threading.Lock()
        self._pre: RemovableHandle | None = None
        self._step_code: Any = None
        self._step_code_wrapper: Any = None
        self._backward: Any = None
        self._backward_wrapper: Any = None
        self._in_backward = 0

    # ----- from any thread ----------------------------------------------------------------------

    def arm(self, by_optimizer: bool = True) -> None:
        """Watch for step boundaries: optimizer steps, or top-level backwards in a job without
        an optimizer. Only atomic attribute changes: safe while the job trains."""
        original = torch.optim.Optimizer.__dict__.get(STEP_CODE)
        if by_optimizer and callable(original):

            def step_code(optimizer: torch.optim.Optimizer) -> Any:
                result = original(optimizer)
                if is_compiling():  # a compiled step: nothing of ours inside its graph
                    return result
                try:
                    self._stepped(optimizer)
                except Exception as exc:  # never into the job's step
                    self._failed(f"{type(exc).__name__}: {exc}")
                return result

            stand_in_for(step_code, original)  # pickled by name, as the original (`copy_safe`)
            self._step_code, self._step_code_wrapper = original, step_code
            setattr(torch.optim.Optimizer, STEP_CODE, step_code)
            return
        backward = torch.autograd.backward

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            ident = get_ident()
            if self.finished or (self.thread is not None and ident != self.thread):
                return backward(*args, **kwargs)
            self._in_backward += 1
            try:
                return backward(*args, **kwargs)
            finally:
                self._in_backward -= 1
                if not self._in_backward:
                    try:
                        self._stepped(None)
                    except Exception as exc:  # never into the job's backward
                        self._failed(f"{type(exc).__name__}: {exc}")

        stand_in_for(wrapped, backward)  # pickled by name, as the original (`copy_safe`)
        self._backward, self._backward_wrapper = backward, wrapped
        torch.autograd.backward = wrapped

    def cancel(self) -> bool:
        """Undo everything now (the agent not started); False when it already started."""
        with self._lock:
            if self.finished:
                return False
            self.finished = True
        self._disarm()
        return True

    def _disarm(self) -> None:
        if self._pre is not None:
            self._pre.remove()
            self._pre = None
        optimizer_cls = torch.optim.Optimizer
        if self._step_code_wrapper is not None:
            if optimizer_cls.__dict__.get(STEP_CODE) is self._step_code_wrapper:
                setattr(optimizer_cls, STEP_CODE, self._step_code)
            self._step_code_wrapper = None
        if self._backward_wrapper is not None:
            if torch.autograd.backward is self._backward_wrapper:
                torch.autograd.backward = self._backward
            self._backward_wrapper = None

    # ----- on the job's threads -----------------------------------------------------------------

    def _stepped(self, optimizer: torch.optim.Optimizer | None) -> None:
        """A step ended on this thread (None: a backward, in a job without an optimizer): the
        first thread to end one is the training thread."""
        if self.finished:
            return
        ident = get_ident()
        with self._lock:
            if self.thread is None:
                self.thread = ident
            elif ident != self.thread:
                return
            first = not self.boundary
            self.boundary = True
            if self._inside_only:
                self._force = True  # a whole step ran inside the job's own hooks: join anyway
            if optimizer is not None and not any(ref() is optimizer for ref in self.stepped):
                self.stepped.append(weakref.ref(optimizer))
                if not any(ref() is optimizer for ref in self.optimizers):
                    self.optimizers.append(weakref.ref(optimizer))
            if first and not self.finished:
                self._pre = register_module_forward_pre_hook(self._module_pre)

    def _module_pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if self.finished or is_compiling() or get_ident() != self.thread or in_backward():
            return
        try:
            if top_saved_tensor_hooks() is not None and not self._force:
                self._inside_only = True  # the job's own saved-tensor hooks: wait for outside
                return
            with self._lock:
                if self.finished:
                    return
                self.finished = True
            self._disarm()
            self._join(module, args)
        except Exception as exc:
            self._failed(f"{type(exc).__name__}: {exc}")

    def _join(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """On the training thread, at a step boundary: start the agent and hand it the job."""
        agent = self._start_agent()
        if agent is None:
            self._failed("the agent did not start (see the job's stderr)")
            return
        if not self.roots:
            found, self.roots = scan_heap()
            known = {id(ref()) for ref in self.optimizers}
            self.optimizers += [ref for ref in found if id(ref()) not in known]
        parts = agent.parts
        optimizers = [o for o in (ref() for ref in self.optimizers) if o is not None]
        for optimizer in optimizers:
            if optimizer.state:
                # Its first step is long past: no forecast, no first-step growth for it, and
                # its own step count goes on from where the job is.
                parts.adopt_running_optimizer(optimizer, job_step([optimizer]) or 0)
        # Only what this thread trains is handed over: another thread's optimizer and model
        # are that thread's, and reading their gradients while it writes them crashes the job.
        # The model this forward runs is found by the module hook below; an optimizer of this
        # thread that did not step yet registers when it does.
        own = [o for o in (ref() for ref in self.stepped) if o is not None]
        trained = {id(p) for o in own for group in o.param_groups for p in group["params"]}
        for optimizer in own:
            agent.watch(None, optimizer)
        for root in (ref() for ref in self.roots):
            if root is not None and any(id(p) in trained for p in root.parameters()):
                agent.watch(root, None)
        # The scan above replaces the step window's own search at the first backward.
        trigger = schema.StepTrigger.OPTIMIZER if optimizers else schema.StepTrigger.BACKWARD
        steps_before = job_step(own or optimizers)
        parts.join_steps(
            trigger,
            steps_before,
            schema.Alert(kind=schema.AlertKind.ATTACHED, message=self._describe(steps_before)),
        )
        # The forward starting now: its module on the stack, as if the hooks had seen it begin.
        parts.feed_module_pre(module, args)
        self._started(agent)
