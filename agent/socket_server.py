"""Serves frames to any number of viewers on a Unix socket, without ever blocking.

Only the emitter thread calls into this class. Sockets are non-blocking; each viewer has a bounded
outgoing buffer, and a viewer that falls further behind than that is disconnected (it can
reconnect and get the backlog again) rather than slowing the job or growing memory.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from pathlib import Path

MAX_VIEWER_BUFFER = 8 * 1024 * 1024
BACKLOG_FRAMES = 2000


class _Viewer:
    __slots__ = ("buffer", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()


class SocketServer:
    """A listening Unix socket plus the hello, name tables and recent frames for newcomers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        os.chmod(path, 0o600)
        self._listener.listen(16)
        self._listener.setblocking(False)
        self._viewers: list[_Viewer] = []
        self._opening = bytearray()
        self._names: list[bytes] = []
        self._backlog: deque[bytes] = deque(maxlen=BACKLOG_FRAMES)
        self.disconnected_slow = 0

    def set_opening(self, data: bytes) -> None:
        """Preamble and hello: what every viewer receives first."""
        self._opening = bytearray(data)

    def publish(self, data: bytes, *, is_names: bool = False) -> None:
        """Queue one encoded frame to every viewer and remember it for later viewers."""
        if is_names:
            self._names.append(data)
        else:
            self._backlog.append(data)
        for viewer in self._viewers:
            viewer.buffer += data

    def poll(self) -> None:
        """Accept newcomers and push buffered bytes as far as each socket takes them."""
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            sock.setblocking(False)
            viewer = _Viewer(sock)
            viewer.buffer += self._opening
            for data in self._names:
                viewer.buffer += data
            for data in self._backlog:
                viewer.buffer += data
            self._viewers.append(viewer)
        alive = []
        for viewer in self._viewers:
            if self._flush(viewer):
                alive.append(viewer)
        self._viewers = alive

    def _flush(self, viewer: _Viewer) -> bool:
        while viewer.buffer:
            try:
                sent = viewer.sock.send(viewer.buffer)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                viewer.sock.close()
                return False
            del viewer.buffer[:sent]
        if len(viewer.buffer) > MAX_VIEWER_BUFFER + len(self._opening):
            self.disconnected_slow += 1
            viewer.sock.close()
            return False
        return True

    @property
    def viewers(self) -> int:
        """Connected viewers."""
        return len(self._viewers)

    def close(self) -> None:
        """Send what can be sent without waiting, then close everything and remove the socket."""
        for viewer in self._viewers:
            self._flush(viewer)
            viewer.sock.close()
        self._viewers = []
        self._listener.close()
        try:
            self.path.unlink()
        except OSError:
            pass
