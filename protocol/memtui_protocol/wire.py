"""Framing shared by the recording file and the socket: one parser for both.

Layout: an 8-byte magic, a little-endian u16 format version and a u16 of flags (zero), then
frames. Each frame is a u32 payload length, a u32 CRC-32 of the payload, and a msgpack payload
holding one `schema.Message`. The CRC lets a reader tell a torn or bit-flipped tail from data,
and the length cap keeps a corrupt prefix from asking for gigabytes.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator

import msgspec

from memtui_protocol import schema
from memtui_protocol.os_text import carried

MAGIC = b"MEMTUI\x1a\n"
PREAMBLE = struct.Struct("<8sHH")
FRAME_HEADER = struct.Struct("<II")
MAX_FRAME_BYTES = 16 * 1024 * 1024
"""No legitimate frame comes near this; anything larger is corruption, not data."""

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(schema.Message)


NAMES_CHUNK_BYTES = min(1024 * 1024, MAX_FRAME_BYTES // 4)
"""Names are split into frames of about this many bytes of text, far under the reader's cap."""
MAX_NAME_CHARS = 4096
"""A longer name (no real module path comes near) is cut, so one name always fits a chunk."""


class WireError(ValueError):
    """The bytes are not a valid memtui stream. The message is one sentence for the user."""


class FrameTooLarge(ValueError):
    """A message would encode past `MAX_FRAME_BYTES`, which every reader refuses."""


def preamble(version: int = schema.FORMAT_VERSION) -> bytes:
    """The bytes that open every recording and every socket stream."""
    return PREAMBLE.pack(MAGIC, version, 0)


def encode(message: schema.Message) -> bytes:
    """One framed message, ready to append to a file or send on a socket.

    This is the one place every frame of the writer goes through, so the writer can never
    produce a frame its own reader rejects.

    Raises:
        FrameTooLarge: the payload is over `MAX_FRAME_BYTES`.
    """
    try:
        payload = _encoder.encode(message)
    except UnicodeEncodeError:  # a byte the OS smuggled into a str (os_text): carried escaped
        payload = _encoder.encode(carried(message))
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameTooLarge(
            f"a {type(message).__name__} frame of {len(payload):,} bytes is over the "
            f"{MAX_FRAME_BYTES:,}-byte frame cap; not written"
        )
    return FRAME_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


TAG_KEY = b"\xa4type"
"""Every payload is a msgpack map (fixmap, or map16 for the larger structs) whose first key is
the tagged union's tag field, so a frame start can be found by this key right after the map
header: a resynchronising reader looks there first instead of checking a CRC at every byte."""
RESYNC_WORK_PER_BYTE = 8
"""A resynchronising reader checksums at most this many bytes per byte received (plus one
frame cap), so crafted data full of plausible frame starts costs bounded time."""


def encode_frames(message: schema.Message) -> list[bytes]:
    """The frames for one message: a `Names` table is split into chunks, the rest is one frame.

    Raises:
        FrameTooLarge: a message other than `Names` is over the cap.
    """
    if isinstance(message, schema.Names):
        return [encode(chunk) for chunk in split_names(message)]
    return [encode(message)]


def split_names(message: schema.Names) -> list[schema.Names]:
    """`message` as consecutive tables of at most `NAMES_CHUNK_BYTES` of text each (ids kept)."""
    chunks: list[schema.Names] = []
    names: list[str] = []
    size = 0
    first_id = message.first_id
    for name in message.names:
        if len(name) > MAX_NAME_CHARS:
            name = name[: MAX_NAME_CHARS - 1] + "\N{HORIZONTAL ELLIPSIS}"
        cost = len(name.encode("utf-8", "surrogatepass")) + 5  # msgpack str header <= 5 bytes
        if names and size + cost > NAMES_CHUNK_BYTES:
            chunks.append(schema.Names(kind=message.kind, first_id=first_id, names=names))
            first_id += len(names)
            names, size = [], 0
        names.append(name)
        size += cost
    chunks.append(schema.Names(kind=message.kind, first_id=first_id, names=names))
    return chunks


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get messages out.

    The same object decodes a file read in chunks and a socket read as data arrives, so the two
    cannot disagree about the format.

    With `resync=True` (recordings on disk: a bit flip must not hide every later step) a
    damaged frame is skipped: the decoder looks for the next offset where a whole frame with a
    matching CRC-32 and a decodable payload starts, and counts the bytes it skipped
    (`skipped_bytes`, `damaged`, `first_damage`). The format has no per-frame magic, so a frame
    start is recognised by its tag key and confirmed by its checksum: a false match needs a
    32-bit CRC collision. Call `finish()` at end of input: a length that runs past the end is
    then known to be damage, not a frame still arriving.
    """

    def __init__(self, resync: bool = False) -> None:
        self._buffer = bytearray()
        self._pos = 0
        self._seen_preamble = False
        self._resync = resync
        self._seeking = False
        self._eof = False
        self._received = 0
        self._checked = 0
        self.version: int | None = None
        self.frames = 0
        self.bytes_consumed = 0
        self.skipped_bytes = 0
        self.damaged = 0
        self.first_damage: str | None = None
        self.hole_bytes = 0
        """Bytes of holes skipped (`skip_hole`), counted in `skipped_bytes` too."""

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame (a torn tail at end of file)."""
        return len(self._buffer) - self._pos

    def feed(self, data: bytes) -> Iterator[schema.Message]:
        """Decode every complete frame in `data` plus what was buffered before.

        Raises:
            WireError: on a wrong magic, an unsupported version, an impossible length, a CRC
                mismatch or a payload that is not a known message (with `resync`, only the
                first three before any frame, or when resynchronising has used its budget).
                Frames yielded before the error are valid.
        """
        if self._pos:
            del self._buffer[: self._pos]  # compact once per feed, not once per frame
            self._pos = 0
        self._buffer += data
        self._received += len(data)
        if not self._seen_preamble:
            if len(self._buffer) < PREAMBLE.size:
                if not MAGIC.startswith(bytes(self._buffer[: len(MAGIC)])):
                    raise WireError("not a memtui recording (wrong magic bytes)")
                return
            magic, version, _flags = PREAMBLE.unpack_from(self._buffer)
            if magic != MAGIC:
                raise WireError("not a memtui recording (wrong magic bytes)")
            if version != schema.FORMAT_VERSION:
                newer = "newer" if version > schema.FORMAT_VERSION else "older"
                raise WireError(
                    f"recording format version {version} is {newer} than the version this "
                    f"memtui reads ({schema.FORMAT_VERSION})"
                )
            self.version = version
            self._seen_preamble = True
            self._pos = PREAMBLE.size
            self.bytes_consumed += PREAMBLE.size
        yield from self._frames()

    def skip_hole(self, count: int) -> None:
        """The next `count` bytes of input are a hole of a sparse file, skipped unread.

        A hole is where the file system stores nothing (it reads as zeros): the agent never
        writes one, so none holds a frame, and a frame that reaches into one is damaged. With
        `resync` the hole is one damaged region, the bytes buffered before it (a frame it cuts)
        with it, and the next frame after it is searched for as after any damage; this costs
        nothing per byte of the hole, where reading its zeros cost its whole apparent size.

        Raises:
            WireError: without `resync`, or before the first frame (nothing to resume from).
        """
        if count <= 0:
            return
        at = self.bytes_consumed + self.pending
        reason = f"a hole of {count:,} bytes at byte {at:,} (a sparse file: nothing stored there)"
        if not (self._resync and self._seen_preamble and self.frames):
            raise WireError(f"corrupt frame {self.frames + 1}: {reason}")
        if not self._seeking:
            self.damaged += 1
            if self.first_damage is None:
                self.first_damage = reason
        self._seeking = True
        self._skip(self.pending)
        self.skipped_bytes += count
        self.bytes_consumed += count
        self.hole_bytes += count

    def finish(self) -> Iterator[schema.Message]:
        """No more input: with `resync`, skip a damaged length that runs past the end and
        decode any valid frames after it. What stays `pending` afterwards is a torn tail."""
        self._eof = True
        if not (self._resync and self._seen_preamble and self.frames):
            return
        seeking = self._seeking
        before = (self._pos, self.skipped_bytes, self.bytes_consumed, self.damaged)
        first_damage, frames = self.first_damage, self.frames
        yield from self._frames()
        if self.frames == frames:
            # Nothing valid after it: the tail is a frame the writer never finished (or, when
            # damage began before the end, more of the damaged region), not a new damage.
            self._pos, self.skipped_bytes, self.bytes_consumed, self.damaged = before
            self.first_damage, self._seeking = first_damage, seeking
            if seeking:
                self._skip(self.pending)

    def _frames(self) -> Iterator[schema.Message]:
        while True:
            if self._seeking and not self._seek():
                return
            result = self._frame_at(self._pos)
            if result is None:
                return
            if isinstance(result, str):
                if not self._resync or self.frames == 0:
                    raise WireError(result)
                self._damage(result)
                continue
            message, end = result
            self.bytes_consumed += end - self._pos
            self._pos = end
            self.frames += 1
            yield message

    def _frame_at(self, start: int) -> tuple[schema.Message, int] | str | None:
        """The frame at `start` and where it ends; a reason it is damaged; or None for a
        frame not yet complete."""
        buffer = self._buffer
        if len(buffer) - start < FRAME_HEADER.size:
            return None
        length, crc = FRAME_HEADER.unpack_from(buffer, start)
        number = self.frames + 1
        if length > MAX_FRAME_BYTES:
            return f"corrupt frame {number}: length {length} is impossible"
        end = start + FRAME_HEADER.size + length
        if len(buffer) < end:
            if self._eof and self._resync:
                return f"corrupt frame {number}: length {length} runs past the end"
            return None
        self._checked += length
        with memoryview(buffer) as view, view[start + FRAME_HEADER.size : end] as payload:
            if zlib.crc32(payload) != crc:
                return f"corrupt frame {number}: checksum mismatch"
            try:
                return _decoder.decode(payload), end
            except (
                msgspec.DecodeError,
                msgspec.ValidationError,
                UnicodeDecodeError,
                RecursionError,
            ) as exc:
                return f"corrupt frame {number}: {exc}"

    def _damage(self, reason: str) -> None:
        """Start skipping: the frame at the read position is damaged."""
        if not self._seeking:
            self.damaged += 1
            if self.first_damage is None:
                self.first_damage = reason
        self._seeking = True
        self._skip(1)

    def _skip(self, count: int) -> None:
        self._pos += count
        self.skipped_bytes += count
        self.bytes_consumed += count

    def _seek(self) -> bool:
        """Move to the next offset where a whole valid frame starts; False: need more input.

        Raises:
            WireError: the checksum budget is spent (crafted input, not a damaged file).
        """
        buffer = self._buffer
        while True:
            if self._checked > RESYNC_WORK_PER_BYTE * self._received + MAX_FRAME_BYTES:
                raise WireError(
                    f"{self.first_damage}; gave up looking for the next valid frame after "
                    f"{self.skipped_bytes} bytes"
                )
            key = buffer.find(TAG_KEY, self._pos + FRAME_HEADER.size + 1)
            if key < 0:
                # Keep the bytes that could still hold a frame start whose key is not in yet.
                keep = 0 if self._eof else FRAME_HEADER.size + 3 + len(TAG_KEY) - 1
                self._skip(max(0, len(buffer) - self._pos - keep))
                return False
            for start in (key - FRAME_HEADER.size - 3, key - FRAME_HEADER.size - 1):
                if start < self._pos:
                    continue
                result = self._frame_at(start)
                if result is None:
                    self._skip(start - self._pos)
                    return False
                if not isinstance(result, str):
                    self._skip(start - self._pos)
                    self._seeking = False
                    return True
            self._skip(key - FRAME_HEADER.size - 1 - self._pos + 1)
