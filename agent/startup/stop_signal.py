"""SIGTERM from memtui: the job's recording says it was stopped, not killed.

`memtui run` names a stop file in the job's `AgentConfig` and creates it just before it sends
SIGTERM (when the user quits the TUI while the job runs). The handler installed here (by the
runner for scripts and `-m`, by the bootstrap for `-- COMMAND`) records `End(status=stopped)`
when that file exists, then lets the signal kill the process as it would have without memtui.
"""

from __future__ import annotations

import os
import signal
from typing import Any


def record_stops(stop_file: str | None) -> None:
    """On SIGTERM after `memtui run` asked for the stop (it creates `stop_file` first), write
    `End(status=stopped)`, then die of SIGTERM as without memtui (exit 143).

    A job that sets its own SIGTERM handler replaces this one and keeps its own behaviour; a
    SIGTERM from anyone else finds no stop file and kills the job exactly as before.
    """
    if stop_file is None or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def on_sigterm(signum: int, frame: Any) -> None:
        try:
            # Left in place for the job's other processes; memtui removes it after the job.
            if os.path.exists(stop_file):
                from memtui_agent.startup import api

                api.stop(exit_code=128 + signum, stopped=True)
        except Exception:
            pass  # never into the job: it dies of the signal either way
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: nothing to install, nothing broken
        pass
