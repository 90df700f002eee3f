"""Before `memtui run` opens its screen: wait until the job's agent speaks, or the job ends.

The agent starts when the job imports torch. A script that fails before that (a syntax error, a
missing module, a bad argument) has nothing to show: opening a full screen for it would hide the
error Python printed behind an empty monitor. So the screen opens only once the agent has begun
to record (or, without a recording, to serve its socket); until then the job's output is passed
to the terminal as it comes, and a job that ends first leaves its own error and exit code there,
as a plain `python script.py` would.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from memtui.commands.run_command import JobSpec
from memtui.terminal_text import terminal_safe
from memtui_protocol.runtime_dir import RuntimeDirError, live_sidecars

POLL_S = 0.05

Identity = tuple[int, int, int]
"""A file's (device, inode, change time): a recording the agent created anew differs from one
an earlier run left at the same name, even where the inode number was reused."""


class OutputSource(Protocol):
    """The started job, as this wait reads it (`JobProcess`)."""

    printed: int

    def lines_after(self, seen: int) -> list[str]: ...

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...


def _identity(path: Path) -> Identity | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_ctime_ns)


class AgentStart:
    """Whether the agent of a job about to start has begun, judged against what was there
    before: a recording file or session folder an earlier run left counts for nothing."""

    def __init__(self, spec: JobSpec) -> None:
        """Made before the job starts."""
        self.spec = spec
        self._before = self._files()
        self.echoed = 0
        """Lines of the job's output `wait_for_agent` has passed to the terminal so far."""

    def _files(self) -> dict[str, Identity | None]:
        recording = self.spec.recording
        if recording is None:
            return {}
        if not recording.is_dir():
            return {recording.name: _identity(recording)}
        try:
            names = [entry.name for entry in os.scandir(recording) if entry.is_file()]
        except OSError:
            return {}
        return {name: _identity(recording / name) for name in names}

    def started(self) -> bool:
        """Whether the agent has written a recording since, or serves this run's socket."""
        if self.spec.recording is None:
            try:
                return any(job.get("session") == self.spec.session for job in live_sidecars())
            except RuntimeDirError:
                return True  # the screen says what is wrong with the runtime folder
        now = self._files()
        return any(
            identity is not None and self._before.get(name) != identity
            for name, identity in now.items()
        )


NOTICE_AFTER_S = 1.0
"""A job still without its agent after this long is said to be waiting (a slow import)."""


def wait_for_agent(
    start: AgentStart,
    job: OutputSource,
    notice: str | None = None,
    echo: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Pass the job's output to the terminal until its agent has started (True) or the job
    has ended without one (False). `notice` is said once if that takes a while."""
    write = echo or _print
    seen = 0
    notice_at = time.monotonic() + NOTICE_AFTER_S
    while True:
        ended = job.poll() is not None
        if ended:
            job.wait()  # its output read to the end
        started = start.started()
        lines = job.lines_after(seen)
        seen += len(lines)
        for line in lines:
            write(line)
        start.echoed = seen
        if started or ended:
            return started
        if notice is not None and time.monotonic() >= notice_at:
            print(notice, file=sys.stderr, flush=True)
            notice = None
        sleep(POLL_S)


def _print(line: str) -> None:
    """A line of the job's output (stdout and stderr come merged), escaped as the screen's
    output pane escapes it."""
    print(terminal_safe(line), flush=True)
