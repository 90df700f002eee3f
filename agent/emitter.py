"""The one thread that encodes, records and serves frames, so the training thread never waits.

The training thread only appends to a bounded deque and sets an event (about a microsecond).
This thread turns pending items into messages (resolving loss tensors with `.item()` here, so a
GPU sync never lands on the training thread), appends each frame to the recording with a single
`os.write` (a process killed with SIGKILL leaves every completed frame in the file), and hands it
to the socket server. A failing disk or socket turns that output off and is reported once; the
job goes on.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from memtui_agent import schema, wire
from memtui_agent.socket_server import SocketServer

QUEUE_LIMIT = 10_000
TICK_SECONDS = 1.0


class Pending(Protocol):
    """Work whose final form needs values that are expensive to read on the training thread."""

    def finalize(self) -> schema.Message:
        """Build the message (may sync a device or read process memory)."""
        ...


Item = schema.Message | Pending


class Emitter:
    """Bounded hand-off from the training thread to the recording and the socket."""

    def __init__(
        self,
        recording: Path | None,
        server: SocketServer | None,
        hello: schema.Hello,
        on_error: Callable[[str, BaseException], None],
        tick: Callable[[], schema.Tick | None] | None = None,
    ) -> None:
        self._queue: deque[Item] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._on_error = on_error
        self._tick = tick
        self._last_frame = time.monotonic()
        self.dropped = 0
        self.frames_written = 0
        self.bytes_written = 0
        self._server = server
        self._fd: int | None = None
        opening = wire.preamble() + wire.encode(hello)
        if recording is not None:
            try:
                self._fd = os.open(recording, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                self._write(opening)
            except OSError as exc:
                self._fd = None
                on_error("recording", exc)
        if server is not None:
            server.set_opening(opening)
        self._thread = threading.Thread(target=self._run, name="memtui-emitter", daemon=True)
        self._thread.start()

    def put(self, item: Item) -> None:
        """Enqueue without blocking; past the bound the item is dropped and counted."""
        if len(self._queue) >= QUEUE_LIMIT:
            self.dropped += 1
            return
        self._queue.append(item)
        self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Drain what is queued (bounded by `timeout`), then close the file and the socket."""
        self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def recording_open(self) -> bool:
        """Whether frames still reach the recording file."""
        return self._fd is not None

    def _run(self) -> None:
        while True:
            self._wake.wait(0.1)
            self._wake.clear()
            try:
                self._drain()
                if self._server is not None:
                    self._server.poll()
                if not self._stopping:
                    self._maybe_tick()
            except Exception as exc:  # never let the thread die silently mid-run
                self._on_error("emitter", exc)
            if self._stopping and not self._queue:
                break
        self._shutdown()

    def _drain(self) -> None:
        while self._queue:
            item = self._queue.popleft()
            message = item if isinstance(item, schema.Message) else item.finalize()
            self._send(message)

    def _send(self, message: schema.Message) -> None:
        data = wire.encode(message)
        self._last_frame = time.monotonic()
        if self._fd is not None:
            try:
                self._write(data)
            except OSError as exc:
                self._close_file()
                self._on_error("recording", exc)
        if self._server is not None:
            self._server.publish(data, is_names=isinstance(message, schema.Names))

    def _maybe_tick(self) -> None:
        if self._tick is None or time.monotonic() - self._last_frame < TICK_SECONDS:
            return
        message = self._tick()
        if message is None:
            self._last_frame = time.monotonic()
        else:
            self._send(message)

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self.frames_written += 1
        self.bytes_written += len(data)

    def _close_file(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _shutdown(self) -> None:
        self._close_file()
        if self._server is not None:
            try:
                self._server.close()
            except OSError:
                pass
