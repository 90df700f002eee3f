"""memtui stopped the job (quit from the TUI): say so in the job's recordings, from outside it.

memtui installs no SIGTERM handler in the job. A Python signal handler runs only between
bytecodes on the main thread, so one that wrote the recording's last frame held the job for as
long as its main thread stayed in C: seconds in a matmul, minutes in a gloo wait, forever in a
hung collective, where the job alone dies at once. memtui knows it sent the signal, so once the
job has ended it appends the final frame the agent could not write: `End(status=stopped)` to
each recording of the job that ends without one.

It does so only when that is honest and safe: the writer is dead (its pid gone, or reused by
another process), the file ends on a whole frame (a torn last frame stays as it is, and the
recording reads as killed, which it also was), and the file is the same regular file of ours
that was read, still the same size (`safe_open.open_own`: without following a link, without
blocking on a FIFO). Anything else leaves the file untouched.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from memtui.input.recording_file import RecordingError
from memtui.model.recording import read_recording
from memtui_protocol import schema, wire
from memtui_protocol.runtime_dir import pid_alive
from memtui_protocol.safe_open import open_own, own_file_refusal

STOPPED = "stopped from memtui (SIGTERM)"


def record_stop(recording: Path | None, code: int | None) -> int:
    """After memtui stopped the job that records to `recording` (a file, or a session folder
    of one file per process) and it exited with `code`: how many recordings now end stopped."""
    if recording is None:
        return 0
    try:
        folder = stat.S_ISDIR(os.lstat(recording).st_mode)
    except OSError:
        return 0
    if folder:  # each process's own exit code is unknown; the job's is the launcher's
        return sum(_append_stop(path, None) for path in sorted(recording.glob("*.memtui")))
    return int(_append_stop(recording, code))


def _append_stop(path: Path, code: int | None) -> bool:
    try:
        before = os.lstat(path)
        if own_file_refusal(path, before) is not None:
            return False
        recording = read_recording(path)
    except (OSError, RecordingError):
        return False
    if recording.end is not None or recording.warning is not None:
        return False  # the agent's own last word, or a torn tail: left as they are
    hello = recording.hello
    if pid_alive(hello.pid, hello.process_create_time):
        return False  # still running (it ignored SIGTERM): not stopped
    end = schema.End(
        time=time.time(),
        status=schema.ExitStatus.STOPPED,
        code=code,
        error=STOPPED,
        step=recording.steps[-1].step if recording.steps else None,
    )
    try:
        descriptor = open_own(path, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return False
    try:
        now = os.fstat(descriptor)
        same = (now.st_dev, now.st_ino, now.st_size) == (
            before.st_dev,
            before.st_ino,
            before.st_size,
        )
        if not same:
            return False
        os.write(descriptor, wire.encode(end))
    except OSError:
        return False
    finally:
        os.close(descriptor)
    return True
