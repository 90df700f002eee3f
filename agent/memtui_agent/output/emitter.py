"""Frames out of the job: recorded on the caller's thread, served to viewers by one thread.

A step is in the recording before control returns to the job: `put` builds the frame from the
closed step's inputs (`steps.frame.build_step`), encodes it and appends it to the file with one
`os.write` on the thread that closed the step, so a process killed with SIGKILL right after
`optimizer.step()` leaves that step in the file. Everything a frame holds was measured at the
close without waiting for the device (`steps.step_closer`); a loss or scale still in GPU memory
follows in a later frame (`late_values.LateValues`). What stays off
the training thread is the socket: `put` only appends the encoded bytes to a bounded queue, and
the emitter thread, every `SERVE_SECONDS`, hands them to the socket server and sends the
once-a-second tick. A failing disk or socket turns that output off and is reported once; the job
goes on.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import msgspec

from memtui_agent.memory.descriptors import OwnedFd
from memtui_agent.output.socket_server import FRAME_OVERHEAD, SocketServer
from memtui_agent.steps.frame import ClosedStep, build_step
from memtui_agent.steps.late_values import LateValues, read_values
from memtui_protocol import schema, wire
from memtui_protocol.safe_open import Replace, create_private
from memtui_protocol.written import hold_as_writer

QUEUE_LIMIT = 10_000
TICK_SECONDS = 1.0
SERVE_SECONDS = 0.1
"""How often the emitter thread hands queued frames to viewers. The training thread does not
wake it per frame: waking costs the step an Event.set, and the woken thread then competes with
the job for the GIL right as the next step starts. A viewer redraws a few times a second."""
MAX_LATE = schema.LATE_SEARCH
"""Steps whose device values may be in flight at once; older ones are given up (and counted)."""


class LostDescriptor(OSError):
    """The job closed the recording's descriptor and its file cannot be opened again."""

    def __init__(self, recording: Path | None) -> None:
        super().__init__(
            f"the job closed the recording's descriptor and {recording} cannot be opened "
            "again; nothing more is written (never into the job's own files)"
        )


FULL = {
    errno.ENOSPC: "disk full (ENOSPC)",
    errno.EDQUOT: "disk quota exceeded (EDQUOT)",
    errno.EFBIG: "file size limit reached (EFBIG)",
}
"""The write errors that mean the recording cannot grow, and the words its last frame says
(short: that frame has to fit in the slack of the file's last block)."""

Item = schema.Message | ClosedStep
"""What the emitter takes: a message as it is, or a closed step whose frame it builds."""


class Emitter:
    """Synchronous recording, asynchronous serving."""

    def __init__(
        self,
        recording: Path | None,
        server: SocketServer | None,
        hello: schema.Hello,
        on_error: Callable[[str, BaseException], None],
        tick: Callable[[], schema.Tick | None] | None = None,
        *,
        private_folder: bool = False,
    ) -> None:
        """`private_folder`: the recording is in a session folder, which must be ours alone."""
        self._outbox: deque[tuple[bytes, bool]] = deque()
        self._late: deque[LateValues] = deque()
        self._file_lock = threading.RLock()
        """Frames come from the training thread, the tick thread and error reports. Reentrant:
        a signal handler of the job's own that ends the recording (`memtui_agent.stop()` in its
        SIGTERM handler) runs on the training thread, possibly between the bytecodes of a
        frame's write under this lock; a plain lock would deadlock the job there."""
        self._wake = threading.Event()
        self._stopping = False
        self._on_error = on_error
        self._tick = tick
        self._last_frame = time.monotonic()
        self.dropped = 0
        """Frames the socket queue had no room for (the recording never drops one)."""
        self.bytes_written = 0
        self._server = server
        self._exports: tuple[tuple[str, Callable[[schema.Message], None]], ...] = ()
        """Each handed every message once it is recorded, named by its component: the
        logger figures (`output.logger_figures`) and, with `--metrics-port`, the Prometheus
        exporter (`output.metrics`). Each keeps a reference, nothing more on most steps."""
        self._recording = recording
        self._file: OwnedFd | None = None
        """The recording's descriptor, checked to still be ours before each write and the
        close (a job may close descriptors it does not know and reuse the numbers)."""
        opening = wire.preamble() + wire.encode(hello)
        if recording is not None:
            try:
                descriptor = create_private(
                    recording, private_folder=private_folder, replaces=Replace.RECORDING
                )
                # Held until the file is closed, before a byte is in it: a rerun or a sibling
                # task never takes a recording it finds locked for an earlier one.
                hold_as_writer(descriptor)
                self._file = OwnedFd(descriptor)
                self._write(opening)
            except OSError as exc:
                self._close_file()
                on_error("recording", exc)
        if server is not None:
            server.set_opening(opening)
        self._thread = threading.Thread(target=self._run, name="memtui-emitter", daemon=True)
        self._thread.start()

    def put(self, item: Item) -> None:
        """Record `item` before returning, queue it for viewers; never raises into the job."""
        try:
            message = self._message(item)
            frames = wire.encode_frames(message)
        except Exception as exc:
            self._on_error("frame", exc)
            return
        self._send(frames, isinstance(message, schema.Names))
        for component, export in self._exports:
            try:
                export(message)
            except Exception as exc:  # that export is off; the recording and the others go on
                self._exports = tuple(item for item in self._exports if item[0] != component)
                self._on_error(component, exc)

    def add_export(self, component: str, export: Callable[[schema.Message], None]) -> None:
        """Hand `export` every message recorded from now on; a failing one is removed and
        reported once under `component`."""
        self._exports = (*self._exports, (component, export))

    def held_bytes(self) -> int:
        """What the frames kept for viewers hold in the job's heap: the socket's log and the
        frames queued for it (0 without a socket). Both: a frame moves from the queue to the
        log when the emitter's thread wakes, which load delays or hurries, and counting the
        log alone moved the leak watch's heap figure by the queue's size at random closes
        (an evaluation every 5 steps named at step 29 instead of 14 on a loaded machine).
        Read on the training thread; the log changes on the emitter's, and an integer read
        under the GIL is whole."""
        server = self._server
        if server is None:
            return 0
        queued = list(self._outbox)
        return (
            server.held_bytes()
            + sum(len(frame) for frame, _names in queued)
            + len(queued) * FRAME_OVERHEAD
        )

    def close(self, timeout: float = 5.0) -> None:
        """Serve what is queued (bounded by `timeout`), then close the socket and the file."""
        self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        with self._file_lock:
            self._close_file()

    # ----- the caller's thread ------------------------------------------------------------------

    def _message(self, item: Item) -> schema.Message:
        if isinstance(item, ClosedStep):
            return self._frame(item)
        if isinstance(item, schema.End):
            late = [*item.late, *self._late_values(wait=True)][: schema.MAX_LATE]
            return msgspec.structs.replace(item, late=late)
        return item

    def _frame(self, closed: ClosedStep) -> schema.Step:
        """The closed step's frame, with the values of earlier steps that reached the host;
        its own device values are queued until they do."""
        inputs = closed.inputs
        values, pending = read_values(inputs.step, closed.losses, closed.scale, closed.scale_after)
        step = build_step(inputs, values, self._late_values(wait=False), self.dropped)
        if pending is not None:
            self._late.append(pending)
            if len(self._late) > MAX_LATE:  # the device is that far behind: give the oldest up
                self._late.popleft()
        return step

    def _late_values(self, wait: bool) -> list[schema.StepLate]:
        """Values of earlier steps that have reached the host (all of them when `wait`)."""
        ready = []
        while self._late:
            pending = self._late[0]
            try:
                if wait:
                    pending.wait()  # the job is ending: one wait here is harmless
                elif not pending.ready():
                    break
                ready.append(pending.values())
            except Exception as exc:  # a device error: those values are lost, not the frame
                self._on_error("late-values", exc)
            self._late.popleft()
        return ready

    def _send(self, frames: list[bytes], is_names: bool = False) -> None:
        if self._file is not None:
            error: BaseException | None = None
            with self._file_lock:
                try:
                    if self._file is not None and self._still_ours():
                        for frame in frames:
                            self._write(frame)
                    elif self._file is not None:
                        self._file = None
                        error = LostDescriptor(self._recording)
                except OSError as exc:
                    self._last_words(exc)
                    self._close_file()
                    error = exc
            if error is not None:
                self._on_error(schema.RECORDING_STOPPED, error)
        self._last_frame = time.monotonic()
        if self._server is None:
            return
        for frame in frames:
            if len(self._outbox) >= QUEUE_LIMIT:
                self.dropped += 1
                continue
            self._outbox.append((frame, is_names))

    def _still_ours(self) -> bool:
        """Whether the recording's descriptor is still the agent's file; if the job closed it,
        the same file is opened again by its path (never another file put at that name)."""
        owned = self._file
        assert owned is not None
        if owned.ours():
            return True
        owned.forget()  # the number is the job's now: never written, never closed
        return self._recording is not None and owned.reopen(self._recording)

    def _write(self, data: bytes) -> None:
        assert self._file is not None and self._file.fd is not None
        descriptor = self._file.fd
        view = memoryview(data)
        while view:
            written = os.write(descriptor, view)
            view = view[written:]
        self.bytes_written += len(data)

    def _last_words(self, exc: OSError) -> None:
        """The file cannot grow (a full disk, a quota, a size limit): record why, if it fits.

        The torn frame is cut off (back to the end of the last whole frame, which may free the
        block it took), then one small `AgentError` saying why the recording stops is written:
        it fits in the slack of the file's last block nearly always, so a reader can say "the
        disk was full" instead of "killed". If even that fails, the file ends at its last whole
        frame and the reader judges by the folder's free space.
        """
        why = FULL.get(exc.errno or 0)
        owned = self._file
        if why is None or owned is None or owned.fd is None or not owned.ours():
            return
        descriptor = owned.fd
        frame = wire.encode(
            schema.AgentError(time=time.time(), component=schema.RECORDING_STOPPED, message=why)
        )
        try:
            os.ftruncate(descriptor, self.bytes_written)
            os.lseek(descriptor, self.bytes_written, os.SEEK_SET)
            if os.write(descriptor, frame) != len(frame):
                os.ftruncate(descriptor, self.bytes_written)
        except OSError:
            try:
                os.ftruncate(descriptor, self.bytes_written)
            except OSError:
                pass

    def _close_file(self) -> None:
        owned, self._file = self._file, None
        if owned is not None:
            owned.close()  # only if the number is still the recording's

    # ----- the emitter thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(SERVE_SECONDS)
            self._wake.clear()
            try:
                self._serve()
                if not self._stopping:
                    self._maybe_tick()
            except Exception as exc:  # never let the thread die silently mid-run
                self._on_error("emitter", exc)
            if self._stopping and not self._outbox:
                break
        if self._server is not None:
            try:
                self._server.close()
            except OSError:
                pass

    def _serve(self) -> None:
        server = self._server
        if server is None:
            return
        while self._outbox:
            frame, is_names = self._outbox.popleft()
            server.publish(frame, is_names=is_names)
        server.poll()

    def _maybe_tick(self) -> None:
        if self._tick is None or time.monotonic() - self._last_frame < TICK_SECONDS:
            return
        message = self._tick()
        if message is None:
            self._last_frame = time.monotonic()
        else:
            self._send(wire.encode_frames(message))
