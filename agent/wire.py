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

from memtui_agent import schema

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
    payload = _encoder.encode(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameTooLarge(
            f"a {type(message).__name__} frame of {len(payload):,} bytes is over the "
            f"{MAX_FRAME_BYTES:,}-byte frame cap; not written"
        )
    return FRAME_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


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
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._seen_preamble = False
        self.version: int | None = None
        self.frames = 0
        self.bytes_consumed = 0

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame (a torn tail at end of file)."""
        return len(self._buffer)

    def feed(self, data: bytes) -> Iterator[schema.Message]:
        """Decode every complete frame in `data` plus what was buffered before.

        Raises:
            WireError: on a wrong magic, an unsupported version, an impossible length, a CRC
                mismatch or a payload that is not a known message. Frames yielded before the
                error are valid.
        """
        self._buffer += data
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
            del self._buffer[: PREAMBLE.size]
            self.bytes_consumed += PREAMBLE.size
        while len(self._buffer) >= FRAME_HEADER.size:
            length, crc = FRAME_HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise WireError(f"corrupt frame {self.frames + 1}: length {length} is impossible")
            end = FRAME_HEADER.size + length
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[FRAME_HEADER.size : end])
            if zlib.crc32(payload) != crc:
                raise WireError(f"corrupt frame {self.frames + 1}: checksum mismatch")
            try:
                message = _decoder.decode(payload)
            except (
                msgspec.DecodeError,
                msgspec.ValidationError,
                UnicodeDecodeError,
                RecursionError,
            ) as exc:
                raise WireError(f"corrupt frame {self.frames + 1}: {exc}") from None
            del self._buffer[:end]
            self.frames += 1
            self.bytes_consumed += end
            yield message
