"""The agent's side of `memtui attach PID` and `memtui detach PID` in a job started without memtui.

The bootstrap (`attach_boot.py`) calls `handle()` on a thread of its own. Nothing here runs
the agent on that thread: saved-tensor hooks are thread-local and must be pushed on the thread
that trains. So attaching finds the job's optimizers and models once (one walk of the garbage
collector's objects, held weakly), then `startup.joining.JoinAtNextStep` waits for the end of
the job's next optimizer step (or top-level backward, in a job without an optimizer) and starts
the agent at the next forward of the thread that stepped: every later step is recorded whole,
and the first frame carries an `attached` alert naming the job's step. A thread that only runs
modules (an EMA model, an evaluation) is never taken for the training thread.

An attach still waiting is cancelled by `memtui detach` (at once, from the bootstrap thread) and
replaced by a newer `memtui attach`. Detaching a running agent waits for the next module forward
on the training thread whose saved-tensor hooks on top are the agent's; the agent writes `End`
(status `detached`) and removes every hook. Each move answers in the reply file that `memtui
attach` waits on, and every failure is answered there, never raised into the job.
"""

from __future__ import annotations

from threading import get_ident
from typing import TYPE_CHECKING, Any

from torch.compiler import is_compiling
from torch.nn.modules.module import register_module_forward_pre_hook

from memtui_agent.startup import api
from memtui_agent.startup.joining import JoinAtNextStep, in_backward, scan_heap
from memtui_protocol import schema
from memtui_protocol.attach import Action, Answer, AttachRequest, write_reply
from memtui_protocol.config import DEFAULT_METRICS_ADDR

if TYPE_CHECKING:  # for annotations only
    import weakref

    import torch

    from memtui_agent.startup.agent import Agent

_pending: Arming | Detaching | None = None
"""The attach (`JoinAtNextStep`) or detach (`Detaching`) waiting for its moment."""


def handle(request: AttachRequest) -> None:
    """Run one request of `memtui attach` / `memtui detach` (on the bootstrap's thread)."""
    if request.action is Action.DETACH:
        detach(request)
    else:
        attach(request)


def _reply_running(reply: str, agent: Agent) -> None:
    write_reply(
        reply,
        Answer.RUNNING,
        "a memtui agent already runs in this process",
        socket=str(agent.socket_path) if agent.socket_path is not None else None,
        recording=str(agent.record) if agent.record is not None else None,
    )


class Arming(JoinAtNextStep):
    """An attach waiting for the job's next step boundary, answering in its reply file."""

    def __init__(
        self,
        request: AttachRequest,
        optimizers: list[weakref.ref[torch.optim.Optimizer]],
        roots: list[weakref.ref[torch.nn.Module]],
    ) -> None:
        self.request = request
        self.reply = request.reply
        options = request.options
        super().__init__(
            optimizers,
            roots,
            start=lambda: api.start(
                record=options.get("record"),
                argv=None,
                budget=options.get("budget"),
                nan_check=options.get("nan_check", schema.NanCheck.DEFAULT),
                metrics_port=_port(options.get("metrics_port")),
                metrics_addr=str(options.get("metrics_addr") or DEFAULT_METRICS_ADDR),
            ),
            started=self._answer_started,
            failed=lambda message: write_reply(self.reply, Answer.REFUSED, message),
            describe=attached_message,
        )

    def _answer_started(self, agent: Agent) -> None:
        write_reply(
            self.reply,
            Answer.STARTED,
            "recording",
            socket=str(agent.socket_path) if agent.socket_path is not None else None,
            recording=str(agent.record) if agent.record is not None else None,
        )


def attach(request: AttachRequest) -> None:
    """Find the job's optimizers and models once, then wait for the next step boundary.

    An attach still waiting is replaced: its hooks go, and the new request's options count.
    """
    global _pending
    reply = request.reply
    agent = api.current()
    if agent is not None:
        _reply_running(reply, agent)
        return
    waiting = _pending
    if isinstance(waiting, Arming) and waiting.cancel():
        write_reply(waiting.reply, Answer.REFUSED, "replaced by a newer memtui attach")
    elif isinstance(waiting, Detaching) and not waiting.finished:
        write_reply(reply, Answer.REFUSED, "a detach is still waiting for the job")
        return
    optimizers, roots = scan_heap()
    _pending = Arming(request, optimizers, roots)
    _pending.arm(by_optimizer=any(ref() is not None for ref in optimizers))
    write_reply(reply, Answer.ARMED, "waiting for the end of the job's next step")


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
    if isinstance(waiting, Arming) and waiting.cancel():
        write_reply(waiting.reply, Answer.REFUSED, "cancelled by memtui detach")
        write_reply(reply, Answer.DETACHED, "the attach was cancelled before the agent started")
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

    def __init__(self, agent: Agent, reply: str) -> None:
        self.agent = agent
        self.reply = reply
        self.finished = False
        self._pre = register_module_forward_pre_hook(self._module_pre)

    def arm(self) -> None:
        """Registered in `__init__`; kept for symmetry with `Arming`."""

    def _module_pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        if self.finished or is_compiling():
            return
        parts = self.agent.parts
        if get_ident() != parts.owner_thread():
            return
        if not parts.pack_removable() or in_backward():
            return  # the job's own saved-tensor hooks are on top: popping now would pop theirs
        self.finished = True
        try:
            self._pre.remove()
            self.agent.detached = True
            step, recorded = parts.steps_recorded()
            api.stop(exit_code=None)
            parts.remove()  # `finish()` removes them only on the main thread
            write_reply(self.reply, Answer.DETACHED, detached_message(step, recorded))
        except Exception as exc:
            write_reply(self.reply, Answer.REFUSED, f"{type(exc).__name__}: {exc}")


def _port(value: object) -> int | None:
    """`memtui attach --metrics-port`: a TCP port, or None (no endpoint)."""
    return value if isinstance(value, int) and 0 <= value <= 65535 else None
