"""The agent's configuration: one struct, passed whole from the command line to the hooks.

`memtui run` builds an `AgentConfig` from its flags and hands it to the job as environment
variables (`to_env`); the job's runner or bootstrap reads it back (`from_env`) and passes the
same object to `start()`, the `Agent`, the `Tracker` and the `StepCloser`. No layer re-spells
an option, so adding one means adding a field here and reading it where it acts.

Standard library and `schema` only: the viewer imports this module too, and never imports torch.
Reading the environment never raises: a value the job cannot use falls back to the default
(the agent must not break the job over a malformed variable).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from memtui_protocol.schema import ActivationMode, NanCheck
from memtui_protocol.units import MAX_SIZE

RECORD = "MEMTUI_RECORD"
SOCKET = "MEMTUI_SOCKET"
ARGV = "MEMTUI_ARGV"
BUDGET = "MEMTUI_BUDGET"
NAN_CHECK = "MEMTUI_NAN_CHECK"
RESET_PEAKS = "MEMTUI_RESET_PEAKS"
SNAPSHOT_ON_OOM = "MEMTUI_SNAPSHOT_ON_OOM"
ALLOC_EVENTS = "MEMTUI_ALLOC_EVENTS"
ACTIVATIONS = "MEMTUI_ACTIVATIONS"
SESSION = "MEMTUI_SESSION"
METRICS_PORT = "MEMTUI_METRICS_PORT"
METRICS_ADDR = "MEMTUI_METRICS_ADDR"
METRICS_JOB = "MEMTUI_METRICS_JOB"
ERROR_FILE = "MEMTUI_ERROR_FILE"
VARIABLES = (
    RECORD,
    SOCKET,
    ARGV,
    BUDGET,
    NAN_CHECK,
    RESET_PEAKS,
    SNAPSHOT_ON_OOM,
    ALLOC_EVENTS,
    ACTIVATIONS,
    SESSION,
    METRICS_PORT,
    METRICS_ADDR,
    METRICS_JOB,
    ERROR_FILE,
)
"""Every variable `to_env` writes (a child that must not inherit a config drops these)."""

_E = TypeVar("_E", bound=Enum)
DEFAULT_METRICS_ADDR = "127.0.0.1"
"""Metrics are served on the loopback interface unless `--metrics-addr` says otherwise."""


@dataclass(frozen=True)
class AgentConfig:
    """What the agent does in one process.

    Attributes:
        record: recording path (a file, or a session folder resolved per process); None: none.
        socket: serve frames to live viewers on a private Unix socket.
        argv: the command line shown to viewers (None: the process's own `sys.argv`).
        budget: memory budget in bytes (`over_budget` alerts).
        nan_check: how much NaN/Inf checking each step gets.
        reset_peaks: CUDA: reset peak counters at each step and phase boundary.
        snapshot_on_oom: CUDA: dump a PyTorch memory snapshot beside the recording on OOM.
        alloc_events: CUDA: record the allocator's history into each step's frame.
        activations: when the saved-tensor hooks are armed (issue 15).
        session: the `memtui run` that started the job (groups ranks; finds the socket).
        metrics_port: serve Prometheus metrics on this port plus the process's `LOCAL_RANK`
            (None: no endpoint, nothing imported; 0: a free port per process).
        metrics_addr: the address the metrics endpoint binds to.
        metrics_job: the `job` label of the metrics (None: the session folder's name, else
            the recording's or the script's).
        error_file: where the runner also writes the job's final error, as it printed it on
            the job's stderr (`memtui run` with its TUI, where that stderr is in a pane: the
            error is printed again once the screen closes).
        record_in_folder: `record` is this process's file in a session folder, which must be
            private (ours, writable by nobody else). Decided in the process (`autostart`),
            never carried in the environment.
    """

    record: str | None = None
    socket: bool = True
    argv: tuple[str, ...] | None = None
    budget: int | None = None
    nan_check: NanCheck = NanCheck.DEFAULT
    reset_peaks: bool = False
    snapshot_on_oom: bool = False
    alloc_events: bool = False
    activations: ActivationMode = ActivationMode.AUTO
    session: str | None = None
    metrics_port: int | None = None
    metrics_addr: str = DEFAULT_METRICS_ADDR
    metrics_job: str | None = None
    error_file: str | None = None
    record_in_folder: bool = False

    def replace(self, **changes: object) -> AgentConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """The environment variables that carry this config into a child process."""
        env = {
            RECORD: self.record or "",
            SOCKET: "1" if self.socket else "0",
            NAN_CHECK: self.nan_check.value,
            RESET_PEAKS: _flag(self.reset_peaks),
            SNAPSHOT_ON_OOM: _flag(self.snapshot_on_oom),
            ALLOC_EVENTS: _flag(self.alloc_events),
            ACTIVATIONS: self.activations.value,
        }
        if self.argv is not None:
            env[ARGV] = json.dumps(list(self.argv))
        if self.budget is not None:
            env[BUDGET] = str(self.budget)
        if self.session is not None:
            env[SESSION] = self.session
        if self.metrics_port is not None:
            env[METRICS_PORT] = str(self.metrics_port)
            env[METRICS_ADDR] = self.metrics_addr
        if self.metrics_job is not None:
            env[METRICS_JOB] = self.metrics_job
        if self.error_file is not None:
            env[ERROR_FILE] = self.error_file
        return env

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> AgentConfig:
        """The config `to_env` wrote (defaults for anything missing or unusable)."""
        argv = None
        if environ.get(ARGV):
            try:
                argv = tuple(str(item) for item in json.loads(environ[ARGV]))
            except (ValueError, TypeError):
                argv = None
        budget = None
        text = environ.get(BUDGET) or ""
        if text.isascii() and text.isdigit() and len(text) <= 19:  # never a ValueError here
            budget = int(text) if int(text) <= MAX_SIZE else None
        return cls(
            record=environ.get(RECORD) or None,
            socket=environ.get(SOCKET, "1") != "0",
            argv=argv,
            budget=budget,
            nan_check=_member(NanCheck, environ.get(NAN_CHECK), NanCheck.DEFAULT),
            reset_peaks=environ.get(RESET_PEAKS) == "1",
            snapshot_on_oom=environ.get(SNAPSHOT_ON_OOM) == "1",
            alloc_events=environ.get(ALLOC_EVENTS) == "1",
            activations=_member(ActivationMode, environ.get(ACTIVATIONS), ActivationMode.AUTO),
            session=environ.get(SESSION) or None,
            metrics_port=_port(environ.get(METRICS_PORT)),
            metrics_addr=environ.get(METRICS_ADDR) or DEFAULT_METRICS_ADDR,
            metrics_job=environ.get(METRICS_JOB) or None,
            error_file=environ.get(ERROR_FILE) or None,
        )

    def oom_snapshot_path(self) -> str | None:
        """Where `snapshot_on_oom` dumps its pickle: beside the recording (None: nowhere)."""
        if not self.snapshot_on_oom or self.record is None:
            return None
        return self.record + ".oom-snapshot.pickle"


def _port(text: str | None) -> int | None:
    """A TCP port from the environment (None: absent or not one)."""
    if not text or not text.strip().isdigit():
        return None
    port = int(text)
    return port if port <= 65535 else None


def _flag(value: bool) -> str:
    return "1" if value else "0"


def _member(kind: type[_E], text: str | None, default: _E) -> _E:
    try:
        return kind(text) if text else default
    except ValueError:
        return default
