"""Public API of the agent: `start`, `stop`, `watch`, `monitor`.

Zero-code use goes through `memtui run`, which calls the same `start()` from its runner or from the
bootstrap `sitecustomize`. By hand:

    import memtui_agent
    with memtui_agent.monitor(record="run.memtui"):
        train()

torch is imported only inside `start()`. Whatever goes wrong inside the agent is reported once on
stderr and in the stream, and the failing part turns itself off; the job is never interrupted.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from memtui_protocol.config import DEFAULT_METRICS_ADDR, AgentConfig
from memtui_protocol.schema import ActivationMode, NanCheck
from memtui_protocol.shown_text import terminal_safe

if TYPE_CHECKING:  # for the annotations only: torch is imported inside `start()`
    import torch

    from memtui_agent.startup.agent import Agent

_lock = threading.Lock()
_agent: Agent | None = None
_fork_hook_installed = False
_exit_hook_installed = False
exit_owned = False
"""True where something else records how the process ends (`memtui run -- COMMAND`)."""


def start(
    record: str | os.PathLike[str] | None = None,
    *,
    socket: bool = True,
    argv: list[str] | None = None,
    budget: int | None = None,
    nan_check: NanCheck | str = NanCheck.DEFAULT,
    reset_peaks: bool = False,
    snapshot_on_oom: bool = False,
    alloc_events: bool = False,
    activations: ActivationMode | str = ActivationMode.AUTO,
    metrics_port: int | None = None,
    metrics_addr: str = DEFAULT_METRICS_ADDR,
    metrics_job: str | None = None,
    config: AgentConfig | None = None,
) -> Agent | None:
    """Start monitoring this process (idempotent: a second call returns the running agent).

    The keyword arguments are the fields of `AgentConfig` (memtui_protocol/config.py); `config`
    passes them whole instead (what `memtui run` does), and then the others are ignored.

    Args:
        record: recording path; None records nothing.
        socket: serve frames to live viewers on a private Unix socket.
        argv: the command line shown to viewers (defaults to `sys.argv`).
        budget: memory budget in bytes: `over_budget` alerts when the tracked peak, or the
            forecast of the first optimizer step, exceeds it.
        nan_check: "default" (one fused check per step, module checks armed after an alarm),
            "full" (module outputs checked every step) or "off".
        reset_peaks: reset CUDA peak counters at each step and phase boundary (exact per-step
            and per-phase peaks; takes `max_memory_allocated()` away from the job's own code).
        snapshot_on_oom: on a CUDA out-of-memory, dump a PyTorch memory snapshot beside the
            recording (records allocation history, bounded to 100,000 entries).
        alloc_events: CUDA: record the allocator's history (bounded, Python stacks) and put
            each step's largest allocations with their source lines, segment growth and OOM
            event into its frame. A CPU job gets one note that this has no effect.
        activations: "auto" (measure steps that can differ, carry the figures of a measured
            step to the steps that repeat it), "every" (every step) or "off".
        metrics_port: serve Prometheus metrics at `/metrics` on this port plus `LOCAL_RANK`
            (needs `pip install 'memtui[metrics]'`; 0: a free port). None: no endpoint.
        metrics_addr: the address it binds to (default 127.0.0.1: this machine only).
        metrics_job: the `job` label (default: the session folder's or recording's name).

    Returns:
        The running `Agent`, or None if it could not start (the reason is printed once).
    """
    global _agent, _fork_hook_installed, _exit_hook_installed
    with _lock:
        if _agent is not None and _agent.pid == os.getpid():
            return _agent
        try:
            from memtui_agent.startup.agent import Agent

            if config is None:
                config = AgentConfig(
                    record=os.fspath(record) if record is not None else None,
                    socket=socket,
                    argv=tuple(argv) if argv is not None else None,
                    budget=budget,
                    nan_check=NanCheck(nan_check),
                    reset_peaks=reset_peaks,
                    snapshot_on_oom=snapshot_on_oom,
                    alloc_events=alloc_events,
                    activations=ActivationMode(activations),
                    metrics_port=metrics_port,
                    metrics_addr=metrics_addr,
                    metrics_job=metrics_job,
                )
            agent = Agent(config)
            agent.start()
        except Exception as exc:
            why = terminal_safe(f"{type(exc).__name__}: {exc}")
            print(f"memtui: agent not started ({why})", file=sys.stderr)
            return None
        _agent = agent
        if not _fork_hook_installed:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook_installed = True
        if not _exit_hook_installed and not exit_owned:
            atexit.register(_stop_at_exit)
            _exit_hook_installed = True
        return agent


def _stop_at_exit() -> None:
    """Finish an agent the job started by hand and never stopped, as the interpreter exits.

    The recording then ends with its `End` (an error if an exception ended the script), and the
    emitter thread is joined before finalisation rather than frozen mid-write.
    """
    if current() is None:
        return
    error = getattr(sys, "last_value", None)  # set when an uncaught exception ended the script
    stop(exit_code=1 if error is not None else 0, error=error)


def stop(
    exit_code: int | None = 0,
    error: BaseException | None = None,
    stopped: bool = False,
    namespace: dict[str, Any] | None = None,
) -> None:
    """Record how the job ended, flush the recording and remove every hook.

    `stopped`: memtui itself ended the job (SIGTERM after the user quit the TUI).
    `namespace`: the script's globals once it returned (runpy's result), where a leak's
    holder is counted one last time (any object of the job's: `Any`, so a caller's own
    `dict[str, X]` is accepted too).
    """
    global _agent
    with _lock:
        agent, _agent = _agent, None
    if agent is not None and agent.pid == os.getpid():
        agent.finish(exit_code=exit_code, error=error, stopped=stopped, namespace=namespace)


def current() -> Agent | None:
    """The agent running in this process, if any."""
    agent = _agent
    return agent if agent is not None and agent.pid == os.getpid() else None


def watch(
    model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Tell the agent about a model and an optimizer before they first run (optional).

    Global hooks find both on their own; watching early makes the weights visible before the
    first forward and makes `optimizer` the one whose `step()` closes steps.
    """
    agent = current()
    if agent is not None:
        agent.watch(model, optimizer)


@contextlib.contextmanager
def monitor(
    record: str | os.PathLike[str] | None = None,
    *,
    socket: bool = True,
    budget: int | None = None,
    nan_check: NanCheck | str = NanCheck.DEFAULT,
    activations: ActivationMode | str = ActivationMode.AUTO,
    metrics_port: int | None = None,
    metrics_addr: str = DEFAULT_METRICS_ADDR,
    metrics_job: str | None = None,
) -> Iterator[Agent | None]:
    """Monitor the enclosed block; an exception escaping it is recorded with its phase.

    The keywords are `start()`'s."""
    agent = start(
        record,
        socket=socket,
        budget=budget,
        nan_check=nan_check,
        activations=activations,
        metrics_port=metrics_port,
        metrics_addr=metrics_addr,
        metrics_job=metrics_job,
    )
    try:
        yield agent
    except BaseException as exc:
        stop(exit_code=_exit_code_of(exc), error=exc)
        raise
    else:
        stop(exit_code=0)


def _exit_code_of(exc: BaseException) -> int | None:
    if isinstance(exc, SystemExit):
        from memtui_agent.steps.failures import exit_code_of

        return exit_code_of(exc)
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return 1


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) must not feed or write the parent's recording; it
    is followed like any child a monitored process starts, and recorded if it trains
    (`children.py`). The lock is new: another thread of the parent may have held it."""
    global _lock
    _lock = threading.Lock()
    agent = _agent
    if agent is None or agent.pid == os.getpid():
        return
    try:
        from memtui_agent.startup import children

        children.after_fork(agent)
    except Exception:
        agent.disable_in_fork_child()  # at the least, as before
