"""Reading a recording: the same frame parser as the socket, plus what a file can go wrong with.

A recording that cannot be opened or does not start like a memtui recording is an error with one
sentence for the user. A recording whose tail is torn or corrupt still yields every frame before
the damage, with a warning: nothing already recorded is lost.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from memtui.input.frame_stream import damage_warning, file_chunks, pump
from memtui.input.input_files import InputFileError, open_input
from memtui.input.recording_file import RecordingError, writer_alive
from memtui.model.alert_kinds import AlertKindShown, alert_kind
from memtui.model.job_state import Ending, how_it_ended
from memtui.model.kept_trail import KeptTrail
from memtui.model.leaks import MAX_HOLDERS, LeakBook
from memtui.model.step_rows import AlertRow, module_label
from memtui_protocol import schema, wire


@dataclass(frozen=True)
class StepAlert:
    """An alert with the step it belongs to, in the order the stream carried it."""

    step: int | None
    alert: schema.Alert
    time: float
    """When the job raised it, by its own clock (the frame's time)."""
    kind: AlertKindShown
    """`alert.kind` converted at the fold (`of`); read this, never the wire's string."""
    final: bool = False
    """Raised by the job's last frame (an OOM, a crash), after every closed step."""

    @classmethod
    def of(
        cls, step: int | None, alert: schema.Alert, time: float, final: bool = False
    ) -> StepAlert:
        """The alert as the fold takes it in, its kind converted once."""
        return cls(step, alert, time, alert_kind(alert.kind), final)


def alert_rows(alerts: list[StepAlert], first: int = 0) -> list[AlertRow]:
    """The alerts as rows the screen and the text report list (and fold, `folded_alerts`),
    in stream order; an alert without a step (an `End`'s) is step 0. `first`: the stream
    index of `alerts[0]` (the screen drops its oldest), which keys each row."""
    return [
        AlertRow(
            item.step or 0,
            item.kind,
            item.alert.message,
            item.alert.where,
            item.alert.group,
            key=f"alert-{first + index}",
        )
        for index, item in enumerate(alerts)
    ]


@dataclass
class Recording:
    """Everything decoded from one recording, in order."""

    path: Path
    hello: schema.Hello
    module_names: dict[int, str] = field(default_factory=dict)
    steps: list[schema.Step] = field(default_factory=list)
    last_tick: schema.Tick | None = None
    agent_errors: list[schema.AgentError] = field(default_factory=list)
    alerts: list[StepAlert] = field(default_factory=list)
    end: schema.End | None = None
    warning: str | None = None
    names_dropped: int = 0
    """Module names beyond `schema.MAX_NAMES` in all, not kept (a hostile or broken writer)."""
    leaks: LeakBook = field(default_factory=LeakBook)
    kept: KeptTrail = field(default_factory=KeptTrail)
    """What the job kept outside every pile, at each step whose close counted it."""
    """The holders the job's censuses named, census by census, and the job's last count."""
    recording_stopped: str | None = None
    """Why the agent's recording stopped early, as the agent said it (a full disk), if it did."""
    late_batches: dict[int, int] = field(default_factory=dict)
    """Late values with alerts folded into each recent step (`schema.apply_late` bounds them)."""

    def module_name(self, module_id: int) -> str:
        """Qualified module name for an id; activations outside any module get a label."""
        return module_label(self.module_names, module_id)

    def how_it_ended(self, stopped: bool = False) -> Ending:
        """`how_it_ended` for this recording: without a final frame, the job is still running
        when its process is alive on this host (a recording still being written), else killed.
        `stopped`: memtui itself stopped the job (the recording cannot say so)."""
        running = self.end is None and not stopped and writer_alive(self.hello)
        return how_it_ended(
            self.end, stopped=stopped, running=running, unrecorded=self.recording_stopped
        )


def apply(recording: Recording, message: schema.Message) -> None:
    """Fold one message into a recording: the one fold behind the report, export and the TUI.

    Every alert lands in `recording.alerts` as it arrives, wherever the stream carried it (an
    early `AlertNow`, a step, a late device value of an earlier step, the `End`), so the report
    and the screen cannot disagree about which alerts a job raised. Leaks land in
    `recording.leaks` the same way: each census's, then the `End`'s final count.
    """
    if isinstance(message, schema.Step):
        if message.late:
            _add_late(recording, message.late, message.t_end)
        recording.steps.append(message)
        if message.leaks or message.census is not None:  # only the steps that took a census
            recording.leaks.stepped(message)
        if message.kept is not None:
            recording.kept.stepped(message)
        if message.alerts:  # most steps have none: the TUI folds thousands a second
            recording.alerts.extend(
                StepAlert.of(message.step, alert, message.t_end) for alert in message.alerts
            )
    elif isinstance(message, schema.AlertNow):
        recording.alerts.append(StepAlert.of(message.step, message.alert, message.time))
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
        if message.component == schema.RECORDING_STOPPED and recording.recording_stopped is None:
            recording.recording_stopped = message.message
    elif isinstance(message, schema.End):
        _add_late(recording, message.late, message.time)
        recording.end = message
        recording.leaks.ended(message)
        recording.alerts.extend(
            StepAlert.of(message.step, alert, message.time, final=True) for alert in message.alerts
        )
    elif isinstance(message, schema.Hello):
        recording.hello = message  # a job that said hello again (a reconnecting agent)


def _add_late(recording: Recording, late: list[schema.StepLate], time: float) -> None:
    """Device values of earlier steps (a CUDA loss) that arrived with a later frame."""
    recording.alerts.extend(
        StepAlert.of(number, alert, time)
        for number, alert in schema.apply_late(recording.steps, late, recording.late_batches)
    )


def read_recording(path: str | os.PathLike[str]) -> Recording:
    """Decode a recording file.

    A damaged frame in the middle is skipped (the decoder finds the next valid frame) and the
    warning says how many bytes were lost, so one bad sector hides one step, not the rest.
    The file is read up to its size when reading began (`file_chunks`' limit): a recording its
    job is still writing is reported as it was then, in time and memory bounded by that size.

    Raises:
        RecordingError: missing, a directory or not a regular file, unreadable, empty, not a
            recording, a version this memtui does not read, or damaged before its hello.
    """
    path = Path(path)
    decoder = wire.FrameDecoder(resync=True)
    folded: list[Recording] = []

    def take(batch: list[schema.Message]) -> None:
        for message in batch:
            if folded:
                apply(folded[0], message)
            elif isinstance(message, schema.Hello):
                folded.append(Recording(path=path, hello=message))
            else:
                raise RecordingError(f"{path}: damaged (first message is not the job's hello)")

    try:
        with open_input(path) as handle:
            size = os.fstat(handle.fileno()).st_size  # a growing file: read to here, no further
            chunks = file_chunks(handle.fileno(), decoder, limit=size)
            warning = pump(chunks, decoder, take, threading.Event())
    except InputFileError as exc:
        raise RecordingError(str(exc)) from None
    except OSError as exc:
        raise RecordingError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not folded:
        if warning is not None and warning != damage_warning(decoder):
            raise RecordingError(f"{path}: {warning}")  # a frame it refused, not a torn tail
        if decoder.bytes_consumed == 0 and decoder.pending == 0:
            raise RecordingError(f"{path}: empty file, not a recording")
        raise RecordingError(f"{path}: truncated before its header was complete")
    recording = folded[0]
    dropped = [
        f"{recording.names_dropped} module names beyond {schema.MAX_NAMES} not kept"
        if recording.names_dropped
        else None,
        f"{recording.leaks.holders_dropped} leak entries beyond {MAX_HOLDERS} holders not kept"
        if recording.leaks.holders_dropped
        else None,
    ]
    recording.warning = "; ".join(text for text in (warning, *dropped) if text) or None
    return recording
