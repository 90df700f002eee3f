"""The agent's side of `memtui attach PID` and `memtui detach PID` in a job started without memtui.

The bootstrap (`attach_boot.py`) calls `handle()` on a thread of its own. Nothing here runs
the agent on that thread: saved-tensor hooks are thread-local and must be pushed on the thread
that trains, and torch iterates its optimizer hook table while calling the hooks, so that table
may only change on the thread that steps. So attaching goes in three moves:

1. here, on the bootstrap thread: one walk of the garbage collector's objects finds the job's
   optimizers and the models they train (held weakly), then a global module forward pre-hook is
   registered (torch copies that table before calling its hooks, so adding one from another
   thread is safe);
2. the first thread to run a module forward is the training thread: there the hook starts
   watching for the end of the current step (a global optimizer step post-hook; in a job with no
   optimizer, the end of each top-level `backward()`);
3. at the first module forward after that boundary, outside any saved-tensor hooks of the job's
   own, the public `start()` runs on the training thread, exactly as `memtui run` would have
   started it there: every later step is recorded whole. Its first frame carries an `attached`
   alert naming the job's step.

Detaching is the same in reverse: at the next module forward on the training thread whose
saved-tensor hooks on top are the agent's, the agent writes `End` (status `detached`) and
removes every hook. Each move answers in the reply file that `memtui attach` waits on, and every
failure is answered there, never raised into the job.
"""

from __future__ import annotations

import gc
import threading
import weakref
from threading import get_ident
from typing import Any

import torch
from torch.compiler import is_compiling
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

from memtui_agent.startup import api
from memtui_protocol import schema
from memtui_protocol.attach import Action, Answer, AttachRequest, write_reply
from memtui_protocol.config import DEFAULT_METRICS_ADDR

_pending: Any = None
"""The attach or detach waiting for its moment (one at a time)."""


def handle(request: AttachRequest) -> None:
    """Run one request of `memtui attach` / `memtui detach` (on the bootstrap's thread)."""
    # What `start()` imports, imported here rather than on the training thread.

    if request.action is Action.DETACH:
        detach(request)
    else:
        attach(request)


def _reply_running(reply: str, agent: Any) -> None:
    write_reply(
        reply,
        Answer.RUNNING,
        "a memtui agent already runs in this process",
        socket=str(agent.socket_path) if agent.socket_path is not None else None,
        recording=str(agent.record) if agent.record is not None else None,
    )


def attach(request: AttachRequest) -> None:
    """Find the job's optimizers and models once, then wait for the next step boundary."""
    global _pending
    reply = request.reply
    agent = api.current()
    if agent is not None:
        _reply_running(reply, agent)
        return
    if _pending is not None and not _pending.finished:
        write_reply(reply, Answer.REFUSED, "another attach or detach is still waiting for the job")
        return
    optimizers, roots = scan_heap()
    _pending = Arming(request, optimizers, roots)
    _pending.arm()
    write_reply(reply, Answer.ARMED, "waiting for the job's next step")


def scan_heap() -> tuple[list[weakref.ref[Any]], list[weakref.ref[Any]]]:
    """One walk of the garbage collector's objects: every optimizer, and the outermost modules
    holding parameters they train (weakly: the agent keeps nothing of the job alive)."""
    optimizers = []
    modules = []
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


def job_step(optimizers: list[Any]) -> int | None:
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


def _top_saved_tensor_hooks() -> Any:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def _in_backward() -> bool:
    """Autograd runs a backward on this thread (a checkpoint recomputing its forward): no
    moment to start or stop the agent, whose saved-tensor pair would land in the middle."""
    return bool(torch._C._current_graph_task_id() != -1)


class Arming:
    """Hooks that wait for the job's next step boundary, then start the agent on its thread."""

    def __init__(
        self,
        request: AttachRequest,
        optimizers: list[weakref.ref[Any]],
        roots: list[weakref.ref[Any]],
    ) -> None:
        self.request = request
        self.reply = request.reply
        self.optimizers = optimizers
        self.roots = roots
        self.thread: int | None = None
        """The training thread: the first to run a module forward after the attach."""
        self.boundary = False
        self.cancelled = False
        self.finished = False
        self._pre: Any = None
        self._post: Any = None
        self._backward: Any = None
        self._wrapper: Any = None
        self._in_backward = 0
        self._lock = threading.Lock()

    def arm(self) -> None:
        """From the bootstrap thread: only the module pre-hook (torch copies that table)."""
        self._pre = register_module_forward_pre_hook(self._module_pre)

    def cancel(self) -> None:
        """`memtui detach` before the agent started: undone on the training thread."""
        self.cancelled = True
        if self.thread is None:
            self._finish(Answer.DETACHED, "the attach was cancelled before the agent started")

    def _module_pre(self, module: Any, args: Any) -> None:
        if self.finished or is_compiling():
            return
        try:
            ident = get_ident()
            if self.thread is None:
                with self._lock:  # two threads may run their first forward at once
                    if self.thread is not None:
                        return
                    self.thread = ident
                self._watch_boundary()
                return
            if ident != self.thread:
                return
            if self.cancelled:
                self._finish(Answer.DETACHED, "the attach was cancelled before the agent started")
            elif self.boundary and _top_saved_tensor_hooks() is None and not _in_backward():
                self._start(module, args)
        except Exception as exc:
            self._finish(Answer.REFUSED, f"{type(exc).__name__}: {exc}")

    def _watch_boundary(self) -> None:
        """On the training thread: notice where the current step ends."""
        if any(ref() is not None for ref in self.optimizers):
            self._post = register_optimizer_step_post_hook(self._optimizer_post)
            return
        original = torch.autograd.backward

        def backward(*args: Any, **kwargs: Any) -> Any:
            if get_ident() != self.thread:
                return original(*args, **kwargs)
            self._in_backward += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._in_backward -= 1
                if not self._in_backward:
                    self.boundary = True

        backward.__wrapped__ = original  # type: ignore[attr-defined]
        self._backward, self._wrapper = original, backward
        torch.autograd.backward = backward

    def _optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if get_ident() == self.thread:
            self.boundary = True

    def _disarm(self) -> None:
        for handle in (self._pre, self._post):
            if handle is not None:
                handle.remove()
        self._pre = self._post = None
        if self._wrapper is not None and torch.autograd.backward is self._wrapper:
            torch.autograd.backward = self._backward
        self._wrapper = None

    def _finish(self, state: Answer, message: str, **extra: Any) -> None:
        self.finished = True
        try:
            self._disarm()
        finally:
            write_reply(self.reply, state, message, **extra)

    def _start(self, module: Any, args: Any) -> None:
        """On the training thread, at a step boundary: the agent as `memtui run` starts it."""
        self.finished = True
        self._disarm()
        options = self.request.options
        agent = api.start(
            record=options.get("record"),
            argv=None,
            budget=options.get("budget"),
            nan_check=options.get("nan_check", schema.NanCheck.DEFAULT),
            metrics_port=_port(options.get("metrics_port")),
            metrics_addr=str(options.get("metrics_addr") or DEFAULT_METRICS_ADDR),
        )
        if agent is None:
            write_reply(
                self.reply, Answer.REFUSED, "the agent did not start (see the job's stderr)"
            )
            return
        tracker = agent.tracker
        optimizers = [o for o in (ref() for ref in self.optimizers) if o is not None]
        for optimizer in optimizers:
            if optimizer.state:
                # Its first step is long past: no forecast, no first-step growth for it, and
                # its own step count goes on from where the job is.
                record = tracker.optimizers.record(optimizer)
                record.forecasted = record.first_step_done = True
                record.steps = job_step([optimizer]) or 0
            agent.watch(None, optimizer)
        for root in (ref() for ref in self.roots):
            if root is not None:
                agent.watch(root, None)
        window = tracker.window
        # The scan above replaces the step window's own search at the first backward.
        window.trigger = schema.StepTrigger.OPTIMIZER if optimizers else schema.StepTrigger.BACKWARD
        steps_before = job_step(optimizers)
        if steps_before:
            window.closed = steps_before  # frames carry the job's own step numbers
        window.note(
            schema.Alert(kind=schema.AlertKind.ATTACHED, message=attached_message(steps_before))
        )
        # The forward starting now: its module on the stack, as if the hooks had seen it begin.
        tracker._module_pre(module, args)
        write_reply(
            self.reply,
            Answer.STARTED,
            "recording",
            socket=str(agent.socket_path) if agent.socket_path is not None else None,
            recording=str(agent.record) if agent.record is not None else None,
        )


def attached_message(steps_before: int | None) -> str:
    """The first frame's words: which step of the job it is (frames carry the job's numbers
    when its optimizer counts its steps, else they count from the attach)."""
    if steps_before is None:
        return (
            "attached at an unknown step of the job (its optimizer keeps no step count): "
            "steps are numbered from the attach"
        )
    if not steps_before:
        return "attached at step 1"
    earlier = "step 1 was" if steps_before == 1 else f"steps 1-{steps_before} were"
    return f"attached at step {steps_before + 1}: the job's {earlier} not recorded"


def detached_message(step: int, recorded: int) -> str:
    """What `memtui detach` prints: the job's own number of the last recorded step (as every
    frame, the TUI and the report number it), then how many steps the agent recorded."""
    if not recorded:
        return "detached before any step closed (nothing recorded)"
    counted = "1 step recorded" if recorded == 1 else f"{recorded} steps recorded"
    return f"detached after step {step} ({counted})"


def detach(request: AttachRequest) -> None:
    """Stop the agent and remove every hook at the next module forward of the training thread."""
    global _pending
    reply = request.reply
    waiting = _pending
    if isinstance(waiting, Arming) and not waiting.finished:
        waiting.cancel()
        return
    agent = api.current()
    if agent is None:
        write_reply(reply, Answer.REFUSED, "no memtui agent runs in this process")
        return
    if isinstance(waiting, Detaching) and not waiting.finished:
        write_reply(reply, Answer.DETACHING, "a detach is already waiting for the job")
        return
    _pending = Detaching(agent, reply)
    _pending.arm()
    write_reply(reply, Answer.DETACHING, "waiting for the job's next forward")


class Detaching:
    """A module pre-hook that stops the agent on the thread whose saved-tensor hooks it owns."""

    def __init__(self, agent: Any, reply: str) -> None:
        self.agent = agent
        self.reply = reply
        self.finished = False
        self._pre = register_module_forward_pre_hook(self._module_pre)

    def arm(self) -> None:
        """Registered in `__init__`; kept for symmetry with `Arming`."""

    def _module_pre(self, module: Any, args: Any) -> None:
        if self.finished or is_compiling():
            return
        tracker = self.agent.tracker
        if get_ident() != tracker.owner_thread:
            return
        if not tracker.arming.pack_removable or _in_backward():
            return  # the job's own saved-tensor hooks are on top: popping now would pop theirs
        self.finished = True
        try:
            self._pre.remove()
            self.agent.detached = True
            window = tracker.window
            step, recorded = window.closed, window.recorded
            api.stop(exit_code=None)
            tracker.remove()  # `finish()` removes them only on the main thread
            write_reply(self.reply, Answer.DETACHED, detached_message(step, recorded))
        except Exception as exc:
            write_reply(self.reply, Answer.REFUSED, f"{type(exc).__name__}: {exc}")


def _port(value: Any) -> int | None:
    """`memtui attach --metrics-port`: a TCP port, or None (no endpoint)."""
    return value if isinstance(value, int) and 0 <= value <= 65535 else None
