"""What proves that memtui wrote a file, and whether a process still writes it.

memtui never deletes or overwrites a file it did not write. A regular file of ours under the
expected name is no proof: a shell redirect (`memtui run ... > run.memtui.log`) makes one, and so
does a user's own notes beside the recording. So a file is replaced or removed only when its
content proves it is memtui's and no process still writes it:

- a recording: memtui's magic, a format version, zero flags and a first frame whose CRC-32
  matches (the job's hello), as every recording the agent creates begins;
- `memtui run`'s log of the job's output (`<recording>.log`): its first bytes are
  `JOB_LOG_MARKER`, a line memtui writes before any of the job's output;
- still written: the writer holds an exclusive `flock` on its descriptor from the moment it
  creates the file until it closes it (`hold_as_writer`), so a file whose lock cannot be taken is
  live, on this machine or, through NFS' lock manager, on another; a recording whose hello names
  a process that still runs on this host is live too (a job that closed the agent's descriptor
  dropped its lock).

Standard library and msgspec only: the agent, `memtui run` and `export` share it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import zlib
from dataclasses import dataclass

import msgspec

from memtui_protocol import schema
from memtui_protocol.os_text import os_text
from memtui_protocol.runtime_dir import pid_alive
from memtui_protocol.safe_open import Replace
from memtui_protocol.wire import FRAME_HEADER, MAGIC, MAX_FRAME_BYTES, PREAMBLE

JOB_LOG_MARKER = b"# memtui: job output"
"""How `<recording>.log` begins: the first line memtui writes, before the job's output."""


@dataclass(frozen=True)
class Head:
    """What the start of a proven recording says."""

    version: int
    hello: schema.Hello | None
    """None for another format version, or a hello this memtui cannot decode."""


def recording_head(descriptor: int) -> Head | None:
    """The head of the recording open at `descriptor`; None when the bytes do not prove one."""
    start = os.pread(descriptor, PREAMBLE.size + FRAME_HEADER.size, 0)
    if len(start) < PREAMBLE.size + FRAME_HEADER.size:
        return None
    magic, version, flags = PREAMBLE.unpack_from(start)
    length, crc = FRAME_HEADER.unpack_from(start, PREAMBLE.size)
    if magic != MAGIC or flags != 0 or length > MAX_FRAME_BYTES:
        return None
    payload = os.pread(descriptor, length, len(start))
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    hello = None
    if version == schema.FORMAT_VERSION:
        try:
            message = msgspec.msgpack.decode(payload, type=schema.Message)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError):
            message = None
        hello = message if isinstance(message, schema.Hello) else None
    return Head(version, hello)


def marked_log(descriptor: int) -> bool:
    """Whether the file open at `descriptor` begins with memtui's job-log line."""
    return os.pread(descriptor, len(JOB_LOG_MARKER), 0) == JOB_LOG_MARKER


def hold_as_writer(descriptor: int) -> None:
    """Mark the file as being written, until the descriptor is closed (never raises: where the
    file system has no locks the hello's pid still says the recording is live)."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass


def writer_lock_taken(descriptor: int) -> bool | None:
    """Take the writer's lock ourselves: True when that worked (no writer; it stays ours until
    the descriptor closes), False when a writer holds it, None where locks do not work."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        return None
    return True


def writer_alive(hello: schema.Hello) -> bool:
    """Whether the process that wrote a recording (its hello's pid, on this host, started when
    the hello says) still runs."""
    here = os_text(os.uname().nodename)  # as the agent wrote it
    return hello.hostname == here and pid_alive(hello.pid, hello.process_create_time)


def replace_refusal(descriptor: int, shown: str, replaces: Replace) -> str | None:
    """Why the file open at `descriptor` may not be replaced under `replaces` (None: it may;
    for a recording or a log, its writer's lock is then held here until the descriptor closes).

    The caller has checked it is a regular file of ours (`safe_open`).
    """
    if replaces is Replace.NOTHING:
        return f"{shown}: exists; refusing to overwrite it"
    if replaces is Replace.OWN_FILE:
        return None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        return f"{shown}: exists and is not a regular file; refusing to overwrite it"
    head = recording_head(descriptor) if replaces is Replace.RECORDING else None
    if replaces is Replace.RECORDING and head is None:
        return f"{shown}: exists and is not a memtui recording; refusing to overwrite it"
    if replaces is Replace.JOB_LOG and not marked_log(descriptor):
        return f"{shown}: exists and is not a log memtui wrote; refusing to overwrite it"
    if still_written(descriptor, head):
        return f"{shown}: a running process still writes it; refusing to replace it"
    return None


def still_written(descriptor: int, head: Head | None) -> bool:
    """Whether a process still writes the file open at `descriptor` (see the module's
    docstring); when not, its lock is held here until the descriptor closes."""
    if writer_lock_taken(descriptor) is False:
        return True
    return head is not None and head.hello is not None and writer_alive(head.hello)
