"""Is this file a recording memtui can read? Its head, checked before anything is decoded."""

from __future__ import annotations

import os
from pathlib import Path

from memtui.errors import UserError
from memtui.input.frame_stream import CHUNK
from memtui.input.input_files import InputFileError, open_input
from memtui_protocol import schema, wire, written


class RecordingError(UserError):
    """The file is unusable as a recording; `str()` is the one line to show."""


def read_head(path: str | os.PathLike[str]) -> schema.Hello:
    """The job's hello, from the first chunk only: is this a recording we can read at all?

    Raises:
        RecordingError: as `read_recording` does for a file that is not a usable recording.
    """
    path = Path(path)
    decoder = wire.FrameDecoder()
    try:
        with open_input(path) as handle:
            head = handle.read(CHUNK)
    except InputFileError as exc:
        raise RecordingError(str(exc)) from None
    except OSError as exc:
        raise RecordingError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not head:
        raise RecordingError(f"{path}: empty file, not a recording")
    try:
        for message in decoder.feed(head):
            if not isinstance(message, schema.Hello):
                raise RecordingError(f"{path}: damaged (first message is not the job's hello)")
            return message
    except wire.WireError as exc:
        raise RecordingError(f"{path}: {exc}") from None
    raise RecordingError(f"{path}: truncated before its header was complete")


def writer_alive(hello: schema.Hello) -> bool:
    """Whether the process that wrote a recording (its hello's pid, on this host, started when
    the hello says) still runs: then a recording without a final frame is still being written.

    The one rule behind "running" versus "killed": `memtui report` says `job running` by it,
    and `memtui replay` follows such a recording as it grows, ending where the report would
    say killed (the process gone, no final frame). The rule itself is the protocol's
    (`memtui_protocol.written.writer_alive`), which a rerun's cleanup also asks.
    """
    return written.writer_alive(hello)
