"""One monitored process: ledger, hooks, emitter, socket and sidecar wired together.

The agent owns the recording: it writes the preamble and hello synchronously at start (so even a
job that dies at once leaves a readable file) and an `End` message at finish. A reader that finds
no `End` knows the process was killed.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket as _socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memtui_agent.memory.allocator import expandable_at_start
from memtui_agent.memory.finalizer_interrupts import keep_ctrl_c_for_the_job, restore_ctrl_c
from memtui_agent.memory.memory_readers import close_readers
from memtui_agent.output.logger_figures import LoggerFigures
from memtui_agent.startup.agent_state import NOT_STARTED, Parts
from memtui_agent.startup.end_frame import EndInputs, build_end
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig
from memtui_protocol.launch import launch_identity
from memtui_protocol.os_text import os_text
from memtui_protocol.runtime_dir import (
    Sidecar,
    ensure_private_dir,
    process_create_time,
    write_sidecar,
)
from memtui_protocol.schema import ExitStatus
from memtui_protocol.shown_text import terminal_safe

if TYPE_CHECKING:  # the agent imports torch only in `start()`
    from torch import nn
    from torch.optim import Optimizer

    from memtui_agent.output.emitter import Emitter, Item
    from memtui_agent.output.metrics import MetricsEndpoint


class Agent:
    """Everything that runs inside the training process."""

    def __init__(self, config: AgentConfig) -> None:
        self.pid = os.getpid()
        # Absolute, never resolved: resolving would follow a link planted at the name and
        # hand the create its target (memtui_protocol.safe_open).
        self.record = Path(os.path.abspath(config.record)) if config.record is not None else None
        self.argv = list(config.argv) if config.argv is not None else list(sys.argv)
        self.config = config.replace(
            record=str(self.record) if self.record is not None else None, argv=tuple(self.argv)
        )
        """The configuration, passed whole to the parts (`startup.parts.build_parts`)."""
        self._reported: set[str] = set()
        self._early: list[schema.AgentError] = []
        """Failures reported before the emitter existed (a refused runtime dir, say)."""
        self._finished = False
        self._forked_child = False
        self.detached = False
        """`memtui detach` stopped this agent while the job carries on: `End` says `detached`."""
        self.socket_path: Path | None = None
        self.sidecar: Path | None = None
        self.parts: Parts = NOT_STARTED
        """Every part of the agent, built by `start()` (`startup.parts.build_parts`)."""
        self.emitter: Emitter | None = None
        self.metrics: MetricsEndpoint | None = None
        """`--metrics-port`: the Prometheus endpoint (output/metrics.py)."""
        self.logger_figures = LoggerFigures()
        """The latest recorded step's figures for the job's own logger
        (`memtui_agent.integrations`)."""

    def start(self) -> None:
        """Import torch, install hooks, open the recording and the socket."""
        import torch

        from memtui_agent.output.emitter import Emitter
        from memtui_agent.output.socket_server import SocketServer
        from memtui_agent.startup.parts import build_parts

        started = time.time()
        device = _device_description()
        hello = schema.Hello(
            format_version=schema.FORMAT_VERSION,
            agent_version=_agent_version(),
            pid=self.pid,
            # What the OS handed Python may hold bytes that are not UTF-8 (os_text): the
            # hello, the sidecar and the metrics' labels carry them escaped, never fail on them.
            argv=[os_text(word) for word in self.argv],
            started=_dt.datetime.fromtimestamp(started, _dt.timezone.utc).isoformat(),
            started_unix=started,
            torch=str(torch.__version__),
            device=device,
            python=platform.python_version(),
            hostname=os_text(_socket.gethostname()),
            cwd=os_text(os.getcwd()),
            recording=os_text(str(self.record)) if self.record is not None else None,
            launch=launch_identity(os.environ),
            rank=_env_int("RANK"),
            local_rank=_env_int("LOCAL_RANK"),
            world_size=_env_int("WORLD_SIZE"),
            budget=self.config.budget,
            process_create_time=_create_time(),
            # Read once at start: an out-of-memory explanation says whether it was on.
            expandable_segments=expandable_at_start(device, dict(os.environ)),
        )
        server = None
        if self.config.socket:
            try:
                directory = ensure_private_dir()
                self.socket_path = directory / f"{self.pid}.sock"
                server = SocketServer(self.socket_path)
            except OSError as exc:
                self.report_failure("socket", exc)
                server = None
                self.socket_path = None
        try:
            self.parts = build_parts(self.config, self._emit, self.report_failure)
            self.emitter = Emitter(
                self.record,
                server,
                hello,
                self.report_failure,
                self._tick,
                private_folder=self.config.record_in_folder,
            )
            self.emitter.add_export("logger-figures", self.logger_figures.offer)
            self.parts.own_heap(self.emitter.held_bytes)
            early, self._early = self._early, []
            for error in early:
                self.emitter.put(error)
            self.parts.install()
            # A Ctrl-C that lands in the agent's finalizers would be dropped (Python ignores
            # exceptions there): kept for the job's code instead.
            keep_ctrl_c_for_the_job()
            if self.config.alloc_events:
                self.parts.arm_alloc_events(self.report_failure, self.note)
        except BaseException:
            # Leave nothing behind: no hooks in the job, no socket for viewers to find.
            self.parts.remove()
            if self.emitter is not None:
                self.emitter.close(timeout=1.0)
            elif server is not None:
                server.close()
            raise
        if self.socket_path is not None:
            try:
                self.sidecar = write_sidecar(
                    self.socket_path.parent,
                    str(self.pid),
                    Sidecar(
                        pid=self.pid,
                        argv=hello.argv,
                        started=hello.started,
                        started_unix=started,
                        socket=str(self.socket_path),
                        recording=hello.recording,
                        rank=hello.rank if hello.rank is not None and hello.rank >= 0 else None,
                        process_create_time=hello.process_create_time,
                        session=self.config.session,
                    ),
                )
            except OSError as exc:
                self.report_failure("sidecar", exc)
        if self.config.metrics_port is not None:
            try:
                self._serve_metrics(hello)
            except Exception as exc:  # the job and its recording go on without metrics
                self.report_failure("metrics", exc)

    def _serve_metrics(self, hello: schema.Hello) -> None:
        """`--metrics-port`: the emitter hands each recorded message to the exporter."""
        from memtui_agent.output.metrics import start_metrics

        self.metrics = start_metrics(self.config, hello, self.note)
        if self.metrics is not None and self.emitter is not None:
            self.emitter.add_export("metrics", self.metrics.offer)

    # ----- plumbing -----------------------------------------------------------------------------

    def _emit(self, item: Item) -> None:
        if self.emitter is not None and not self._forked_child:
            self.emitter.put(item)

    def _tick(self) -> schema.Tick | None:
        return self.parts.tick()

    def report_failure(
        self, component: str, exc: BaseException, effect: str = "is off for the rest of this run"
    ) -> None:
        """Say once, on stderr and in the stream, that a part of the agent failed, and what
        that costs (by default: it turned itself off)."""
        if component in self._reported:
            return
        self._reported.add(component)
        message = f"{type(exc).__name__}: {exc}"
        try:
            print(
                f"memtui: {component} failed and {effect} ({terminal_safe(message)}); "
                "the job continues",
                file=sys.stderr,
            )
        except Exception:
            pass
        self._stream(schema.AgentError(time=time.time(), component=component, message=message))

    def _stream(self, error: schema.AgentError) -> None:
        """Into the recording and to viewers; kept for the emitter if it does not exist yet.

        A failed recording still reaches viewers (the emitter skips a closed file).
        """
        if self.emitter is not None:
            self.emitter.put(error)
        elif not self._finished:
            self._early.append(error)

    def note(self, component: str, message: str) -> None:
        """Say once, on stderr and in the stream, that an option has no effect in this job."""
        if component in self._reported:
            return
        self._reported.add(component)
        try:
            print(f"memtui: {terminal_safe(message)}", file=sys.stderr)  # quotes user text
        except Exception:
            pass
        self._stream(schema.AgentError(time=time.time(), component=component, message=message))

    # ----- user-facing ------------------------------------------------------------------------

    def watch(self, model: nn.Module | None, optimizer: Optimizer | None) -> None:
        """Register a model tree and an optimizer ahead of their first use.

        Only from the thread the agent follows (hooks/training_thread.py): another thread's
        model is that thread's, and the agent must not read its gradients. The followed
        thread's own hooks find what it trains anyway."""
        self.parts.watch(model, optimizer)

    def finish(
        self,
        exit_code: int | None = 0,
        error: BaseException | None = None,
        stopped: bool = False,
        namespace: dict[str, Any] | None = None,
    ) -> None:
        """Write `End`, drain the emitter, remove hooks, socket and sidecar. Runs once.

        `namespace`: the script's globals once it returned, for the leaks' last count (any
        object of the job's: `Any`).
        """
        if self._finished or self._forked_child or os.getpid() != self.pid:
            return
        self._finished = True
        end = self._end_frame(exit_code, error, stopped, namespace)
        if self.emitter is not None:
            self.emitter.put(end)
        try:
            if threading.current_thread() is threading.main_thread():
                self.parts.remove()
                restore_ctrl_c()  # only if the agent's handler is still the one installed
        except Exception as exc:
            self.report_failure("remove-hooks", exc)
        try:
            self.parts.stop_sampling()
        except Exception as exc:
            self.report_failure("dataloader-workers", exc)
        if self.emitter is not None:
            self.emitter.close()
        if self.metrics is not None:
            self.metrics.close()
        close_readers()  # the agent leaves no file of its own open in the job
        if self.sidecar is not None:
            try:
                self.sidecar.unlink()
            except OSError:
                pass

    def _end_frame(
        self,
        exit_code: int | None,
        error: BaseException | None,
        stopped: bool,
        namespace: dict[str, Any] | None,
    ) -> schema.End:
        """The last readings of the run (each failure said once, costing only its own
        figures), then the `End` frame built from them."""
        parts = self.parts
        if parts.alloc_events_never_started():
            self.note(
                "alloc-events",
                "--alloc-events recorded nothing: the job never used CUDA (the CPU allocator "
                "keeps no history)",
            )
        # The job's tensors are read here only where the followed thread is not training
        # meanwhile (it is this thread, or it has ended): autograd writes gradients without
        # the GIL, and reading one it is writing crashes the job (hooks/training_thread.py).
        # A main thread that returns while its training thread goes on ends with the last
        # close's piles.
        readable = parts.readable_at_end()
        try:
            parts.settle_at_end(readable)
        except Exception as exc:
            self.report_failure("end-piles", exc)
        late: list[schema.StepLate] = []
        try:
            late = parts.late_health()
        except Exception as exc:
            self.report_failure("health", exc)
        leaks: list[schema.Leak] = []
        if readable:
            try:
                leaks = parts.final_leaks(namespace, error)
            except Exception as exc:
                self.report_failure("leaks", exc)
        try:
            return build_end(self._end_inputs(exit_code, error, stopped, late, leaks))
        except Exception as exc:
            return schema.End(time=time.time(), status=ExitStatus.ERROR, error=f"agent: {exc}")

    def _end_inputs(
        self,
        exit_code: int | None,
        error: BaseException | None,
        stopped: bool,
        late: list[schema.StepLate],
        leaks: list[schema.Leak],
    ) -> EndInputs:
        """What the end frame says, gathered from the parts (`startup.end_frame`)."""
        parts = self.parts
        position = parts.position()
        # The allocator's history is read only where the frame carries it: a job that returned
        # or raised, not one stopped or detached.
        plain_end = not stopped and not self.detached
        return EndInputs(
            time=time.time(),
            exit_code=exit_code,
            error=error,
            stopped=stopped,
            detached=self.detached,
            step=position.step,
            closed=position.closed,
            phase=position.phase,
            context=position.context,
            piles=position.piles,
            last_oom=parts.last_oom(),
            alloc_events=parts.unfinished_alloc_events() if plain_end else None,
            late=tuple(late),
            leaks=tuple(leaks),
        )

    def disable_in_fork_child(self) -> None:
        """Called in a forked child: nothing is written or sent, and the hooks leave this
        process (the parent keeps its own), so an agent of its own can start there cleanly."""
        self._forked_child = True
        if self.metrics is not None:
            self.metrics.forget_in_child()
        self.emitter = None
        self.parts.disable()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _create_time() -> float | None:
    """This process's start, as viewers compute it for a pid (a reused pid is another job)."""
    found = process_create_time(os.getpid())
    if found is not None:
        return found
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return None


def _device_description() -> str:
    """ "cuda" or "cpu", without creating a CUDA context (that would change the job); torch is
    imported already (`Agent.start`)."""
    import torch

    try:
        if torch.cuda.is_available():
            return "cuda"
    except Exception:
        pass
    return "cpu"


def _agent_version() -> str:
    from memtui_agent import __version__

    return __version__
