"""The job child of `memtui run` (TUI mode): its output captured, teed to a file, and its end.

Headless runs leave the job's stdio alone; with the TUI on screen the job's output cannot go to
the terminal, so it is read here line by line (progress bars redrawn with carriage returns keep
their latest state), kept in a bounded buffer for the output pane, and written unchanged to
`<recording>.log` so nothing the job printed is lost. The log's first line is memtui's own
(`JOB_LOG_MARKER`): it proves the file is memtui's, so a rerun replaces it and nothing else (a
user's file or a shell redirect under that name is never touched, `memtui_protocol.written`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from memtui_protocol.safe_open import Replace, create_private
from memtui_protocol.written import JOB_LOG_MARKER, hold_as_writer

MAX_LINES = 5000


def recording_log_path(recording: Path | None) -> Path | None:
    """`<recording>.log`: where the job's output is kept beside its recording."""
    return recording.with_name(recording.name + ".log") if recording is not None else None


def log_first_line() -> bytes:
    """The line memtui writes before the job's output, the proof the log is memtui's."""
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return JOB_LOG_MARKER + f" from here on, unchanged (started {started})\n".encode()


class JobProcess:
    """A started job: output lines for the UI, exit code when it ends, polite termination."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path | None) -> None:
        self.lines: deque[str] = deque(maxlen=MAX_LINES)
        self.printed = 0
        """Lines the job has printed so far (`take_lines` leaves this as it is)."""
        self._lock = threading.Lock()
        self.log_path = log_path
        self._log = None
        self.logged = 0
        """Bytes of the job's output written to the log (memtui's first line not counted)."""
        self._log_identity: tuple[int, int] | None = None
        """The log this run created (device, inode): the only file `discard_empty_log` removes."""
        if log_path is not None:
            try:  # never through a planted link (see memtui_protocol.safe_open)
                descriptor = create_private(log_path, replaces=Replace.JOB_LOG)
                hold_as_writer(descriptor)  # a rerun leaves a log that is still written
                info = os.fstat(descriptor)
                self._log_identity = (info.st_dev, info.st_ino)
                self._log = os.fdopen(descriptor, "wb")
                self._log.write(log_first_line())
                self._log.flush()
            except OSError as exc:
                self.lines.append(f"memtui: job output not saved: {exc}")
        self.process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self.process.pid
        self._reader = threading.Thread(target=self._read, name="memtui-job-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        stream = self.process.stdout
        assert stream is not None
        pending = b""
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            if not chunk:
                break
            if self._log is not None:
                try:
                    self._log.write(chunk)
                    self._log.flush()
                    self.logged += len(chunk)
                except OSError:
                    self._log = None
            pending += chunk
            *complete, pending = pending.split(b"\n")
            with self._lock:
                for raw in complete:
                    self.lines.append(_last_redraw(raw))
                self.printed += len(complete)
        if pending:
            with self._lock:
                self.lines.append(_last_redraw(pending))
                self.printed += 1
        if self._log is not None:
            self._log.close()

    def take_lines(self) -> list[str]:
        """Lines printed since the last call."""
        with self._lock:
            lines = list(self.lines)
            self.lines.clear()
        return lines

    def lines_after(self, seen: int) -> list[str]:
        """The lines printed after the first `seen`, left for `take_lines` too (those still
        kept: the buffer holds the last `MAX_LINES`)."""
        with self._lock:
            new = min(self.printed - seen, len(self.lines))
            return list(self.lines)[len(self.lines) - new :] if new > 0 else []

    def poll(self) -> int | None:
        """Exit code (128+N for signal N), or None while the job runs."""
        code = self.process.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code

    stopped = False
    """Whether memtui stopped the job (the user quit the TUI while it ran)."""

    def terminate(self, grace: float = 5.0) -> None:
        """SIGTERM the job's process group, then SIGKILL if it is still there after `grace`.

        The job keeps its own SIGTERM behaviour (memtui installs no handler in it: a Python
        handler runs only between bytecodes, and would hold a job in a long C call or a hung
        collective); memtui itself knows it stopped the job (`stopped`) and says so in the
        recording afterwards (`commands.stop_record`)."""
        if self.process.poll() is not None:
            return
        self.stopped = True
        if not self._signal_and_wait(signal.SIGTERM, grace):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                pass

    def interrupt(self, grace: float = 5.0) -> None:
        """Ctrl-C reached memtui, not the job (it runs in a session of its own): pass it on as
        SIGINT, so the job ends as a Ctrl-C ends it without memtui (its KeyboardInterrupt, its
        own cleanup, the agent's final frame); `terminate` if it is still there after `grace`."""
        if self.process.poll() is not None:
            return
        if not self._signal_and_wait(signal.SIGINT, grace):
            self.terminate()

    def _signal_and_wait(self, sent: signal.Signals, grace: float) -> bool:
        """Send `sent` to the job's process group and wait up to `grace` for it to end: True
        when it ended, or the group is gone (nothing left to signal)."""
        try:
            os.killpg(self.process.pid, sent)
        except OSError:
            return True
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return True
            time.sleep(0.05)
        return False

    def discard_empty_log(self) -> bool:
        """Remove the log this run created when the job wrote nothing to it (memtui's first
        line alone is no output worth a file); never a file at that name that is not the one
        created (a rerun's, a user's). Call after `wait`. True: removed."""
        path, identity = self.log_path, self._log_identity
        if path is None or identity is None or self.logged or self._reader.is_alive():
            return False
        try:
            info = os.lstat(path)
            if (info.st_dev, info.st_ino) != identity:
                return False
            path.unlink()
        except OSError:
            return False
        return True

    def wait(self, drain: float = 2.0) -> int:
        """Block until the job ends; its exit code. Its output is read to the end for up to
        `drain` seconds more (a process the job left behind may hold the pipe open)."""
        self.process.wait()
        self._reader.join(timeout=drain)
        code = self.poll()
        return 0 if code is None else code


def _last_redraw(raw: bytes) -> str:
    """A line as the terminal would finally show it: the part after the last carriage return."""
    text = raw.decode("utf-8", errors="replace").rstrip("\r")
    return text.rsplit("\r", 1)[-1]
