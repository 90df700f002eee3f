"""Reading a recording: the same frame parser as the socket, plus what a file can go wrong with.

A recording that cannot be opened or does not start like a memtui recording is an error with one
sentence for the user. A recording whose tail is torn or corrupt still yields every frame before
the damage, with a warning: nothing already recorded is lost.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from memtui.input_files import InputFileError, open_input
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
    names_dropped: int = 0
    """Module names beyond `schema.MAX_NAMES` in all, not kept (a hostile or broken writer)."""

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
        # Bounded over the whole recording too: ten full Names frames must not cost ten times.
        room = max(0, schema.MAX_NAMES - len(recording.module_names))
        for offset, name in enumerate(message.names[:room]):
            recording.module_names[message.first_id + offset] = name
        recording.names_dropped += max(0, len(message.names) - room)
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
    decoder = wire.FrameDecoder()
    try:
        with open_input(path) as handle:
            head = handle.read(CHUNK)
    except InputFileError as exc:
        raise RecordingError(str(exc)) from None
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


def read_recording(path: str | os.PathLike[str]) -> Recording:
    """Decode a recording file.

    A damaged frame in the middle is skipped (the decoder finds the next valid frame) and the
    warning says how many bytes were lost, so one bad sector hides one step, not the rest.

    Raises:
        RecordingError: missing, a directory or not a regular file, unreadable, empty, not a
            recording, a version this memtui does not read, or damaged before its hello.
    """
    path = Path(path)
    decoder = wire.FrameDecoder(resync=True)
    recording: Recording | None = None
    warning = None
    try:
        with open_input(path) as handle:
            while chunk := handle.read(CHUNK):
                recording, warning = _feed(recording, path, decoder, decoder.feed(chunk))
                if warning:
                    break
            else:
                recording, warning = _feed(recording, path, decoder, decoder.finish())
    except InputFileError as exc:
        raise RecordingError(str(exc)) from None
    except OSError as exc:
        raise RecordingError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if recording is None:
        if decoder.bytes_consumed == 0 and decoder.pending == 0:
            raise RecordingError(f"{path}: empty file, not a recording")
        raise RecordingError(f"{path}: truncated before its header was complete")
    recording.warning = warning or damage_warning(decoder)
    if recording.names_dropped:
        dropped = f"{recording.names_dropped} module names beyond {schema.MAX_NAMES} not kept"
        recording.warning = f"{recording.warning}; {dropped}" if recording.warning else dropped
    return recording


def damage_warning(decoder: wire.FrameDecoder) -> str | None:
    """What a resynchronising decoder skipped and what it left unread, in one line."""
    parts = []
    if decoder.damaged:
        regions = (
            "1 damaged region" if decoder.damaged == 1 else f"{decoder.damaged} damaged regions"
        )
        parts.append(
            f"{decoder.first_damage}; skipped {decoder.skipped_bytes} bytes ({regions}) and "
            "showed every valid frame around them"
        )
    if decoder.pending:
        parts.append(
            f"the last {decoder.pending} bytes are a partial frame (the writer stopped "
            "mid-frame); everything before them is shown"
        )
    return "; ".join(parts) or None


def _feed(
    recording: Recording | None,
    path: Path,
    decoder: wire.FrameDecoder,
    messages: Iterator[schema.Message],
) -> tuple[Recording | None, str | None]:
    """Fold decoded messages in; a warning when the decoder had to stop early."""
    try:
        for message in messages:
            recording = _take(recording, path, message)
    except wire.WireError as exc:
        if recording is None:
            raise RecordingError(f"{path}: {exc}") from None
        return recording, f"{exc}; showing the {decoder.frames} frames before it"
    return recording, None


def _take(recording: Recording | None, path: Path, message: schema.Message) -> Recording:
    if recording is None:
        if not isinstance(message, schema.Hello):
            raise RecordingError(f"{path}: damaged (first message is not the job's hello)")
        return Recording(path=path, hello=message)
    apply(recording, message)
    return recording
