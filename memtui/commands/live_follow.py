"""`memtui run --headless --no-record`: the job's socket followed on a thread, so the end of the
run can say what a recording would have let it say (steps, peak, highest piles, alerts).

The stream is folded by the same `Session` the TUI uses (its bounded history included), from
the same socket a TUI viewer of a `--no-record` job reads: nothing is written anywhere.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from memtui.model.recording import Recording
from memtui.model.session import Session
from memtui_protocol import schema

CLOSED_BY_JOB = "the job closed its socket"
"""The stream's normal end (`LiveSource.run`)."""
JOIN_S = 5.0
"""How long the end of the run waits for the socket's last frames after the job exited."""


class LiveFollower:
    """The job of one `memtui run` session (its token), followed from its agent's socket."""

    def __init__(self, token: str, job_exited: Callable[[], bool]) -> None:
        from memtui.commands.tui_commands import SessionSocketSource

        self._session = Session(live=True)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._source = SessionSocketSource(token, job_exited)
        self.lost: str | None = None
        """Why the socket stopped before the job closed it (a viewer that fell behind is
        dropped): the summary then covers only what it delivered."""
        self._thread = threading.Thread(target=self._run, name="memtui-follow", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            why = self._source.run(self._sink, self._stop)
        except Exception as exc:  # a summary is a nicety: never a traceback at the end
            why = str(exc)
        if why is not None and why != CLOSED_BY_JOB:
            self.lost = why

    def _sink(self, batch: list[schema.Message]) -> None:
        with self._lock:
            self._session.ingest(batch)

    def finish(self) -> Recording | None:
        """What was followed, once the job has exited (its socket closes; at most `JOIN_S`)."""
        self._thread.join(JOIN_S)
        self._stop.set()
        with self._lock:
            return self._session.recording
