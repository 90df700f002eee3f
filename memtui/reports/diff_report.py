"""`memtui diff A B`: a `RunDiff` as rows (the text and the TUI's table), text, or JSON.

The rows are built once (`diff_rows`) and both the text table and the TUI's `DataTable` show
them, so the two cannot disagree; the JSON (`diff_document`, docs/diff.md) holds the same
figures in bytes. A figure a run does not know is "not known" in every form (null in the JSON),
and so is any change to or from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import msgspec

from memtui.model.run_diff import (
    MODULE_THRESHOLD,
    AlertChange,
    Change,
    DtypeShift,
    ModuleShift,
    RunDiff,
    Side,
)
from memtui.model.step_ranges import step_ranges, steps_words
from memtui.model.step_rows import NOT_KNOWN
from memtui_protocol.peak import PEAK_WORDS
from memtui_protocol.schema import TextEnum, alert_severity
from memtui_protocol.units import format_bytes

DIFF_FORMAT = "memtui-diff"
DIFF_VERSION = 1
"""Bumped only when a key of docs/diff.md changes meaning or goes away; new keys do not."""

NONE = "none"
"""A cell where the run raised no such alert or named no such leak (a count, known to be 0)."""


NOT_LISTED = "not listed"
"""A module that a run's top modules (the agent lists the largest of each step) do not name:
its figure there is not known, which is not 0."""


@dataclass(frozen=True)
class RunName:
    """Which recording a side is: the path as the user gave it, and the rank read from a
    session folder (None: a single recording)."""

    path: str
    rank: str | None = None
    ranks: int = 1
    """Recordings in its folder (1 for a single recording)."""

    @property
    def shown(self) -> str:
        """`runs/a (rank 0 of 2)`, or the path alone."""
        if self.rank is None:
            return self.path
        label = f"rank {self.rank}" if self.rank.isdigit() else self.rank
        return f"{self.path} ({label}; {self.ranks} recordings in the folder)"


class DiffSection(TextEnum):
    """The parts of a diff, in the order they are shown."""

    STEPS = "steps"
    PEAK = "peak"
    PILES = "piles"
    MODULES = "activations by module"
    DTYPES = "dtypes"
    ALERTS = "alerts"
    LEAKS = "leaks"


@dataclass(frozen=True)
class DiffRow:
    """One line of the diff table: what, A's figure, B's, and the change, as shown."""

    section: DiffSection
    what: str
    a: str
    b: str
    change: str
    key: str
    """Unique within a diff: the row's identity in the TUI's table."""


def size_cell(value: int | None, binary: bool = True) -> str:
    """`73.03 KiB (74,784 B)`: human and exact (`512 B` alone is both); "not known" for
    None."""
    if value is None:
        return NOT_KNOWN
    human = format_bytes(value, binary)
    return human if abs(value) < 1000 else f"{human} ({value:,} B)"


def change_cell(change: Change, binary: bool = True) -> str:
    """`+4.25 KiB (+4,352 B, +81.03%)`; "not known" unless both runs know the figure; no
    percentage for a change from 0 (it has none)."""
    delta = change.delta
    if delta is None:
        return NOT_KNOWN
    if delta == 0:
        return "no change"
    sign = "+" if delta > 0 else "-"
    percent = change.percent
    share = f"{percent:+.2f}%" if percent is not None else "from 0"
    if abs(delta) < 1000:  # the human figure is the exact one
        return f"{sign}{abs(delta)} B ({share})"
    return f"{sign}{format_bytes(abs(delta), binary)} ({sign}{abs(delta):,} B, {share})"


def _steps_cell(numbers: tuple[int, ...]) -> str:
    if not numbers:
        return "0"
    return f"{len(numbers)} ({step_ranges(numbers, limit=3)})"


def _alert_what(change: AlertChange) -> str:
    names = f" [{change.key.names}]" if change.key.names else ""
    return f"{alert_severity(change.key.kind)} {change.key.kind}{names}"


def _alert_cell(change: AlertChange) -> str:
    first = f" from step {change.first_step}" if change.first_step is not None else ""
    return f"{change.count}{first}"


def diff_rows(diff: RunDiff, binary: bool = True) -> tuple[DiffRow, ...]:
    """The diff as the table's rows, section by section (see `DiffSection`)."""
    size = partial(size_cell, binary=binary)
    moved = partial(change_cell, binary=binary)
    rows: list[DiffRow] = []
    steps = diff.steps
    common = (
        f"{len(steps.common)} in common: {steps_words(steps.common, limit=3)}"
        if steps.common
        else "no steps in common"
    )
    rows.append(
        DiffRow(
            DiffSection.STEPS, "steps recorded", _steps_cell(steps.a), _steps_cell(steps.b),
            common, "steps",
        )
    )  # fmt: skip
    if steps.largest_peak_change is not None and steps.largest_peak_change[1].delta == 0:
        rows.append(
            DiffRow(
                DiffSection.STEPS, "peak at each common step", "", "",
                "equal at every common step whose peak both runs know", "steps-peak",
            )
        )  # fmt: skip
    elif steps.largest_peak_change is not None:
        number, change = steps.largest_peak_change
        rows.append(
            DiffRow(
                DiffSection.STEPS, f"peak at step {number} (moved most)", size(change.a),
                size(change.b), moved(change), "steps-peak",
            )
        )  # fmt: skip
    peak = diff.peak

    def at(value: int | None, step: int | None) -> str:
        return size(value) + (f" at step {step}" if value is not None else "")

    rows.append(
        DiffRow(
            DiffSection.PEAK, f"peak ({PEAK_WORDS})", at(peak.bytes.a, peak.a_step),
            at(peak.bytes.b, peak.b_step), moved(peak.bytes), "peak",
        )
    )  # fmt: skip
    for pile in diff.piles:
        rows.append(
            DiffRow(
                DiffSection.PILES, f"{pile.pile}: highest", size(pile.peak.a), size(pile.peak.b),
                moved(pile.peak), f"pile-{pile.pile}-peak",
            )
        )  # fmt: skip
        rows.append(
            DiffRow(
                DiffSection.PILES, f"{pile.pile}: at last step", size(pile.end.a),
                size(pile.end.b), moved(pile.end), f"pile-{pile.pile}-end",
            )
        )  # fmt: skip
    rows.extend(_module_rows(diff, binary))
    rows.extend(_dtype_rows(diff, binary))
    rows.extend(_alert_rows(diff))
    rows.extend(_leak_rows(diff, binary))
    return tuple(rows)


def _module_rows(diff: RunDiff, binary: bool) -> list[DiffRow]:
    section = DiffSection.MODULES
    known = diff.modules_known
    if not all(known.values()):
        cells = {side: "stated" if known[side] else NOT_KNOWN for side in Side}
        return [
            DiffRow(
                section, "activations by module", cells[Side.A], cells[Side.B],
                "not compared: a run states no step's activations", "modules",
            )
        ]  # fmt: skip
    if not diff.modules:
        return [
            DiffRow(
                section, "activations by module", "", "",
                f"none moved by more than {MODULE_THRESHOLD:.0%}", "modules",
            )
        ]  # fmt: skip
    rows = []
    for index, change in enumerate(diff.modules):
        if change.shift is ModuleShift.MOVED:
            shown = change_cell(change.bytes, binary)
        elif change.shift is ModuleShift.ONLY_A:
            shown = "only among A's top modules"
        else:
            shown = "only among B's top modules"
        rows.append(
            DiffRow(
                section, f"module {change.module.shown}", _listed(change.bytes.a, binary),
                _listed(change.bytes.b, binary), shown, f"module-{index}",
            )
        )  # fmt: skip
    return rows


def _listed(value: int | None, binary: bool) -> str:
    """A module's figure in one run; `NOT_LISTED` where that run's top modules lack it."""
    return NOT_LISTED if value is None else size_cell(value, binary)


def _dtype_rows(diff: RunDiff, binary: bool) -> list[DiffRow]:
    section = DiffSection.DTYPES
    rows = []
    for index, change in enumerate(diff.dtypes):
        size = size_cell(change.bytes, binary)
        appeared = change.shift is DtypeShift.APPEARED
        rows.append(
            DiffRow(
                section, f"{change.pile}: {change.dtype}", "" if appeared else size,
                size if appeared else "", "appeared in B" if appeared else "vanished in B",
                f"dtype-{index}",
            )
        )  # fmt: skip
    for pile, sides in diff.dtypes_not_known.items():
        rows.append(
            DiffRow(
                section, f"{pile}: dtypes", NOT_KNOWN if Side.A in sides else "stated",
                NOT_KNOWN if Side.B in sides else "stated", "not compared",
                f"dtype-{pile}-not-known",
            )
        )  # fmt: skip
    if not rows:
        rows.append(DiffRow(section, "dtypes", "", "", "none appeared or vanished", "dtypes"))
    return rows


def _alert_rows(diff: RunDiff) -> list[DiffRow]:
    section = DiffSection.ALERTS
    rows = [
        DiffRow(section, _alert_what(change), NONE, _alert_cell(change), "new in B", f"new-{i}")
        for i, change in enumerate(diff.alerts_new)
    ]
    rows += [
        DiffRow(section, _alert_what(change), _alert_cell(change), NONE, "gone in B", f"gone-{i}")
        for i, change in enumerate(diff.alerts_gone)
    ]
    if not rows:
        rows.append(DiffRow(section, "alerts", "", "", "the same kinds, naming the same", "alerts"))
    return rows


def _leak_rows(diff: RunDiff, binary: bool) -> list[DiffRow]:
    section = DiffSection.LEAKS
    rows = [
        DiffRow(
            section, f"leak {leak.holder} ({leak.kind})", NONE, size_cell(leak.bytes, binary),
            "new in B", f"leak-new-{index}",
        )
        for index, leak in enumerate(diff.leaks_new)
    ]  # fmt: skip
    rows += [
        DiffRow(
            section, f"leak {leak.holder} ({leak.kind})", size_cell(leak.bytes, binary), NONE,
            "gone in B", f"leak-gone-{index}",
        )
        for index, leak in enumerate(diff.leaks_gone)
    ]  # fmt: skip
    if not rows:
        rows.append(DiffRow(section, "leaks", "", "", "none new, none gone", "leaks"))
    return rows


def render_diff_text(diff: RunDiff, names: tuple[RunName, RunName], binary: bool = True) -> str:
    """The diff as text: which runs, then the rows as a table under their sections."""
    rows = diff_rows(diff, binary)
    header = ("", "A", "B", "change")
    widths = [
        max(len(header[column]), *(len(_cells(row)[column]) for row in rows)) for column in range(4)
    ]
    lines = [f"A: {names[0].shown}", f"B: {names[1].shown}"]
    section: DiffSection | None = None
    for row in rows:
        if row.section is not section:
            section = row.section
            lines.append(f"{section}:")
        what, a, b, change = _cells(row)
        lines.append(
            f"  {what:<{widths[0]}}  {a:>{widths[1]}}  {b:>{widths[2]}}  {change}".rstrip()
        )
    return "\n".join(lines)


def _cells(row: DiffRow) -> tuple[str, str, str, str]:
    return row.what, row.a, row.b, row.change


class ChangeEntry(msgspec.Struct):
    """One figure in each run (null: not known there), and B minus A (null unless both are
    known; `percent` also null from 0)."""

    a: int | None
    b: int | None
    change: int | None
    percent: float | None


class RunEntry(msgspec.Struct):
    """Which recording a side is, and its steps."""

    path: str
    rank: str | None
    steps: int
    first_step: int | None
    last_step: int | None


class PeakDiff(msgspec.Struct):
    """The runs' peaks (`memtui_protocol.peak`) and the steps they were reached at."""

    a: int | None
    b: int | None
    change: int | None
    percent: float | None
    a_step: int | None
    b_step: int | None


class PileDiff(msgspec.Struct):
    """A pile's highest in each run, and its value at each run's last step."""

    peak: ChangeEntry
    end: ChangeEntry


class ModuleDiff(msgspec.Struct):
    """A module whose activations moved, or that one run's top modules alone list."""

    module: str
    shift: str
    a: int | None
    b: int | None
    change: int | None
    percent: float | None


class ModulesDiff(msgspec.Struct):
    """The modules' activations compared: `known` per run, the threshold, what moved."""

    known: dict[str, bool]
    threshold: float
    changed: list[ModuleDiff]


class DtypeDiff(msgspec.Struct):
    """A dtype that appeared in B's pile or vanished from it, with its bytes where held."""

    pile: str
    dtype: str
    shift: str
    bytes: int


class AlertDiff(msgspec.Struct):
    """Alerts of one kind naming one thing that only one run raised."""

    kind: str
    severity: str
    names: str | None
    count: int
    first_step: int | None


class LeakDiff(msgspec.Struct):
    """A leak only one run's censuses named, with that run's last count."""

    holder: str
    kind: str
    bytes: int


class AlertsDiff(msgspec.Struct):
    """The alerts B raised that A did not (`new_in_b`), and the reverse (`gone_in_b`)."""

    new_in_b: list[AlertDiff]
    gone_in_b: list[AlertDiff]


class LeaksDiff(msgspec.Struct):
    """The leaks B's censuses named that A's did not (`new_in_b`), and the reverse."""

    new_in_b: list[LeakDiff]
    gone_in_b: list[LeakDiff]


class StepPeakDiff(msgspec.Struct):
    """The common step whose peak moved most."""

    step: int
    a: int | None
    b: int | None
    change: int | None
    percent: float | None


class StepsDiff(msgspec.Struct):
    """The steps matched by the job's step numbers."""

    a: int
    b: int
    common: int
    common_first: int | None
    common_last: int | None
    common_ranges: str
    largest_peak_change: StepPeakDiff | None


class DiffDocument(msgspec.Struct):
    """`memtui diff A B --json` (docs/diff.md)."""

    runs: dict[str, RunEntry]
    steps: StepsDiff
    peak: PeakDiff
    piles: dict[str, PileDiff]
    modules: ModulesDiff
    dtypes: list[DtypeDiff]
    dtypes_not_known: dict[str, list[str]]
    alerts: AlertsDiff
    leaks: LeaksDiff
    format: str = DIFF_FORMAT
    version: int = DIFF_VERSION


def _percent(change: Change) -> float | None:
    percent = change.percent
    return round(percent, 2) if percent is not None else None


def _entry(change: Change) -> ChangeEntry:
    return ChangeEntry(change.a, change.b, change.delta, _percent(change))


def _alert_entries(changes: tuple[AlertChange, ...]) -> list[AlertDiff]:
    return [
        AlertDiff(
            kind=str(change.key.kind),
            severity=str(alert_severity(change.key.kind)),
            names=change.key.names,
            count=change.count,
            first_step=change.first_step,
        )
        for change in changes
    ]


def diff_document(diff: RunDiff, names: tuple[RunName, RunName]) -> DiffDocument:
    """The diff as the JSON contract of docs/diff.md."""
    steps = diff.steps
    runs = {
        str(side): RunEntry(
            path=name.path,
            rank=name.rank,
            steps=len(numbers),
            first_step=numbers[0] if numbers else None,
            last_step=numbers[-1] if numbers else None,
        )
        for side, name, numbers in ((Side.A, names[0], steps.a), (Side.B, names[1], steps.b))
    }
    largest = steps.largest_peak_change
    peak = diff.peak
    return DiffDocument(
        runs=runs,
        steps=StepsDiff(
            a=len(steps.a),
            b=len(steps.b),
            common=len(steps.common),
            common_first=steps.common[0] if steps.common else None,
            common_last=steps.common[-1] if steps.common else None,
            common_ranges=step_ranges(steps.common),
            largest_peak_change=StepPeakDiff(
                largest[0], largest[1].a, largest[1].b, largest[1].delta, _percent(largest[1])
            )
            if largest is not None
            else None,
        ),
        peak=PeakDiff(
            peak.bytes.a,
            peak.bytes.b,
            peak.bytes.delta,
            _percent(peak.bytes),
            peak.a_step,
            peak.b_step,
        ),
        piles={str(p.pile): PileDiff(_entry(p.peak), _entry(p.end)) for p in diff.piles},
        modules=ModulesDiff(
            known={str(side): known for side, known in diff.modules_known.items()},
            threshold=MODULE_THRESHOLD,
            changed=[
                ModuleDiff(
                    module=change.module.shown,
                    shift=str(change.shift),
                    a=change.bytes.a,
                    b=change.bytes.b,
                    change=change.bytes.delta,
                    percent=_percent(change.bytes),
                )
                for change in diff.modules
            ],
        ),
        dtypes=[
            DtypeDiff(str(change.pile), change.dtype, str(change.shift), change.bytes)
            for change in diff.dtypes
        ],
        dtypes_not_known={
            str(pile): [str(side) for side in sides]
            for pile, sides in diff.dtypes_not_known.items()
        },
        alerts=AlertsDiff(_alert_entries(diff.alerts_new), _alert_entries(diff.alerts_gone)),
        leaks=LeaksDiff(
            [LeakDiff(leak.holder, str(leak.kind), leak.bytes) for leak in diff.leaks_new],
            [LeakDiff(leak.holder, str(leak.kind), leak.bytes) for leak in diff.leaks_gone],
        ),
    )


__all__ = [
    "DIFF_FORMAT",
    "DIFF_VERSION",
    "DiffDocument",
    "DiffRow",
    "DiffSection",
    "RunName",
    "change_cell",
    "diff_document",
    "diff_rows",
    "render_diff_text",
    "size_cell",
]
