"""Where frames come from: a recording file or a live job's socket, behind one interface.

A source runs in a worker thread and hands decoded messages to a sink in batches; the app drains
them at its own tick, so a job closing 1,000 steps a second costs the UI one ingest per tick.
Neither source imports torch.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from memtui.errors import UserError
from memtui.input.frame_stream import CHUNK, Sink, StreamEnd, file_chunks, pump
from memtui_protocol import schema, wire


class SourceError(UserError):
    """The source cannot be opened; `str()` is the one line to show."""


class ReplaySource:
    """A recording file, read to its end once (or to the first damaged frame)."""

    live = False

    def __init__(self, path: Path) -> None:
        self.path = path
        self.label = str(path)
        self.warning: str | None = None

    def check(self) -> None:
        """Fail early, with one line, on a file that is not a readable recording.

        Only the head is read (magic, version, the job's hello): a 100,000-step recording is
        decoded once, by `run()`, which reports damage further in as a warning.
        """
        from memtui.input.recording_file import RecordingError, read_head

        try:
            read_head(self.path)
        except RecordingError as exc:
            raise SourceError(str(exc)) from None

    def run(self, sink: Sink, stop: threading.Event) -> str | None:
        """Decode the file into `sink`; returns what went wrong on the way (None: clean)."""
        from memtui.input.input_files import InputFileError, open_input

        try:
            handle = open_input(self.path)
        except InputFileError as exc:
            return str(exc)
        decoder = wire.FrameDecoder(resync=True)
        with handle:
            return pump(file_chunks(handle.fileno(), decoder), decoder, sink, stop)


class LiveSource:
    """A running job's Unix socket: hello, names and backlog first, then live frames."""

    live = True

    def __init__(self, socket_path: Path, label: str | None = None) -> None:
        self.socket_path = socket_path
        self.label = label or str(socket_path)
        self._sock: socket.socket | None = None

    def check(self) -> None:
        """Connect now so that a dead or foreign socket is one clear line, not a blank UI."""
        path = self.socket_path
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise SourceError(f"{path}: no such socket (the job has ended?)") from None
        if not stat.S_ISSOCK(info.st_mode):
            raise SourceError(f"{path}: not a socket")
        if info.st_uid != os.getuid():
            raise SourceError(f"{path}: owned by another user; refusing to connect")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
        except OSError as exc:
            sock.close()
            reason = exc.strerror or str(exc)
            raise SourceError(f"{path}: cannot connect ({reason}); the job is gone") from None
        self._sock = sock

    def run(self, sink: Sink, stop: threading.Event) -> str | None:
        """Read frames until the job closes the socket or `stop` is set."""
        if self._sock is None:
            self.check()
        sock = self._sock
        assert sock is not None
        sock.settimeout(0.2)

        def read() -> bytes | None:
            try:
                data = sock.recv(CHUNK)
            except TimeoutError:
                return None
            except OSError as exc:
                raise StreamEnd(f"connection lost ({exc.strerror or exc})") from None
            if not data:
                raise StreamEnd("the job closed its socket")
            return data

        def deliver(batch: list[schema.Message]) -> None:
            for index, message in enumerate(batch):
                # The job's last word to a viewer it refuses or drops: the line to show.
                if (
                    isinstance(message, schema.AgentError)
                    and message.component == schema.VIEWER_CLOSED
                ):
                    if index:
                        sink(batch[:index])
                    raise StreamEnd(f"the job closed this connection: {message.message}")
            sink(batch)

        try:
            return pump(read, wire.FrameDecoder(), deliver, stop)
        finally:
            sock.close()


class TailSource:
    """A recording being written by a job `memtui run` started: read it as it grows.

    The agent writes every frame to the recording as the step closes, so following the file
    sees exactly what a socket would, with no race against a job that ends before a viewer
    connects. The stream ends at the `End` frame, or once the job has exited and the file has
    stopped growing.
    """

    live = True

    def __init__(self, path: Path, job_exited: Callable[[], bool], poll: float = 0.1) -> None:
        self.path = path
        self.label = str(path)
        self._job_exited = job_exited
        self._poll = poll

    def check(self) -> None:
        """Nothing to check before the job has started writing."""

    def run(self, sink: Sink, stop: threading.Event) -> str | None:
        """Follow the file until the job's `End`, its exit, or `stop`."""
        handle = None

        def read() -> bytes | None:
            nonlocal handle
            if handle is None:
                try:
                    handle = open(self.path, "rb")  # noqa: SIM115
                except FileNotFoundError:
                    if self._job_exited():
                        raise StreamEnd(
                            "the job ended before its agent started (did it import torch?)"
                        ) from None
                    stop.wait(self._poll)
                    return None
            exited = self._job_exited()
            chunk = handle.read(CHUNK)
            if chunk:
                return chunk
            if exited:
                raise StreamEnd("the job exited without a final frame (killed?)")
            stop.wait(self._poll)
            return None

        def deliver(batch: list[schema.Message]) -> None:
            sink(batch)
            if isinstance(batch[-1], schema.End):
                raise StreamEnd(None)

        try:
            return pump(read, wire.FrameDecoder(), deliver, stop)
        finally:
            if handle is not None:
                handle.close()


class GrowingRecordingSource(TailSource):
    """`memtui replay` of a recording its job is still writing (a `memtui run -o` or an
    `attach -o` recording of a job that runs): followed as it grows, exactly as the job's own
    TUI follows it, until its `End`, or until the job is gone (then it was killed).

    Whether the job still writes it is `writer_alive`, the rule `memtui report` answers
    `job running` by, so the two never disagree about the same file.
    """

    following = True
    """A recording read back while its job writes it: the header says the job is running."""

    def __init__(self, path: Path, hello: schema.Hello, poll: float = 0.1) -> None:
        from memtui.input.recording_file import writer_alive

        super().__init__(path, lambda: not writer_alive(hello), poll)
        self.hello = hello
        self.warning: str | None = None

    def check(self) -> None:
        """The head was read when the source was chosen (`replay_source`)."""


class SnapshotSource:
    """A PyTorch memory snapshot pickle, shown as a one-step recording per device.

    The snapshot is read with `memtui.input.torch_snapshot` (plain data only, no torch) and turned
    into the same messages a recording holds, so the replay screen needs no special case.
    """

    live = False

    def __init__(self, path: Path) -> None:
        self.path = path
        self.label = f"{path} (PyTorch memory snapshot)"
        self.warning: str | None = None
        self._messages: list[schema.Message] | None = None

    def check(self) -> None:
        """Read the whole snapshot now, so a foreign or damaged pickle is one clear line."""
        from memtui.input.torch_snapshot import SnapshotError, load_snapshot, snapshot_messages

        try:
            self._messages = snapshot_messages(load_snapshot(self.path), self.path)
        except SnapshotError as exc:
            raise SourceError(str(exc)) from None

    def run(self, sink: Sink, stop: threading.Event) -> str | None:
        """Hand every message over in one batch."""
        if self._messages is None:
            try:
                self.check()
            except SourceError as exc:
                return str(exc)
        assert self._messages is not None
        sink(list(self._messages))
        return None


def replay_source(path: Path) -> ReplaySource | SnapshotSource | GrowingRecordingSource:
    """The source for `memtui replay PATH`, chosen by the file's first byte, not its name; a
    recording whose job still runs is followed as it grows (`GrowingRecordingSource`)."""
    from memtui.input.recording_file import RecordingError, read_head, writer_alive
    from memtui.input.torch_snapshot import looks_like_snapshot

    if looks_like_snapshot(path):
        return SnapshotSource(path)
    try:
        hello = read_head(path)
    except RecordingError:
        return ReplaySource(path)  # its `check()` says why, in one line
    if writer_alive(hello):
        return GrowingRecordingSource(path, hello)
    return ReplaySource(path)
