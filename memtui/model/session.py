"""The Session model: messages in, immutable ViewStates out. No Textual, no torch.

Live sockets and recordings feed the same `ingest()`, so the widgets, which only ever see their
slice of a `ViewState`, cannot tell them apart. Everything the screen shows is computed here by
pure code and tested without an app: the cursor, alerts navigation, units, the gap rows and their
meaning.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from memtui.model.alert_summary import AlertTally, alert_tally
from memtui.model.alloc_rows import AllocRow, alloc_rows, unfinished_step_number
from memtui.model.job_state import Ending, JobState, ending_text, how_it_ended
from memtui.model.kept_trail import KeptAt
from memtui.model.leaks import LeakRow
from memtui.model.recording import Recording, alert_rows, apply
from memtui.model.step_rows import AlertRow, folded_alerts
from memtui.model.view_state import (
    AllocationsView,
    HeaderView,
    NotesView,
    ViewState,
    activations_view,
    alerts_view,
    dtypes_view,
    gap_view,
    piles_view,
    timeline_view,
)
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, ExitStatus, Severity

MAX_STEPS = 200_000
MAX_ALERTS = 10_000
RATE_WINDOW_SECONDS = 10.0


@dataclass(frozen=True)
class AlertMiss:
    """`n`/`N` found no step with an alert of its own that way: what is there instead."""

    step: int
    """The cursor's step, where it stays."""
    forward: bool
    grouped: int = 0
    """Alerts that way that follow from an earlier one (folded under it: not stops)."""
    grouped_steps: tuple[int, int] | None = None
    """The first and last step of those alerts."""
    group: int | None = None
    """The step of the alert they follow from."""


@dataclass
class Session:
    """One job's Recording (the one fold of its stream), plus the viewer's cursor, pause and
    unit choices.

    The stream is folded by `recording.apply`, the same function `memtui report` and `export`
    use, so the screen and the report cannot disagree; the Session adds only what a viewer
    needs on top (the cursor, bounded history, the step rate).
    """

    source_label: str = ""
    live: bool = True
    following: bool = False
    """A recording read back while its job still writes it (`memtui replay` of a running job):
    live in every way, and the header says the job is running, as `memtui report` does."""
    recording: Recording | None = None
    """None until the job's hello arrives (every stream starts with it)."""
    cursor: int | None = None
    optimizer_names: set[str] = field(default_factory=set)
    follow: bool = True
    paused: bool = False
    binary: bool = True
    notes_shown: bool = False
    """The alerts table lists the notes too (`o`); by default it counts them."""
    disconnected: str | None = None
    exit_code: int | None = None
    stopped: bool = False
    """memtui itself stopped the job (quit from the TUI): no final frame, yet not killed."""
    warning: str | None = None
    dropped_steps: int = 0
    alerts_trimmed: int = 0
    """Oldest alerts dropped past MAX_ALERTS (keeps every alert's key stable)."""
    alloc_recorded: bool = False
    first_step: int | None = None
    """The first recorded step's number (kept when old steps are dropped from the view)."""
    agent_attached: bool = False
    """The job's agent was put into it by `memtui attach` (its first frame's `attached`
    alert): quitting the viewer leaves an agent recording that nobody started with the job."""
    version: int = 0
    """Bumped on every change, so the UI can skip rendering when nothing moved."""
    _step_times: deque[float] = field(default_factory=lambda: deque(maxlen=256))
    _alert_rows: tuple[tuple[int, int], list[AlertRow]] = field(
        default_factory=lambda: ((0, 0), [])
    )
    _tally: tuple[tuple[int, int, int], AlertTally | None] = ((0, 0, 0), None)

    # ----- the recording, read through ----------------------------------------------------

    @property
    def hello(self) -> schema.Hello | None:
        return self.recording.hello if self.recording is not None else None

    @property
    def steps(self) -> list[schema.Step]:
        return self.recording.steps if self.recording is not None else []

    @property
    def end(self) -> schema.End | None:
        return self.recording.end if self.recording is not None else None

    @property
    def module_names(self) -> dict[int, str]:
        return self.recording.module_names if self.recording is not None else {}

    @property
    def agent_errors(self) -> list[schema.AgentError]:
        return self.recording.agent_errors if self.recording is not None else []

    @property
    def last_tick(self) -> schema.Tick | None:
        return self.recording.last_tick if self.recording is not None else None

    @property
    def alerts(self) -> list[AlertRow]:
        """Every alert in the order the stream carried it (an `End`'s without a step: 0)."""
        if self.recording is None:
            return []
        first, alerts = self.alerts_trimmed, self.recording.alerts
        # Alerts are only appended (and trimmed at the front): rebuild the rows only then.
        if self._alert_rows[0] != (first, len(alerts)):
            self._alert_rows = ((first, len(alerts)), alert_rows(alerts, first))
        return self._alert_rows[1]

    # ----- input --------------------------------------------------------------------------

    def ingest(self, messages: list[schema.Message]) -> None:
        """Fold a batch of messages in, in order (from a socket or a recording)."""
        for message in messages:
            recording = self.recording
            if recording is None:
                if isinstance(message, schema.Hello):
                    self.recording = Recording(path=Path(self.source_label), hello=message)
                continue  # nothing comes before a hello in any stream memtui reads
            apply(recording, message)
            if type(message) is schema.Step:
                self._stepped(message, recording.steps)
            elif isinstance(message, schema.End):
                self.alloc_recorded |= message.alloc_events is not None
        if self.recording is not None and len(self.recording.alerts) > MAX_ALERTS:
            cut = len(self.recording.alerts) - MAX_ALERTS + MAX_ALERTS // 10
            del self.recording.alerts[:cut]
            self.alerts_trimmed += cut
        if messages:
            self.version += 1

    def _stepped(self, step: schema.Step, steps: list[schema.Step]) -> None:
        """The viewer's side of a new step: its rate, the cursor, bounded history."""
        if step.optimizer is not None:
            self.optimizer_names.add(step.optimizer)
        self.alloc_recorded |= step.alloc_events is not None
        if self.first_step is None:
            self.first_step = step.step
        if step.alerts and any(alert.kind == AlertKind.ATTACHED for alert in step.alerts):
            self.agent_attached = True
        self._step_times.append(step.t_end)
        if len(steps) > MAX_STEPS:
            # Bounded history: drop the oldest tenth at once so trimming stays rare.
            cut = MAX_STEPS // 10
            del steps[:cut]
            self.dropped_steps += cut
            if self.cursor is not None:
                self.cursor = max(0, self.cursor - cut)
        if self.follow and not self.paused:
            self.cursor = len(steps) - 1

    def mark_disconnected(self, reason: str) -> None:
        """The stream ended; without an `End` the job died or the socket broke."""
        self.disconnected = reason
        self.version += 1

    # ----- viewer actions -------------------------------------------------------------------

    def toggle_pause(self) -> None:
        """Freeze the live view on the current step (frames keep arriving) or resume following."""
        self.paused = not self.paused
        if not self.paused:
            self.follow = True
            self.cursor = len(self.steps) - 1 if self.steps else None
        self.version += 1

    def move(self, delta: int) -> None:
        """Step the cursor; moving off the newest step stops following live frames."""
        if not self.steps:
            return
        current = self.cursor if self.cursor is not None else len(self.steps) - 1
        self.cursor = min(max(current + delta, 0), len(self.steps) - 1)
        self.follow = self.cursor == len(self.steps) - 1
        self.version += 1

    def home(self) -> None:
        """First step."""
        self.move(-len(self.steps))

    def end_key(self) -> None:
        """Newest step, following live frames again."""
        self.move(len(self.steps))

    def jump_to_step(self, number: int) -> None:
        """Put the cursor on the step with this number (e.g. from a selected alert)."""
        for index in range(len(self.steps) - 1, -1, -1):
            if self.steps[index].step == number:
                self.cursor = index
                self.follow = index == len(self.steps) - 1
                self.version += 1
                return

    def next_alert(self, direction: int = 1) -> AlertMiss | None:
        """Move to the nearest step after (or before) the cursor that has an alert; when there
        is none that way, stay and say why (None: the cursor moved)."""
        if not self.steps or self.cursor is None:
            return None
        here = self.steps[self.cursor].step
        # Grouped alerts (every step after the weights went non-finite) are not stops of their
        # own: navigation lands on the first alert of the group instead.
        # Notes are stops only while the table lists them (`o`), like the timeline's marks.
        steps_with_alerts = sorted(
            {
                alert.step
                for alert in self.alerts
                if alert.group is None and alert.listed(self.notes_shown)
            }
        )
        if direction > 0:
            targets = [number for number in steps_with_alerts if number > here]
            target = targets[0] if targets else None
        else:
            targets = [number for number in steps_with_alerts if number < here]
            target = targets[-1] if targets else None
        if target is not None:
            self.jump_to_step(target)
            return None
        that_way = [
            alert
            for alert in self.alerts
            if alert.group is not None and (alert.step - here) * direction > 0
        ]
        if not that_way:
            return AlertMiss(here, direction > 0)
        steps = sorted({alert.step for alert in that_way})
        return AlertMiss(
            here,
            direction > 0,
            grouped=len(that_way),
            grouped_steps=(steps[0], steps[-1]),
            group=that_way[0].group,
        )

    def toggle_notes(self) -> None:
        """List the notes in the alerts table, or count them only (the default)."""
        self.notes_shown = not self.notes_shown
        self.version += 1

    def tally(self) -> AlertTally | None:
        """The run's alerts by kind, errors first (`alert_tally`, the end-of-run line's), kept
        until an alert arrives (None: no hello yet). A step without alerts leaves it alone: a
        NaN loss's alert comes with its step's loss (or with the late value that carries it),
        so the tally is not redone at every step of a long run."""
        if self.recording is None:
            return None
        shape = (self.alerts_trimmed, len(self.recording.alerts), self.dropped_steps)
        if self._tally[0] != shape or self._tally[1] is None:
            self._tally = (shape, alert_tally(self.recording))
        return self._tally[1]

    def worst(self) -> Severity | None:
        """The highest severity of the run's alerts; None for none or only notes."""
        tally = self.tally()
        return tally.worst.severity if tally is not None and tally.worst is not None else None

    def toggle_units(self) -> None:
        """Binary (KiB/MiB/GiB) <-> decimal (kB/MB/GB)."""
        self.binary = not self.binary
        self.version += 1

    # ----- output ---------------------------------------------------------------------------

    def job_state(self) -> JobState:
        """Waiting, live, paused, or ended (a recording read to its end, a closed stream)."""
        if self.end is not None or self.disconnected is not None or not self.live:
            return JobState.ENDED
        if self.hello is None:
            return JobState.WAITING
        return JobState.PAUSED if self.paused else JobState.LIVE

    def ending(self) -> Ending | None:
        """How the job ended (`how_it_ended`), once the stream is over; None while it is not,
        or when no agent ever spoke (nothing to call killed)."""
        if self.job_state() is not JobState.ENDED or self.hello is None:
            return None
        stopped_early = self.recording.recording_stopped if self.recording is not None else None
        return how_it_ended(self.end, stopped=self.stopped, unrecorded=stopped_early)

    def status_text(self) -> str:
        """live / paused / waiting, or how the job ended with its exit status."""
        state = self.job_state()
        if state is JobState.LIVE and self.following:
            return str(ExitStatus.RUNNING)  # `memtui report` on the same file: "job running"
        if state is not JobState.ENDED:
            return str(state)
        tally = self.tally()
        worst = tally.worst if tally is not None else None
        return ending_text(
            self.ending(),
            self.end,
            exit_code=self.exit_code,
            disconnected=self.disconnected,
            unrecorded=self.recording.recording_stopped if self.recording is not None else None,
            worst=worst.words() if worst is not None and worst.severity is Severity.ERROR else None,
        )

    def state_text(self) -> str:
        """The header's words: the status, after "replay" in a replay (which step is the
        header's `step` and `steps_total`, the job's own numbers, live or not)."""
        if self.live:
            return self.status_text()
        return f"replay · {self.status_text()}"

    def still_recording(self) -> bool:
        """Whether the job's agent still runs: the stream is live and has not ended."""
        return self.live and self.job_state() in (JobState.LIVE, JobState.PAUSED)

    def steps_per_second(self) -> float | None:
        """Closed steps per second over the last few seconds of the job's own clock."""
        if len(self._step_times) < 2:
            return None
        newest = self._step_times[-1]
        recent = [stamp for stamp in self._step_times if newest - stamp <= RATE_WINDOW_SECONDS]
        if len(recent) < 2 or recent[-1] == recent[0]:
            return None
        return (len(recent) - 1) / (recent[-1] - recent[0])

    def view_state(self, timeline_width: int = 120, extra_notes: tuple[str, ...] = ()) -> ViewState:
        """The immutable view of the cursor step, the timeline window and the alerts."""
        step = self.steps[self.cursor] if self.steps and self.cursor is not None else None
        live = self._live_piles() if step is None else None
        cursor_step = step.step if step is not None else None
        return ViewState(
            header=self._header(step),
            notes=NotesView(self._notes(extra_notes)),
            piles=piles_view(step, live, self.binary, self._step_owner(step), self._kept(step)),
            gap=gap_view(step, live, self.binary, *self._leaks(step)),
            timeline=timeline_view(
                self._timeline_window(timeline_width),
                frozenset(alert.step for alert in self.alerts if alert.listed(self.notes_shown)),
                cursor_step,
                self.binary,
            ),
            alerts=alerts_view(folded_alerts(self.alerts[-2000:])[:500], self.notes_shown),
            dtypes=dtypes_view(step, self.binary),
            activations=activations_view(step, self.module_names, self.binary),
            allocations=AllocationsView(self.alloc_recorded, self._alloc_rows(step), self.binary),
        )

    def _header(self, step: schema.Step | None) -> HeaderView:
        hello = self.hello
        return HeaderView(
            title=f"pid {hello.pid} · {hello.device} · torch {hello.torch}"
            if hello is not None
            else "",
            job=" ".join(hello.argv) if hello is not None else "",
            state=self.state_text(),
            status=self.job_state(),
            ending=self.ending(),
            replay=not self.live,
            source=self._source_words(),
            step=step.step if step is not None else None,
            steps_total=self.steps[-1].step if self.steps else 0,
            steps_per_second=self.steps_per_second(),
            first_step=self.first_step if self.first_step != 1 else None,
            worst=self.worst(),
        )

    def _source_words(self) -> str:
        """Where the frames come from; a recording its job is still writing says so until the
        job's End (or its death) ends it; a socket names the recording the agent writes (a
        recording read back is its own source: never "recording to")."""
        hello = self.hello
        if self.following and hello is not None and self.job_state() is not JobState.ENDED:
            return f"{self.source_label} (pid {hello.pid} is still writing it)"
        if (
            self.live
            and not self.following
            and hello is not None
            and hello.recording
            and hello.recording not in self.source_label
        ):
            return f"recording to {hello.recording} · {self.source_label}"  # the file first
        return self.source_label

    def _notes(self, extra_notes: tuple[str, ...]) -> tuple[str, ...]:
        notes = list(extra_notes)
        if self.warning:
            notes.append(self.warning)
        notes.extend(f"agent: {e.component} off: {e.message}" for e in self.agent_errors[-3:])
        if self.dropped_steps:
            notes.append(f"{self.dropped_steps} oldest steps dropped from the view")
        return tuple(notes)

    def _step_owner(self, step: schema.Step | None) -> str | None:
        if step is None:
            return None
        if step.closed_by is schema.StepTrigger.BACKWARD:
            return "step = one backward() (no optimizer stepped)"
        if len(self.optimizer_names) > 1 and step.optimizer is not None:
            return f"{step.optimizer} step {step.optimizer_step}"
        return None

    def _kept(self, step: schema.Step | None) -> KeptAt | None:
        """What the job kept outside every pile as of the cursor step (the latest census at or
        before it); None when that census found nothing (a line "0 B in 0 tensors" says
        nothing the user can act on; the report's JSON keeps the count)."""
        if step is None or self.recording is None:
            return None
        found = self.recording.kept.at(step.step)
        if found is not None and found.kept.bytes == 0 and not found.kept.holders:
            return None
        return found

    def _leaks(self, step: schema.Step | None) -> tuple[tuple[LeakRow, ...], bool]:
        """The leaks as of the cursor step (the latest census at or before it) and whether they
        are the job's last count: on the last step of a job that ended, the `End`'s."""
        if self.recording is None:
            return (), False
        final = self.end is not None and (step is None or self.cursor == len(self.steps) - 1)
        number = step.step if step is not None else 0
        return self.recording.leaks.as_of(number, final), final

    def _alloc_rows(self, step: schema.Step | None) -> tuple[AllocRow, ...]:
        """The cursor step's allocator events; on the newest step also the step that never
        closed (where an OOM that killed the job is)."""
        if not self.alloc_recorded:
            return ()
        newest = step is None or self.cursor == len(self.steps) - 1
        end_events = self.end.alloc_events if self.end is not None and newest else None
        return alloc_rows(
            step.alloc_events if step is not None else None,
            self.binary,
            end_events,
            unfinished_step_number(self.steps) if end_events is not None else None,
            has_step=step is not None,
        )

    def _live_piles(self) -> schema.Piles | None:
        return self.last_tick.piles if self.last_tick is not None else None

    def _timeline_window(self, width: int) -> list[schema.Step]:
        """Up to `width` steps ending at (or around) the cursor."""
        if not self.steps:
            return []
        cursor = self.cursor if self.cursor is not None else len(self.steps) - 1
        end = min(len(self.steps), max(cursor + 1, min(len(self.steps), width)))
        start = max(0, end - width)
        return self.steps[start:end]
