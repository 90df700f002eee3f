"""Rows the screen shows for one step, computed by pure functions (no Textual, no torch).

The Session picks the step; these turn it into what each panel lists: the piles bar, the gap
rows with the meaning of each difference, the dtype table, the allocator's activity, and the
alerts with follow-on ones folded under the first.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from memtui.model.alert_kinds import AlertKindShown
from memtui_protocol import schema
from memtui_protocol.peak import other_at_peak, peak_total
from memtui_protocol.schema import AlertKind, Pile, Severity, TextEnum, alert_severity
from memtui_protocol.units import format_bytes

GAP_MEANINGS = {
    "allocated": "other: temporaries, workspaces, inputs, caches, leaks",
    "reserved": "allocator cache and fragmentation",
    "process_gpu": "CUDA context, cuBLAS/cuDNN workspaces, NCCL, other libraries",
    "device_used": "other processes on the device",
    "device_total": "free on the device",
    "rss": "Python, libraries, data, CPU tensors outside the piles",
    "system_used": "other processes on the machine",
    "system_total": "free on the machine",
}

NO_GPU = "no GPU: a CPU job"
"""The meaning of each GPU level on a job without a GPU (shown where the figure would be)."""

NO_NVML = "NVML gave no figure"
"""The meaning of a GPU level only NVML reads (the process's and the device's memory) when it
gave none: the row says "not known" and why; the allocator's lines carry NVML's own note."""

FREE_LEVELS = frozenset({"device_total", "system_total"})
"""The levels whose difference to the one below is free memory, not memory some use holds."""


class Untracked(TextEnum):
    """Memory the piles bar shows beside the four piles: what no pile tracks."""

    DDP_BUCKETS = "ddp_buckets"
    """DDP's gradient buckets, the part the gradients pile does not already count."""
    FSDP_GATHERED = "fsdp_gathered"
    """FSDP's unsharded parameters, at their high in the step."""
    OTHER = "other"
    """The allocator's peak minus everything above (GPU only)."""


BarPart = Pile | Untracked
"""One segment of the piles bar (and one row under it)."""


NOT_KNOWN = "not known"
"""What the screen and the reports say in place of a figure the step does not know."""


@dataclass(frozen=True)
class PileRow:
    """One part of the bar: bytes at the step's peak, share of the bar, highest in the step."""

    name: BarPart
    at_peak: int | None
    share: float
    step_max: int | None
    known: bool = True
    """False: the step cannot state this part at its peak (its activations are not known, so
    neither is the peak's moment, nor the allocator's rest): `at_peak` is None and no share is
    drawn; `step_max` is the part's high where that is known (the weights'), else None."""


@dataclass(frozen=True)
class GapRow:
    """One level of the gap view and what the difference to the level below means."""

    label: str
    value: int | None
    delta: int | None
    meaning: str
    applicable: bool = True
    known: bool = True
    """False: the level exists but this step cannot state it (the tracked piles of a step whose
    activations are not known)."""
    free: bool = False
    """The difference is memory nobody uses (the device's or the machine's total minus what is
    used): shown as an amount free, not as growth."""


@dataclass(frozen=True)
class AlertRow:
    """An alert with the step it belongs to (and the earlier alert's step it follows from)."""

    step: int
    kind: AlertKindShown
    message: str
    where: str | None
    group: int | None = None
    key: str = ""
    """The alert's identity (its place in the stream, or its group's first step): unique and
    stable while the alert is on screen, so the table keeps its cursor on it as alerts come."""

    @property
    def severity(self) -> Severity:
        """Its kind's one severity (a kind this version does not know: a warning)."""
        return alert_severity(self.kind)

    def listed(self, notes_shown: bool) -> bool:
        """Whether the alerts table lists it: every error and warning, a note only while the
        notes are shown (`o`); `n`/`N` and the timeline's marks follow the same rule."""
        return notes_shown or self.severity is not Severity.NOTE


@dataclass(frozen=True)
class DtypeRow:
    """Bytes and unique storages of one dtype within one pile, at the cursor step; a pile the
    step does not know is one row with neither (and no dtype)."""

    pile: Pile
    dtype: str
    bytes: int | None
    storages: int | None

    @property
    def key(self) -> str:
        """Unique within a step: a pile lists each dtype once."""
        return f"{self.pile.value}/{self.dtype}"


@dataclass(frozen=True)
class ModuleRow:
    """Saved-activation bytes of one module, by its id: two modules may share a label (two
    root models of one class name each tree from its root), never an id."""

    module: int
    label: str
    bytes: int
    key: str
    """`module-<id>`: the row's identity in the table, whatever the label says."""


def activations_known(step: schema.Step) -> bool:
    """Whether the step states its activations: measured, or carried from a measured step it
    provably repeats. Otherwise (`activations_measured` false, `activations_from` null) they
    are not known: a frame of this version holds null for them; one of an older agent holds
    what was seen, part of them, never the step's figure, so no reader shows it as one (the
    bar, the chart, the tables, the reports, the CSV)."""
    return step.activations_measured or step.activations_from is not None


def pile_figure(step: schema.Step, piles: schema.Piles, pile: Pile) -> int | None:
    """One pile of one of the step's compositions (`end`, `max`, `peak`); None where the step
    does not know it: null in the frame, or the activations of an older agent's step whose
    activations are not known."""
    if pile is Pile.ACTIVATIONS and not activations_known(step):
        return None
    return pile_of(piles, pile)


def known_piles(step: schema.Step, piles: schema.Piles) -> schema.Piles:
    """One of the step's compositions as this version's frames state it: an older agent's
    figure for activations that are not known becomes None (docs/report-format.md)."""
    if activations_known(step) or piles.activations is None:
        return piles
    return schema.Piles(piles.weights, piles.gradients, piles.optimizer_state, None)


def known_total(step: schema.Step, piles: schema.Piles) -> int | None:
    """The piles' total in one of the step's compositions; None when any pile of it is not
    known (a total without one is not the step's total)."""
    return known_piles(step, piles).total


def step_peak(step: schema.Step) -> int | None:
    """The step's peak as every view states it (`memtui_protocol.peak`): the piles at the
    peak as this version knows them, plus DDP's buckets and FSDP's gathered parameters."""
    return peak_total(known_piles(step, step.peak), step.distributed)


def module_rows(step: schema.Step | None, names: dict[int, str]) -> tuple[ModuleRow, ...]:
    """The cursor step's top activations, each keyed by its module id (none for a step whose
    activations are not known: its list is partial).

    The agent lists a module once per step; should a damaged or hostile recording list one
    twice, the repeat gets a key of its own (`module-7-2`) rather than taking the table down.
    """
    if step is None or not activations_known(step):
        return ()
    seen: Counter[int] = Counter()
    rows = []
    for item in step.top_activations:
        seen[item.module] += 1
        repeat = seen[item.module]
        key = f"module-{item.module}" + (f"-{repeat}" if repeat > 1 else "")
        rows.append(ModuleRow(item.module, module_label(names, item.module), item.bytes, key))
    return tuple(rows)


def module_label(names: dict[int, str], module_id: int) -> str:
    """Qualified module name for an id; activations packed outside any module get a label."""
    if module_id < 0:
        return "<outside any module>"
    return names.get(module_id, f"<module {module_id}>")


def folded_alerts(alerts: list[AlertRow]) -> tuple[AlertRow, ...]:
    """Newest first, with each group of follow-on alerts folded into one summary row.

    Once the weights are non-finite every step raises the same alerts again; listing them all
    would bury the first one, which is the one to act on.
    """
    groups: dict[int, list[AlertRow]] = {}
    rows: list[tuple[int, AlertRow]] = []
    for index, alert in enumerate(alerts):
        if alert.group is None:
            rows.append((index, alert))
        else:
            if alert.group not in groups:
                rows.append((index, alert))  # placeholder, replaced below
            groups.setdefault(alert.group, []).append(alert)
    folded = []
    for _, alert in rows:
        group = alert.group
        members = groups.get(group) if group is not None else None
        if group is None or members is None:
            folded.append(alert)
            continue
        steps = sorted({member.step for member in members})
        folded.append(
            AlertRow(
                step=group,
                kind=AlertKind.GROUPED,
                message=f"{len(members)} more alerts on steps {steps[0]}-{steps[-1]}: they follow "
                f"from step {group} (the weights were poisoned by its update)",
                where=None,
                group=group,
                key=f"group-{group}",
            )
        )
    return tuple(reversed(folded))


def severity_order(row: AlertRow) -> tuple[int, bool]:
    """Errors, then warnings, then notes; within a severity a folded row (the steps that
    follow from an alert) after the alerts themselves, so the first error row is a cause."""
    return row.severity.rank, row.kind is AlertKind.GROUPED


def by_severity(rows: tuple[AlertRow, ...]) -> tuple[AlertRow, ...]:
    """Folded rows (newest first) with the errors first, then the warnings, then the notes,
    each newest first: the first row is the newest alert of the highest severity."""
    return tuple(sorted(rows, key=severity_order))


def pile_rows(step: schema.Step | None, live: schema.Piles | None = None) -> tuple[PileRow, ...]:
    """The bar: the peak composition of the step (or the live piles before the first step)."""
    piles = known_piles(step, step.peak) if step is not None else live
    if piles is None:
        return ()
    wrapped = step.distributed if step is not None else None
    peak_total = piles.total
    gpu = step is not None and step.allocator.peak_allocated is not None
    other = (
        other_at_peak(piles, wrapped, step.allocator.peak_allocated) if step is not None else None
    )
    values: dict[BarPart, int | None] = dict(pile_values(piles))
    highs = known_piles(step, step.max) if step is not None else None
    step_max: dict[BarPart, int | None] = {
        pile: pile_of(highs, pile) if highs is not None else None for pile in Pile
    }
    # The wrappers' memory: its high is the value itself (the buckets are constant, the
    # gathered parameters are already the step's highest).
    for part, value in wrapper_parts(wrapped):
        values[part] = step_max[part] = value
    values[Untracked.OTHER] = other
    # A pile the step does not know at its peak, and on a GPU the allocator's rest beside an
    # unknown peak total.
    unknown: set[BarPart] = {pile for pile in Pile if values[pile] is None}
    if gpu and peak_total is None:
        unknown.add(Untracked.OTHER)
    total = sum(value for value in values.values() if value)
    return tuple(
        PileRow(
            name,
            value,
            (value / total) if value and total else 0.0,
            step_max.get(name),
            known=name not in unknown,
        )
        for name, value in values.items()
    )


def wrapper_parts(wrapped: schema.Distributed | None) -> list[tuple[Untracked, int]]:
    """What data-parallel wrappers hold outside the piles, where they report it: DDP's buckets
    (only the part no pile counts: with gradient_as_bucket_view the gradients are in them) and
    FSDP's gathered parameters."""
    if wrapped is None:
        return []
    parts = []
    if wrapped.ddp_buckets is not None:
        parts.append((Untracked.DDP_BUCKETS, wrapped.untracked_buckets()))
    if wrapped.fsdp_gathered_max is not None:
        parts.append((Untracked.FSDP_GATHERED, wrapped.fsdp_gathered_max))
    return parts


def pile_of(piles: schema.Piles, pile: Pile) -> int | None:
    """One pile's bytes, read by `Pile`, never by a position in the wire's array (None: not
    known)."""
    value: int | None = getattr(piles, pile.value)
    return value


def pile_values(piles: schema.Piles) -> tuple[tuple[Pile, int | None], ...]:
    """Each pile with its bytes (None: not known), in display (and stacking) order."""
    return tuple((pile, pile_of(piles, pile)) for pile in Pile)


def distributed_notes(step: schema.Step | None, binary: bool = True) -> tuple[str, ...]:
    """What DDP's buckets and FSDP's gathered parameters are, in words the user can act on."""
    wrapped = step.distributed if step is not None else None
    if wrapped is None:
        return ()
    notes = []
    if wrapped.ddp_buckets is not None:
        size = format_bytes(wrapped.ddp_buckets, binary)
        if wrapped.ddp_bucket_view:
            notes.append(
                f"DDP gradient buckets {size}: the gradients are views into them "
                "(gradient_as_bucket_view=True), so they are not counted twice"
            )
        else:
            notes.append(
                f"DDP gradient buckets {size}: a second copy of the gradients; "
                "DistributedDataParallel(gradient_as_bucket_view=True) would share them"
            )
    if wrapped.fsdp_gathered_max is not None:
        high = format_bytes(wrapped.fsdp_gathered_max, binary)
        now = format_bytes(wrapped.fsdp_gathered or 0, binary)
        notes.append(
            f"FSDP gathered parameters: up to {high} unsharded during forward/backward "
            f"({now} at step end); weights, gradients and optimizer state are this rank's shards"
        )
    return tuple(notes)


def gap_rows(step: schema.Step | None, live: schema.Piles | None = None) -> tuple[GapRow, ...]:
    """Tracked -> allocated -> reserved -> process -> device used -> device total (GPU), or
    tracked -> process RSS -> system used -> system total (CPU), each difference named."""
    if step is not None:
        tracked = known_total(step, step.end)
    elif live is not None:
        tracked = live.total
    else:
        return ()
    if step is None or tracked is not None:
        rows = [GapRow("tracked at step end", tracked, None, "the four piles when the step closed")]
    else:
        meaning = f"this step's activations are {NOT_KNOWN}"
        rows = [GapRow("tracked at step end", None, None, meaning, known=False)]
    allocator = step.allocator if step is not None else schema.Allocator()
    gpu = allocator.allocated is not None
    levels: list[tuple[str, str, int | None]] = [
        ("torch allocated", "allocated", allocator.allocated),
        ("torch reserved", "reserved", allocator.reserved),
        ("process GPU (NVML)", "process_gpu", allocator.process_gpu),
        ("device used", "device_used", allocator.device_used),
        ("device total", "device_total", allocator.device_total),
    ]
    if gpu:
        previous = tracked
        for label, key, value in levels:
            if value is None:  # not read (no NVML): "not known" and why, never a blank "n/a"
                why = f"{NO_NVML}: {allocator.nvml_note}" if allocator.nvml_note else NO_NVML
                rows.append(GapRow(label, None, None, why, known=False))
                continue
            delta = value - previous if previous is not None else None
            rows.append(
                GapRow(label, value, delta, GAP_MEANINGS[key], True, free=key in FREE_LEVELS)
            )
            previous = value
    else:
        host = step.host if step is not None else schema.Host()
        previous = tracked
        for label, key, value in (
            ("process RSS", "rss", host.rss or None),
            ("system used", "system_used", host.system_used),
            ("system total", "system_total", host.system_total),
        ):
            delta = value - previous if value is not None and previous is not None else None
            rows.append(
                GapRow(label, value, delta, GAP_MEANINGS[key], True, free=key in FREE_LEVELS)
            )
            previous = value if value is not None else previous
    workers = step.workers if step is not None else None
    if workers is not None:
        rows.append(workers_row(workers))
    if not gpu:
        rows.extend(GapRow(label, None, None, NO_GPU, False) for label, _, _ in levels)
    return tuple(rows)


def workers_row(workers: schema.Workers) -> GapRow:
    """The DataLoader workers beside the levels: their summed private memory (USS), its growth
    since they started as the gap. Processes of their own: in no pile, not in the RSS above."""
    plural = "es" if workers.count != 1 else ""
    return GapRow(
        "DataLoader workers",
        workers.uss,
        workers.growth,
        f"USS of {workers.count} worker process{plural} beside this one; + grown since start",
    )


def allocator_lines(step: schema.Step | None, binary: bool = True) -> tuple[str, ...]:
    """The caching allocator's activity in the step (GPU only): events, fragmentation, peaks."""
    if step is None or step.allocator.allocated is None:
        return ()
    a = step.allocator
    lines = []
    if a.allocations is not None:
        lines.append(
            f"this step: {a.allocations} allocations ({format_bytes(a.alloc_bytes, binary)}), "
            f"{a.frees} frees, {a.segment_allocs} cudaMalloc, {a.segment_frees} cudaFree, "
            f"{a.alloc_retries} retries, {a.ooms} OOMs"
        )
    if a.inactive_split is not None:
        lines.append(
            f"inactive split blocks (fragmentation): {format_bytes(a.inactive_split, binary)}"
        )
    if a.peak_allocated is not None:
        kind = "this step's own" if a.peak_exact else "running peak (the step set no new high)"
        lines.append(f"peak allocated {format_bytes(a.peak_allocated, binary)}: {kind}")
    if a.phase_peaks:
        phases = ", ".join(f"{k} {format_bytes(v, binary)}" for k, v in a.phase_peaks.items())
        lines.append(f"peaks by phase: {phases}")
    if a.nvml_note:
        lines.append(a.nvml_note)
    return tuple(lines)


def dtype_rows(step: schema.Step | None) -> tuple[DtypeRow, ...]:
    """Each pile's dtypes at the cursor step, largest first within each pile."""
    if step is None:
        return ()
    rows = []
    for pile in Pile:
        # The inventory is the close's for the persistent piles, the high's for activations.
        piles = step.max if pile is Pile.ACTIVATIONS else step.end
        if pile_figure(step, piles, pile) is None:
            rows.append(DtypeRow(pile, "", None, None))
            continue
        stats = step.dtypes.get(pile.value, {})
        for dtype, stat in sorted(stats.items(), key=lambda item: -item[1].bytes):
            rows.append(DtypeRow(pile, dtype, stat.bytes, stat.count))
    return tuple(rows)


def describe_rate(rate: float | None) -> str:
    """`12.3 steps/s`, or a dash before two steps exist."""
    return "-" if rate is None else f"{rate:.1f} steps/s"


def format_age(seconds: float) -> str:
    """`42s`, `5m03s`, `2h10m`: how long a job has been running."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
