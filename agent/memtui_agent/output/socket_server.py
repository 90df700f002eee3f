"""Serves frames to at most `MAX_VIEWERS` viewers on a Unix socket, without ever blocking.

Only the emitter thread calls into this class, and it shares the GIL with the training thread,
so every poll does bounded work: at most `ACCEPTS_PER_POLL` accepts and `SENDS_PER_POLL` buffers
per viewer. Memory does not grow with viewers: every frame is one immutable `bytes` in a shared
log bounded by `BACKLOG_FRAMES` and `BACKLOG_BYTES`, and a viewer is only a position in it (a
newcomer starts at the oldest frame the log holds, after the hello and the name tables, which are
kept apart for newcomers). A viewer whose next frame has left the log (it fell that far behind)
is dropped with a last `AgentError` saying why, and may reconnect. A viewer over the cap is told
so the same way and closed: idle connections cannot use up the job's file descriptors.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from memtui_agent.memory.descriptors import Identity, release_socket, socket_identity
from memtui_protocol import schema, wire

MAX_VIEWERS = 16
ACCEPTS_PER_POLL = 4
SENDS_PER_POLL = 64
"""Buffers handed to one `sendmsg` call, and calls per viewer per poll."""
BACKLOG_FRAMES = 2000
BACKLOG_BYTES = 8 * 1024 * 1024
FRAME_OVERHEAD = 128
"""Heap bytes one logged frame takes beyond its own: a `bytes` header (33), the pair that
holds it (56), the list's slot (8) and two malloc chunk headers."""
"""The shared log's bounds; also how far behind a viewer may fall before it is dropped."""


class _Viewer:
    """One connection: what it still has to get before the log, and its place in the log."""

    __slots__ = ("head", "identity", "joined", "partial", "seq", "sock")

    def __init__(self, sock: socket.socket, head: list[bytes], seq: int, joined: int) -> None:
        self.sock = sock
        self.identity = socket_identity(sock)
        """What the descriptor named at accept: checked before each send and the close."""
        self.head = head
        """Hello and name tables at connect time (shared `bytes`, not copies)."""
        self.seq = seq
        self.joined = joined
        """Names frames in the log before this are already in `head`."""
        self.partial: memoryview | None = None
        """The unsent rest of the frame last started (keeps that frame alive, nothing else)."""


def goodbye(reason: str) -> bytes:
    """The last frame a refused or dropped viewer gets: one line saying why."""
    return wire.encode(
        schema.AgentError(time=time.time(), component=schema.VIEWER_CLOSED, message=reason)
    )


class SocketServer:
    """A listening Unix socket, the shared frame log, and the connected viewers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        os.chmod(path, 0o600)
        self._listener.listen(MAX_VIEWERS)
        self._listener.setblocking(False)
        self._listener_identity = socket_identity(self._listener)
        self._listening = True
        """False once the job closed the listener's descriptor: no accept on a number that
        may be the job's own socket now (it would take the job's connections)."""
        self._viewers: list[_Viewer] = []
        self._opening = b""
        self._names: list[bytes] = []
        self._log: list[tuple[bytes, bool]] = []
        self._first_seq = 0
        self._log_bytes = 0
        self.disconnected_slow = 0
        self.refused = 0

    def set_opening(self, data: bytes) -> None:
        """Preamble and hello: what every viewer receives first."""
        self._opening = bytes(data)

    def held_bytes(self) -> int:
        """What the shared log holds in the job's heap, near enough: each frame's bytes and
        the objects that hold them (`FRAME_OVERHEAD`). It grows with every step until the
        backlog's bounds, and the leak watch takes it out of the heap it reads."""
        return self._log_bytes + len(self._log) * FRAME_OVERHEAD

    @property
    def _next_seq(self) -> int:
        return self._first_seq + len(self._log)

    def publish(self, data: bytes, *, is_names: bool = False) -> None:
        """Add one encoded frame to the shared log (constant work, whatever the viewers)."""
        data = bytes(data)
        if is_names:
            self._names.append(data)
        self._log.append((data, is_names))
        self._log_bytes += len(data)
        if len(self._log) > BACKLOG_FRAMES or self._log_bytes > BACKLOG_BYTES:
            self._trim()

    def _trim(self) -> None:
        cut = 0
        while len(self._log) - cut > 1 and (
            len(self._log) - cut > BACKLOG_FRAMES or self._log_bytes > BACKLOG_BYTES
        ):
            self._log_bytes -= len(self._log[cut][0])
            cut += 1
        # Trim a tenth more at once, so the list moves rarely.
        extra = min(len(self._log) - cut - 1, BACKLOG_FRAMES // 10)
        for _ in range(max(0, extra)):
            self._log_bytes -= len(self._log[cut][0])
            cut += 1
        del self._log[:cut]
        self._first_seq += cut

    def poll(self) -> None:
        """Accept a few newcomers and push each viewer's frames as far as its socket takes."""
        if self._listening and socket_identity(self._listener) != self._listener_identity:
            self._listening = False
            release_socket(self._listener, self._listener_identity)
        for _ in range(ACCEPTS_PER_POLL if self._listening else 0):
            try:
                sock, _ = self._listener.accept()
            except OSError:  # nobody waiting (BlockingIOError), or out of descriptors
                break
            sock.setblocking(False)
            if len(self._viewers) >= MAX_VIEWERS:
                self.refused += 1
                self._close(
                    sock,
                    self._opening
                    + goodbye(
                        f"this job already serves {MAX_VIEWERS} viewers; close one and try again"
                    ),
                )
                continue
            head = [self._opening, *self._names]
            self._viewers.append(_Viewer(sock, head, self._first_seq, self._next_seq))
        self._viewers = [viewer for viewer in self._viewers if self._flush(viewer)]

    def _flush(self, viewer: _Viewer) -> bool:
        """Send what the socket takes now; False once the viewer is gone or dropped."""
        if socket_identity(viewer.sock) != viewer.identity:
            release_socket(viewer.sock, viewer.identity)  # the job's number now: let go of it
            return False
        for _ in range(SENDS_PER_POLL):
            self._skip_names_held(viewer)
            if viewer.seq < self._first_seq and not viewer.head:
                self._drop_slow(viewer)
                return False
            buffers = self._pending(viewer)
            if not buffers:
                return True
            try:
                sent = viewer.sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                release_socket(viewer.sock, viewer.identity)
                return False
            self._advance(viewer, buffers, sent)
        return True

    def _drop_slow(self, viewer: _Viewer) -> None:
        """Its next frame left the log: say why at a frame boundary (else just close)."""
        self.disconnected_slow += 1
        reason = (
            f"this viewer fell more than {BACKLOG_FRAMES} frames or "
            f"{BACKLOG_BYTES // (1024 * 1024)} MiB behind the job and was disconnected; "
            "reconnect to resume"
        )
        if viewer.partial is None:
            self._close(viewer.sock, goodbye(reason), viewer.identity)
        else:
            release_socket(viewer.sock, viewer.identity)

    def _pending(self, viewer: _Viewer) -> list[memoryview]:
        """The next buffers to send, in stream order: partial frame, head, then the log."""
        buffers = []
        if viewer.partial is not None:
            buffers.append(viewer.partial)
        buffers.extend(memoryview(data) for data in viewer.head[:SENDS_PER_POLL])
        start = viewer.seq - self._first_seq
        for data, is_names in self._log[start : start + SENDS_PER_POLL]:
            if len(buffers) >= SENDS_PER_POLL:
                break
            if is_names and start < viewer.joined - self._first_seq:
                start += 1
                continue  # already in `head`
            start += 1
            buffers.append(memoryview(data))
        return buffers[:SENDS_PER_POLL]

    def _advance(self, viewer: _Viewer, buffers: list[memoryview], sent: int) -> None:
        """Consume `sent` bytes of `buffers`, in the order `_pending` built them."""
        for buffer in buffers:
            # Each buffer, once reached, is taken off its source; `partial` keeps its rest.
            if buffer is viewer.partial:
                viewer.partial = None
            elif viewer.head:
                viewer.head.pop(0)
            else:
                self._skip_names_held(viewer)
                viewer.seq += 1
            if sent < len(buffer):
                viewer.partial = buffer[sent:]
                return
            sent -= len(buffer)

    def _skip_names_held(self, viewer: _Viewer) -> None:
        """Move past log frames that are name tables the viewer got in `head` at connect."""
        while self._first_seq <= viewer.seq < viewer.joined:
            index = viewer.seq - self._first_seq
            if index >= len(self._log) or not self._log[index][1]:
                return
            viewer.seq += 1

    @staticmethod
    def _close(sock: socket.socket, last: bytes, identity: Identity | None = None) -> None:
        """Best effort: the few bytes of a goodbye fit any socket buffer that is not full.
        (`identity`: what the number named at accept; a fresh accept passes None.)"""
        identity = identity if identity is not None else socket_identity(sock)
        if socket_identity(sock) == identity:
            try:
                sock.send(last)
            except OSError:
                pass
        release_socket(sock, identity)

    @property
    def viewers(self) -> int:
        """Connected viewers."""
        return len(self._viewers)

    def close(self) -> None:
        """Send what can be sent without waiting, then close everything and remove the socket."""
        for viewer in self._viewers:
            if self._flush(viewer):
                release_socket(viewer.sock, viewer.identity)
        self._viewers = []
        if self._listening:
            self._listening = False
            release_socket(self._listener, self._listener_identity)
        try:
            self.path.unlink()
        except OSError:
            pass
