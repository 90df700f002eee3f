"""Processes a monitored process starts: recorded once they train, or named.

A monitored process starts others all the time: DataLoader workers, compile workers, a
forkserver, and sometimes trainers (a driver that launches one trainer per configuration, a
multiprocessing Pool whose workers train). The first kind must not get agents of their own
(dozens of empty recordings, hooks in every worker); the second must be recorded. Which is which
is not known when a process starts, only once it trains. So a process that inherits monitoring
from another one (`MEMTUI_AGENT_OWNER` names another pid: a subprocess, a spawned worker) or is
forked from one (`os.register_at_fork`) starts no agent, only `JoinAtNextStep` (`joining.py`),
which costs nothing until an optimizer step ends in that process. Then the agent starts at the
process's next forward, recording into the session folder as `proc-N` (beside a single
recording, into `<recording>-ranks/`), and its first frame says which steps ran before it. A
process that trained but could not be recorded is named, once, in the notes `memtui run` prints
at the end ("pid N trained but was not recorded: why"), or on its stderr without `memtui run`
(`memtui_protocol.notes`).

Known limits: a child that trains without an optimizer is not noticed (only optimizer steps are); a
child's first step is not recorded (the agent starts at the end of it).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from memtui_protocol.config import AgentConfig
from memtui_protocol.notes import note
from memtui_protocol.safe_open import make_folder, session_folder_mode

if TYPE_CHECKING:  # the agent (and torch) load only when a child starts its own
    from memtui_agent.startup.agent import Agent

FORKED = "a forked child"


def follow_when_training(
    config: AgentConfig, origin: str, install_exit_handlers: bool = False
) -> None:
    """Start an agent here once this process trains (after torch is imported).

    Args:
        config: the agent's configuration (its `record` a file, a session folder or None).
        origin: how this process came to be, for the first frame (`started by pid 12`).
        install_exit_handlers: record the end of this process as the bootstrap does for the
            processes it arms (a fresh interpreter; a forked one inherited its parent's).
    """
    from memtui_agent.startup.joining import JoinAtNextStep

    pid = os.getpid()
    watch = JoinAtNextStep(
        [],
        [],
        start=lambda: _start(config, install_exit_handlers),
        started=lambda agent: None,
        failed=lambda why: note(f"pid {pid} trained but was not recorded: {why}"),
        describe=lambda steps_before: joined_message(steps_before, pid, origin),
    )
    watch.arm(by_optimizer=True)


def joined_message(steps_before: int | None, pid: int, origin: str) -> str:
    """The first frame's words in a process the agent joined when it trained."""
    who = f"pid {pid}, {origin}"
    if not steps_before:
        return f"recording started when this process trained ({who}); its steps before were not"
    earlier = "step 1 was" if steps_before == 1 else f"steps 1-{steps_before} were"
    return (
        f"recording started at step {steps_before + 1}, when this process was seen to train "
        f"({who}): its {earlier} not recorded"
    )


def record_path(record: str | None, metrics: bool = False) -> str | None:
    """Where a process the agent joined records: the next `proc-N` of the session folder, or
    of `<recording>-ranks/` beside a single recording (which is another process's file).

    Never `rank-N`: a worker inherits its rank's `RANK`, and that file is the rank's own.
    `metrics`: the folder, if made here, may be passed through by a Prometheus of another user.
    """
    if record is None:
        return None
    from memtui_agent.startup.autostart import claim_process_index

    folder = record if os.path.isdir(record) else record + "-ranks"
    make_folder(folder, session_folder_mode(metrics))  # its mode explicit, whatever the umask
    return os.path.join(folder, f"proc-{claim_process_index(folder)}.memtui")


def _start(config: AgentConfig, install_exit_handlers: bool) -> Agent | None:
    """On the training thread: the agent, recording this process; None if it did not start."""
    from memtui_agent.startup import api, autostart

    record = record_path(config.record, config.metrics_port is not None)
    if install_exit_handlers and not api.exit_owned:
        autostart.record_process_end()
    agent = api.start(config=config.replace(record=record, argv=None))
    if agent is None:
        return None
    os.environ[autostart.OWNER_VARIABLE] = str(os.getpid())
    os.environ[autostart.OWNER_RANK_VARIABLE] = os.environ.get("LOCAL_RANK", "0")
    _end_with_multiprocessing()
    return agent


def _end_with_multiprocessing() -> None:
    """A multiprocessing child started by fork leaves through `os._exit()`, which runs no
    `atexit`: its End is written by a multiprocessing finalizer instead, which runs as the
    child's `run()` returns or raises (the exception is the one being handled then)."""
    multiprocessing = sys.modules.get("multiprocessing")
    if multiprocessing is None or multiprocessing.parent_process() is None:
        return
    from multiprocessing import util

    util.Finalize(None, _stop_as_child_ends, exitpriority=0)


def _stop_as_child_ends() -> None:
    from memtui_agent.startup import api
    from memtui_agent.steps.failures import exit_code_of

    error = sys.exc_info()[1]
    if error is None:
        api.stop(exit_code=0)
    elif isinstance(error, SystemExit):
        api.stop(exit_code=exit_code_of(error), error=error)
    else:
        api.stop(exit_code=1, error=error)


def after_fork(parent: Agent) -> None:
    """In a process forked from one whose agent runs: that agent's hooks leave (the parent
    keeps its own) and this process is followed like any other child."""
    parent.disable_in_fork_child()
    config = AgentConfig.from_env(os.environ)
    if config.record is None and parent.config.record is not None:
        config = parent.config  # an agent started by hand: its recording, no session folder
    follow_when_training(config, f"{FORKED} of pid {parent.pid}")
