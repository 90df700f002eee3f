"""Two runs compared (`memtui diff A B`): what moved between a recording A and a recording B.

Pure: two `Recording`s in, one frozen `RunDiff` out, no I/O. Every figure is one the report
states for its own run, by the report's own rules (`step_rows`: a pile a step does not know is
left out, the peak is `memtui_protocol.peak`'s), so `memtui report A` and `memtui report B`
show the two sides of each row. A figure not known in either run is a `Change` whose side is
None: never a 0, and never a change from 0.

Runs are matched by the job's own step numbers (the frames'), never by position: an agent
attached at step 500 records steps 500 on. Alerts and leaks are matched by what they name (an
alert's kind and the module or tensor it names, a leak's holder and kind), never by step, so
the same NaN at step 7 in A and at step 9 in B is no news.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from memtui.model.alert_kinds import AlertKindShown
from memtui.model.leaks import LeakKindShown
from memtui.model.recording import Recording, StepAlert
from memtui.model.step_rows import activations_known, module_label, pile_figure, step_peak
from memtui_protocol import schema
from memtui_protocol.schema import Pile, TextEnum

MODULE_THRESHOLD = 0.01
"""A module's activations moved when the two runs' figures differ by more than this share of
the larger one (1%): the agent counts them to the byte, so an equal job gives equal figures and
anything above this is a real change of the job, not rounding."""


class Side(TextEnum):
    """Which of the two runs: A (the first path, the baseline) or B (the one compared to it)."""

    A = "a"
    B = "b"


class ModuleShift(TextEnum):
    """How one module's activations differ between the runs."""

    MOVED = "moved"
    """In both runs' top modules, by more than `MODULE_THRESHOLD`."""
    ONLY_A = "only_a"
    """Among A's top modules only: B's figure is not known (B lists only its largest)."""
    ONLY_B = "only_b"
    """Among B's top modules only: A's figure is not known."""


class DtypeShift(TextEnum):
    """A dtype that one run's pile held and the other's never did."""

    APPEARED = "appeared"
    """In B's pile, never in A's."""
    VANISHED = "vanished"
    """In A's pile, never in B's."""


@dataclass(frozen=True)
class Change:
    """One figure in each run; None where that run does not know it (docs/numbers.md)."""

    a: int | None
    b: int | None

    @property
    def delta(self) -> int | None:
        """B minus A in bytes; None unless both are known."""
        return self.b - self.a if self.a is not None and self.b is not None else None

    @property
    def percent(self) -> float | None:
        """The change as a share of A, in percent; None unless both are known and A is not 0
        (a change from nothing has no ratio)."""
        delta = self.delta
        return 100.0 * delta / self.a if delta is not None and self.a else None


@dataclass(frozen=True)
class PileChange:
    """One pile: its highest value over the run and its value at the run's last step."""

    pile: Pile
    peak: Change
    end: Change


@dataclass(frozen=True)
class PeakChange:
    """The run's peak (`memtui_protocol.peak`: the piles at their highest plus DDP/FSDP
    buffers), the highest over the steps that know theirs, with the step it was reached at."""

    bytes: Change
    a_step: int | None
    b_step: int | None


@dataclass(frozen=True)
class ModuleKey:
    """A module as two runs of one job both name it: its qualified name, and which of the
    modules with that name it is (two root models of one class name their trees alike; ids
    differ between runs, the order they were named in does not)."""

    label: str
    ordinal: int = 1

    @property
    def shown(self) -> str:
        """The name, with `#2` for the second module of that name."""
        return self.label if self.ordinal == 1 else f"{self.label}#{self.ordinal}"


@dataclass(frozen=True)
class ModuleChange:
    """A module whose saved activations (its highest in the run) moved, or that only one run
    lists among its top modules."""

    module: ModuleKey
    bytes: Change
    shift: ModuleShift


@dataclass(frozen=True)
class DtypeChange:
    """A dtype that appeared in or vanished from one pile; `bytes`: its highest in the run
    that has it."""

    pile: Pile
    dtype: str
    shift: DtypeShift
    bytes: int


@dataclass(frozen=True)
class AlertKey:
    """An alert as two runs are compared on it: its kind and the module or tensor it names
    (`Alert.where`, else its NaN origin's module), never its step."""

    kind: AlertKindShown
    names: str | None


@dataclass(frozen=True)
class AlertChange:
    """Alerts of one key that only one run raised: how many, and the first step there."""

    key: AlertKey
    count: int
    first_step: int | None


@dataclass(frozen=True)
class LeakChange:
    """A leak (a holder and what it keeps) that only one run's censuses named, with that
    run's last count of its bytes."""

    holder: str
    kind: LeakKindShown
    bytes: int


@dataclass(frozen=True)
class StepOverlap:
    """The runs' steps matched by the job's step numbers."""

    a: tuple[int, ...]
    """A's step numbers, in order, each once."""
    b: tuple[int, ...]
    common: tuple[int, ...]
    """The step numbers both runs recorded."""
    largest_peak_change: tuple[int, Change] | None
    """Among the common steps whose peak both runs know: the one whose peak moved most (the
    first of equals), with both peaks; None when there is none."""


@dataclass(frozen=True)
class RunDiff:
    """Everything `memtui diff` shows, for the text, the JSON and the TUI alike."""

    piles: tuple[PileChange, ...]
    peak: PeakChange
    modules: tuple[ModuleChange, ...]
    """Largest change first; the modules only one run lists after those in both."""
    modules_known: dict[Side, bool]
    """Whether the run states any step's activations by module: without, its modules are not
    compared (a run under `--activations off` names none, and that says nothing of B's)."""
    dtypes: tuple[DtypeChange, ...]
    dtypes_not_known: dict[Pile, tuple[Side, ...]]
    """Piles whose dtypes a run never states (its figure not known at every step): not
    compared, with the runs that lack them."""
    alerts_new: tuple[AlertChange, ...]
    """Alerts B raised that A did not (by kind and what they name)."""
    alerts_gone: tuple[AlertChange, ...]
    """Alerts A raised that B did not."""
    leaks_new: tuple[LeakChange, ...]
    leaks_gone: tuple[LeakChange, ...]
    steps: StepOverlap


def diff_runs(a: Recording, b: Recording) -> RunDiff:
    """What moved from run A to run B (see the module)."""
    modules_a, modules_b = module_highs(a), module_highs(b)
    known = {Side.A: modules_a is not None, Side.B: modules_b is not None}
    dtypes_a, dtypes_b = dtype_highs(a.steps), dtype_highs(b.steps)
    alerts_a, alerts_b = alerts_by_key(a.alerts), alerts_by_key(b.alerts)
    leaks_a, leaks_b = leak_index(a), leak_index(b)
    return RunDiff(
        piles=tuple(
            PileChange(
                pile,
                Change(pile_high(a.steps, pile), pile_high(b.steps, pile)),
                Change(pile_end(a.steps, pile), pile_end(b.steps, pile)),
            )
            for pile in Pile
        ),
        peak=peak_change(a.steps, b.steps),
        modules=module_changes(modules_a, modules_b)
        if modules_a is not None and modules_b is not None
        else (),
        modules_known=known,
        dtypes=dtype_changes(dtypes_a, dtypes_b),
        dtypes_not_known={
            pile: sides
            for pile in Pile
            if (
                sides := tuple(
                    side
                    for side, highs in ((Side.A, dtypes_a), (Side.B, dtypes_b))
                    if pile not in highs
                )
            )
        },
        alerts_new=alerts_only(alerts_b, alerts_a),
        alerts_gone=alerts_only(alerts_a, alerts_b),
        leaks_new=leaks_only(leaks_b, leaks_a),
        leaks_gone=leaks_only(leaks_a, leaks_b),
        steps=step_overlap(a.steps, b.steps),
    )


def pile_high(steps: list[schema.Step], pile: Pile) -> int | None:
    """A pile's highest value over a run (each step's high, `Step.max`), over the steps that
    know it: the report's "highest in run"; None when no step knows it (or there is none)."""
    highs = [high for step in steps if (high := pile_figure(step, step.max, pile)) is not None]
    return max(highs, default=None)


def pile_end(steps: list[schema.Step], pile: Pile) -> int | None:
    """A pile at the run's last closed step; None when that step does not know it."""
    if not steps:
        return None
    last = steps[-1]
    return pile_figure(last, last.end, pile)


def highest_peak(steps: list[schema.Step]) -> tuple[int, int] | None:
    """The run's peak and the step it was reached at (the first of equals), over the steps
    that know theirs (`step_peak`): the report's "peak"; None when none does."""
    best: tuple[int, int] | None = None
    for step in steps:
        total = step_peak(step)
        if total is not None and (best is None or total > best[0]):
            best = (total, step.step)
    return best


def peak_change(a: list[schema.Step], b: list[schema.Step]) -> PeakChange:
    """Both runs' peaks, with their steps."""
    peak_a, peak_b = highest_peak(a), highest_peak(b)
    return PeakChange(
        Change(peak_a[0] if peak_a else None, peak_b[0] if peak_b else None),
        peak_a[1] if peak_a else None,
        peak_b[1] if peak_b else None,
    )


def module_highs(recording: Recording) -> dict[ModuleKey, int] | None:
    """Each module's highest saved activations over the steps that state them (a step whose
    activations are not known lists only part of them), keyed by name; None when no step
    states them."""
    steps = [step for step in recording.steps if activations_known(step)]
    if not steps:
        return None
    ids = sorted({item.module for step in steps for item in step.top_activations})
    seen: Counter[str] = Counter()
    keys: dict[int, ModuleKey] = {}
    for module_id in ids:
        label = module_label(recording.module_names, module_id)
        seen[label] += 1
        keys[module_id] = ModuleKey(label, seen[label])
    highs: dict[ModuleKey, int] = {}
    for step in steps:
        for item in step.top_activations:
            key = keys[item.module]
            highs[key] = max(highs.get(key, 0), item.bytes)
    return highs


def module_changes(a: dict[ModuleKey, int], b: dict[ModuleKey, int]) -> tuple[ModuleChange, ...]:
    """The modules that moved by more than `MODULE_THRESHOLD`, largest change first, then
    those only one run lists (largest first)."""
    moved = [
        ModuleChange(key, Change(a[key], b[key]), ModuleShift.MOVED)
        for key in a
        if key in b and abs(b[key] - a[key]) > MODULE_THRESHOLD * max(a[key], b[key])
    ]
    moved.sort(key=lambda change: (-abs(change.bytes.delta or 0), change.module.shown))
    only = [
        ModuleChange(key, Change(a[key], None), ModuleShift.ONLY_A) for key in a if key not in b
    ] + [ModuleChange(key, Change(None, b[key]), ModuleShift.ONLY_B) for key in b if key not in a]
    only.sort(key=lambda change: (-(change.bytes.a or change.bytes.b or 0), change.module.shown))
    return (*moved, *only)


def dtype_highs(steps: list[schema.Step]) -> dict[Pile, dict[str, int]]:
    """Per pile the run states at some step: each dtype it held and its highest bytes. The
    inventory is the close's for the persistent piles, the high's for activations (as the
    screen's dtype table reads it); a step that does not know a pile adds nothing to it."""
    highs: dict[Pile, dict[str, int]] = {}
    for step in steps:
        for pile in Pile:
            piles = step.max if pile is Pile.ACTIVATIONS else step.end
            if pile_figure(step, piles, pile) is None:
                continue
            held = highs.setdefault(pile, {})
            for dtype, stat in step.dtypes.get(pile.value, {}).items():
                held[dtype] = max(held.get(dtype, 0), stat.bytes)
    return highs


def dtype_changes(
    a: dict[Pile, dict[str, int]], b: dict[Pile, dict[str, int]]
) -> tuple[DtypeChange, ...]:
    """Per pile both runs state: the dtypes only B held (appeared), then only A (vanished)."""
    changes: list[DtypeChange] = []
    for pile in Pile:
        if pile not in a or pile not in b:
            continue
        changes.extend(
            DtypeChange(pile, dtype, DtypeShift.APPEARED, size)
            for dtype, size in sorted(b[pile].items())
            if dtype not in a[pile]
        )
        changes.extend(
            DtypeChange(pile, dtype, DtypeShift.VANISHED, size)
            for dtype, size in sorted(a[pile].items())
            if dtype not in b[pile]
        )
    return tuple(changes)


def alert_key(item: StepAlert) -> AlertKey:
    """What an alert is matched on between runs: its kind and the module or tensor it names."""
    alert = item.alert
    names = alert.where
    if names is None and alert.origin is not None:
        names = alert.origin.module
    return AlertKey(item.kind, names)


def alerts_by_key(alerts: list[StepAlert]) -> dict[AlertKey, tuple[int, int | None]]:
    """Each alert key: how many alerts of it, and the step of the first (in stream order)."""
    tally: dict[AlertKey, tuple[int, int | None]] = {}
    for item in alerts:
        key = alert_key(item)
        count, first = tally.get(key, (0, item.step))
        tally[key] = (count + 1, first)
    return tally


def alerts_only(
    these: dict[AlertKey, tuple[int, int | None]], other: dict[AlertKey, tuple[int, int | None]]
) -> tuple[AlertChange, ...]:
    """The keys of `these` that `other` lacks, in the order `these` first raised them."""
    return tuple(
        AlertChange(key, count, first) for key, (count, first) in these.items() if key not in other
    )


def leak_index(recording: Recording) -> dict[tuple[str, LeakKindShown], int]:
    """Each leak the run's censuses named (its last count, as the report lists it): holder
    and kind, with its bytes, largest first."""
    return {(row.holder, row.kind): row.bytes for row in recording.leaks.latest()}


def leaks_only(
    these: dict[tuple[str, LeakKindShown], int], other: dict[tuple[str, LeakKindShown], int]
) -> tuple[LeakChange, ...]:
    """The leaks of `these` that `other` did not name."""
    return tuple(
        LeakChange(holder, kind, size)
        for (holder, kind), size in these.items()
        if (holder, kind) not in other
    )


def step_overlap(a: list[schema.Step], b: list[schema.Step]) -> StepOverlap:
    """The runs' step numbers, those in common, and where the peak moved most among them."""
    peaks_a = {step.step: step_peak(step) for step in a}  # a number seen twice: its last frame
    peaks_b = {step.step: step_peak(step) for step in b}
    common = tuple(sorted(peaks_a.keys() & peaks_b.keys()))
    largest: tuple[int, Change] | None = None
    for number in common:
        change = Change(peaks_a[number], peaks_b[number])
        delta = change.delta
        if delta is None:
            continue
        if largest is None or abs(delta) > abs(largest[1].delta or 0):
            largest = (number, change)
    return StepOverlap(tuple(sorted(peaks_a)), tuple(sorted(peaks_b)), common, largest)


__all__ = [
    "MODULE_THRESHOLD",
    "AlertChange",
    "AlertKey",
    "Change",
    "DtypeChange",
    "DtypeShift",
    "LeakChange",
    "ModuleChange",
    "ModuleKey",
    "ModuleShift",
    "PeakChange",
    "PileChange",
    "RunDiff",
    "Side",
    "StepOverlap",
    "diff_runs",
]
