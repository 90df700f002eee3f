"""Reading a recording: the same frame parser as the socket, plus what a file can go wrong with.

A recording that cannot be opened or does not start like a memtui recording is an error with one
sentence for the user. A recording whose tail is torn or corrupt still yields every frame before
the damage, with a warning: nothing already recorded is lost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from memtui.step_rows import module_label
from memtui_agent import schema, wire
from memtui_agent.runtime_dir import pid_alive

CHUNK = 1 << 20


class RecordingError(Exception):
    """The file is unusable as a recording; `str()` is the one line to show."""


@dataclass
class Recording:
    """Everything decoded from one recording, in order."""

    path: Path
    hello: schema.Hello
    module_names: dict[int, str] = field(default_factory=dict)
    steps: list[schema.Step] = field(default_factory=list)
    last_tick: schema.Tick | None = None
    agent_errors: list[schema.AgentError] = field(default_factory=list)
    early_alerts: list[schema.AlertNow] = field(default_factory=list)
    end: schema.End | None = None
    warning: str | None = None

    def module_name(self, module_id: int) -> str:
        """Qualified module name for an id; activations outside any module get a label."""
        return module_label(self.module_names, module_id)

    def status(self) -> str:
        """ok / error from the agent's last word; running or killed when it has none."""
        if self.end is not None:
            return self.end.status
        if self.hello.hostname == os.uname().nodename and pid_alive(
            self.hello.pid, self.hello.process_create_time
        ):
            return "running"
        return "killed"


def apply(recording: Recording, message: schema.Message) -> None:
    """Fold one message into a recording (also used for live streams)."""
    if isinstance(message, schema.Step):
        schema.apply_late(recording.steps, message.late)
        recording.steps.append(message)
    elif isinstance(message, schema.AlertNow):
        recording.early_alerts.append(message)
    elif isinstance(message, schema.Tick):
        recording.last_tick = message
    elif isinstance(message, schema.Names):
        for offset, name in enumerate(message.names):
            recording.module_names[message.first_id + offset] = name
    elif isinstance(message, schema.AgentError):
        recording.agent_errors.append(message)
    elif isinstance(message, schema.End):
        schema.apply_late(recording.steps, message.late)
        recording.end = message


def read_head(path: str | os.PathLike[str]) -> schema.Hello:
    """The job's hello, from the first chunk only: is this a recording we can read at all?

    Raises:
        RecordingError: as `read_recording` does for a file that is not a usable recording.
    """
    path = Path(path)
    _check_file(path)
    decoder = wire.FrameDecoder()
    try:
        with open(path, "rb") as handle:
            head = handle.read(CHUNK)
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


def _check_file(path: Path) -> None:
    if not path.exists():
        raise RecordingError(f"{path}: no such file")
    if path.is_dir():
        raise RecordingError(f"{path}: is a directory, not a recording")


def read_recording(path: str | os.PathLike[str]) -> Recording:
    """Decode a recording file.

    Raises:
        RecordingError: missing, a directory, unreadable, empty, not a recording, a version this
            memtui does not read, or damaged before its hello.
    """
    path = Path(path)
    _check_file(path)
    decoder = wire.FrameDecoder()
    recording: Recording | None = None
    warning = None
    try:
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK):
                try:
                    for message in decoder.feed(chunk):
                        recording = _take(recording, path, message)
                except wire.WireError as exc:
                    if recording is None:
                        raise RecordingError(f"{path}: {exc}") from None
                    warning = f"{exc}; showing the {decoder.frames} frames before it"
                    break
    except OSError as exc:
        raise RecordingError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if recording is None:
        if decoder.bytes_consumed == 0 and decoder.pending == 0:
            raise RecordingError(f"{path}: empty file, not a recording")
        raise RecordingError(f"{path}: truncated before its header was complete")
    if warning is None and decoder.pending:
        warning = (
            f"the last {decoder.pending} bytes are a partial frame (the writer stopped "
            "mid-frame); everything before them is shown"
        )
    recording.warning = warning
    return recording


def _take(recording: Recording | None, path: Path, message: schema.Message) -> Recording:
    if recording is None:
        if not isinstance(message, schema.Hello):
            raise RecordingError(f"{path}: damaged (first message is not the job's hello)")
        return Recording(path=path, hello=message)
    apply(recording, message)
    return recording
