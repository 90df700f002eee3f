"""The one read-decode-deliver loop behind every source: a file, a growing file, a socket.

memray reads its file and its socket with one `Source::read`; so does memtui. Each source only
says how to get the next bytes (and what its own end means, by raising `StreamEnd`); decoding,
delivery in batches and the wording of damage are here, once.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

from memtui_protocol import schema, wire

CHUNK = 1 << 20
"""Bytes asked for per read, from a file or a socket."""

Sink = Callable[[list[schema.Message]], None]
Read = Callable[[], bytes | None]
"""The next bytes; b"" at the end of the input; None when nothing came yet (the reader waited)."""


class StreamEnd(Exception):
    """Raised by a reader or a sink: the stream is over, for `reason` (None: a clean end)."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason


def pump(read: Read, decoder: wire.FrameDecoder, sink: Sink, stop: threading.Event) -> str | None:
    """Read, decode and hand message batches to `sink` until the input ends or `stop` is set.

    Returns what went wrong on the way, in one line (None: a clean end): the frame the decoder
    could not read, or what a resynchronising decoder skipped and left unread.
    """
    try:
        while not stop.is_set():
            try:
                chunk = read()
            except wire.WireError as exc:  # a hole the decoder cannot resume after
                return stopped_at(exc, decoder)
            if chunk is None:
                continue
            batch: list[schema.Message] = []
            refused: wire.WireError | None = None
            try:
                batch.extend(decoder.feed(chunk) if chunk else decoder.finish())
            except wire.WireError as exc:
                refused = exc  # the frames before it in this chunk are still delivered
            if batch:
                sink(batch)
            if refused is not None:
                return stopped_at(refused, decoder)
            if not chunk:
                return damage_warning(decoder)
    except StreamEnd as end:
        return end.reason
    return None


FRAME_SLACK = wire.MAX_FRAME_BYTES + CHUNK
"""How far past its limit a bounded read goes to finish the frame the limit cut."""


def file_chunks(fd: int, decoder: wire.FrameDecoder, limit: int | None = None) -> Read:
    """A `Read` over a recording file that skips the holes of a sparse file.

    A file of 8 GiB apparent size may store 44 KiB: reading its holes' zeros took time in the
    apparent size. `SEEK_DATA` finds where stored data resumes, and the hole before it is
    handed to the decoder as skipped (`FrameDecoder.skip_hole`), so the work is in the bytes
    stored. Reads use `pread` from the reader's own offset; a file system that cannot tell
    holes reads as a plain file.

    `limit`: the input ends at that offset (the file's size when reading began), so a file
    its job still writes at 50 MB/s is read to where it was, not chased forever. A frame the
    limit cuts in two is still finished (its writer was mid-`write`), reading at most
    `FRAME_SLACK` further; what lies beyond is the next reader's.
    """
    offset = 0
    seek_data = getattr(os, "SEEK_DATA", None)

    def read() -> bytes:
        nonlocal offset
        size = CHUNK
        if limit is not None:
            if offset >= limit and (not decoder.pending or offset >= limit + FRAME_SLACK):
                return b""
            if offset < limit:
                size = min(size, limit - offset)  # up to the limit first, not beyond
        if seek_data is not None:
            try:
                start = os.lseek(fd, offset, seek_data)
            except OSError as exc:
                start = offset
                if exc.errno == errno.ENXIO:  # no data from here on: a hole to the end
                    start = max(offset, os.fstat(fd).st_size)
            if start > offset:
                decoder.skip_hole(start - offset)
                offset = start
            try:  # read up to the next hole, not into it
                size = min(size, max(1, os.lseek(fd, offset, os.SEEK_HOLE) - offset))
            except OSError:
                pass
        chunk = os.pread(fd, size, offset)
        offset += len(chunk)
        return chunk

    return read


def stopped_at(exc: wire.WireError, decoder: wire.FrameDecoder) -> str:
    """A frame the decoder cannot read (a newer version, a bad frame without resync)."""
    if decoder.frames == 0:
        return str(exc)
    return f"{exc}; showing the {decoder.frames} frames before it"


def damage_warning(decoder: wire.FrameDecoder) -> str | None:
    """What a resynchronising decoder skipped and what it left unread, in one line."""
    parts = []
    if decoder.damaged:
        regions = (
            "1 damaged region" if decoder.damaged == 1 else f"{decoder.damaged} damaged regions"
        )
        holes = (
            f", {decoder.hole_bytes:,} of them in holes of a sparse file, not read"
            if decoder.hole_bytes
            else ""
        )
        parts.append(
            f"{decoder.first_damage}; skipped {decoder.skipped_bytes} bytes ({regions}{holes}) "
            "and showed every valid frame around them"
        )
    if decoder.pending:
        parts.append(
            f"the last {decoder.pending} bytes are a partial frame (the writer stopped "
            "mid-frame); everything before them is shown"
        )
    return "; ".join(parts) or None
