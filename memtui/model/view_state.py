"""What the screen shows, as one frozen slice per panel, built by pure functions.

Each widget is handed only its own slice and redraws only when that slice changes (Textual's
reactive compares the new value with the one it holds and skips the widget when they are
equal): moving from a step to one with the same dtypes leaves the dtype table alone, a new
step while paused redraws the header and the chart, nothing else. Rows carry real identities
(module ids, an alert's place in the stream), never labels, because labels repeat: two root
models of one class name both their trees from the root.

Nothing here imports Textual; `Session.view_state` assembles the slices and tests build them
directly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from memtui.model.alloc_rows import AllocRow
from memtui.model.job_state import Ending, JobState
from memtui.model.kept_trail import KeptAt
from memtui.model.leaks import LeakRow
from memtui.model.rank_rows import RankRow
from memtui.model.step_rows import (
    AlertRow,
    DtypeRow,
    GapRow,
    ModuleRow,
    PileRow,
    activations_known,
    allocator_lines,
    by_severity,
    distributed_notes,
    dtype_rows,
    gap_rows,
    known_piles,
    module_rows,
    pile_rows,
    step_peak,
)
from memtui_protocol import schema
from memtui_protocol.schema import Severity


@dataclass(frozen=True)
class HeaderView:
    """The job header: who the job is, where the view is, how it is fed."""

    title: str
    job: str
    state: str
    """The header's words for `status` (display only: test `status`, never this text)."""
    status: JobState
    ending: Ending | None
    """How the job ended (`how_it_ended`), once `status` is ENDED; None: not ended, or no
    agent ever spoke."""
    replay: bool
    """A recording read back to its end."""
    source: str
    step: int | None
    """The cursor step's number: the job's own (an attached agent numbers frames from the
    job's step count), the same in live, replay, the report and `detach`."""
    steps_total: int
    """The newest step's number (not how many were recorded)."""
    steps_per_second: float | None
    first_step: int | None = None
    """The first recorded step's number when it is not 1 (an agent attached to a running job):
    the header says the steps before it were not recorded."""
    worst: Severity | None = None
    """The highest severity among the run's alerts (None: none, or only notes): the header
    is styled by it and `state` names the worst alert once the run ended."""


@dataclass(frozen=True)
class NotesView:
    """Warnings about the view itself (a damaged recording, an agent part that turned off)."""

    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PilesView:
    """The cursor step's peak composition and what the user should know about the step."""

    rows: tuple[PileRow, ...]
    binary: bool
    peak: int | None = None
    """The step's peak as every view states it (`step_peak`: the piles at the peak plus DDP's
    buckets and FSDP's gathered parameters; None before the first step or when not known)."""
    step_owner: str | None = None
    """Whose step it is, where that needs saying: the optimizer when several step, or that a
    backward closed it (a job without an optimizer)."""
    loss: float | None = None
    skipped: bool = False
    microbatches: int = 0
    activations_measured: bool = True
    """The step's activations were measured (hooks armed); else carried or not known."""
    activations_from: int | None = None
    """The measured step whose activation figures this step carries."""
    activations_known: bool = True
    """Measured or carried: False, the rows say "not known" instead of the frame's partial
    figures."""
    activations_why_at: int | None = None
    """Activations not known: the step whose `activations_vary` alert says why."""
    distributed_lines: tuple[str, ...] = ()
    kept: KeptAt | None = None
    """What the job kept outside every pile (part of `other`), as the latest census at or
    before this step counted it."""


@dataclass(frozen=True)
class GapView:
    """Where the bytes are: each memory level and what the difference to the one below means."""

    rows: tuple[GapRow, ...]
    binary: bool
    allocator_lines: tuple[str, ...] = ()
    leaks: tuple[LeakRow, ...] = ()
    """What each growing holder keeps alive, as of the cursor step: the latest census at or
    before it, largest first (`LeakBook.as_of`)."""
    leaks_final: bool = False
    """The leaks are the job's last count (`End.leaks`): the cursor is on the last step of a
    job that ended."""


@dataclass(frozen=True)
class TimelineView:
    """The chart's window of steps around the cursor, as the chart needs it."""

    steps: tuple[int, ...]
    piles: tuple[schema.Piles, ...]
    """Each step's composition at its peak (stacked bottom-up in `Pile` order)."""
    alerts: frozenset[int]
    cursor_step: int | None
    binary: bool
    allocated: tuple[int | None, ...] = ()
    reserved: tuple[int | None, ...] = ()
    """Allocator levels per step (GPU jobs); empty or None where there is no allocator."""
    carried: frozenset[int] = frozenset()
    """Steps in the window whose activations were carried from a measured step."""
    unknown: frozenset[int] = frozenset()
    """Steps in the window whose activations are not known: `piles` holds them at zero (the
    frame's figure is partial) and the chart marks them instead."""


@dataclass(frozen=True)
class AlertsView:
    """The alerts table: errors first, then warnings, each newest first, follow-on ones folded
    under the first; the notes (what a healthy run raises) counted, and listed after the
    warnings only when the user asked for them (`notes_shown`)."""

    rows: tuple[AlertRow, ...] = ()
    """What the table lists, worst first (`by_severity`): its first row is the newest alert of
    the highest severity."""
    errors: int = 0
    warnings: int = 0
    notes: int = 0
    """Rows of each severity (folded), listed or not."""
    notes_shown: bool = False
    """The notes are among `rows` (`o` toggles them)."""

    def title(self) -> str:
        """The alerts panel's title: how many of each severity, and the notes' key."""
        counts = [
            f"{count} {word}{'s' if count != 1 else ''}"
            for count, word in ((self.errors, "error"), (self.warnings, "warning"))
            if count
        ]
        if self.notes:
            action = "o: hide" if self.notes_shown else "o: list"
            counts.append(f"notes: {self.notes} ({action})")
        return "Alerts" + (": " + " · ".join(counts) if counts else " (none)")

    def step_of(self, key: str) -> int | None:
        """The step of the alert with this row key (a table's selection), from the data."""
        return next((row.step for row in self.rows if row.key == key), None)


@dataclass(frozen=True)
class DtypesView:
    """Pile x dtype at the cursor step (one "not known" row for activations the step does not
    know)."""

    rows: tuple[DtypeRow, ...]
    binary: bool


@dataclass(frozen=True)
class ActivationsView:
    """Modules by saved-activation bytes at the cursor step, by module id."""

    rows: tuple[ModuleRow, ...]
    binary: bool
    known: bool = True
    """False: the step's activations are not known, so no module's share of them is (no rows)."""


@dataclass(frozen=True)
class RanksView:
    """Every rank side by side (only with several ranks)."""

    rows: tuple[RankRow, ...] = ()
    shown: str = ""
    """The label of the rank on screen."""
    binary: bool = True


@dataclass(frozen=True)
class AllocationsView:
    """The allocator's events of the cursor step (`--alloc-events`)."""

    recorded: bool = False
    """The job runs with `--alloc-events`: the allocations table is on screen."""
    rows: tuple[AllocRow, ...] = ()
    binary: bool = True


@dataclass(frozen=True)
class ViewState:
    """Everything the screen shows, for one cursor position: one slice per panel."""

    header: HeaderView
    notes: NotesView
    piles: PilesView
    gap: GapView
    timeline: TimelineView
    alerts: AlertsView
    dtypes: DtypesView
    activations: ActivationsView
    allocations: AllocationsView
    ranks: RanksView = RanksView()


def alerts_view(folded: tuple[AlertRow, ...], notes_shown: bool) -> AlertsView:
    """The alerts table's slice from the folded rows (newest first): worst first, the notes
    left out unless shown, and how many of each severity there are."""
    ordered = by_severity(folded)
    counts = Counter(row.severity for row in ordered)
    rows = tuple(row for row in ordered if row.listed(notes_shown))
    return AlertsView(
        rows,
        errors=counts[Severity.ERROR],
        warnings=counts[Severity.WARNING],
        notes=counts[Severity.NOTE],
        notes_shown=notes_shown,
    )


def piles_view(
    step: schema.Step | None,
    live: schema.Piles | None,
    binary: bool,
    step_owner: str | None = None,
    kept: KeptAt | None = None,
) -> PilesView:
    """The piles panel for the cursor step (or the live piles before the first step closes),
    with `kept`: the latest count at or before it of what the job keeps outside every pile."""
    rows = pile_rows(step, live if step is None else None)
    if step is None:
        return PilesView(rows, binary)
    return PilesView(
        rows,
        binary,
        peak=step_peak(step),
        step_owner=step_owner,
        loss=step.loss,
        skipped=step.skipped,
        microbatches=step.microbatches,
        activations_measured=step.activations_measured,
        activations_from=step.activations_from,
        activations_known=activations_known(step),
        activations_why_at=step.activations_why_at,
        distributed_lines=distributed_notes(step, binary),
        kept=kept,
    )


def gap_view(
    step: schema.Step | None,
    live: schema.Piles | None,
    binary: bool,
    leaks: tuple[LeakRow, ...] = (),
    leaks_final: bool = False,
) -> GapView:
    """The gap panel for the cursor step (or the live piles before the first step closes),
    with the leaks as of that step."""
    return GapView(
        gap_rows(step, live if step is None else None),
        binary,
        allocator_lines(step, binary),
        leaks,
        leaks_final and bool(leaks),
    )


def timeline_view(
    window: list[schema.Step], alert_steps: frozenset[int], cursor: int | None, binary: bool
) -> TimelineView:
    """The chart's slice of a window of steps (the Session cuts it around the cursor)."""
    return TimelineView(
        steps=tuple(step.step for step in window),
        piles=tuple(_chart_piles(step) for step in window),
        alerts=alert_steps,
        cursor_step=cursor,
        binary=binary,
        allocated=tuple(step.allocator.allocated for step in window),
        reserved=tuple(step.allocator.reserved for step in window),
        carried=frozenset(
            step.step
            for step in window
            if not step.activations_measured and step.activations_from is not None
        ),
        unknown=frozenset(step.step for step in window if not activations_known(step)),
    )


def _chart_piles(step: schema.Step) -> schema.Piles:
    """The step's peak composition as the chart stacks it: None for each pile the step does
    not know at its peak (the chart draws the known ones under a `?`)."""
    return known_piles(step, step.peak)


def dtypes_view(step: schema.Step | None, binary: bool) -> DtypesView:
    """The dtype table for the cursor step."""
    return DtypesView(dtype_rows(step), binary)


def activations_view(
    step: schema.Step | None, names: dict[int, str], binary: bool
) -> ActivationsView:
    """The top-activations table for the cursor step, each row keyed by its module id."""
    known = step is None or activations_known(step)
    return ActivationsView(module_rows(step, names), binary, known)
