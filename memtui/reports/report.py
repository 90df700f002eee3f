"""`memtui report`: the recording as the JSON contract (docs/report-format.md) or a short text.

Pure functions over a `Recording`; no torch, no Textual, so it runs anywhere the recording is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

import msgspec

from memtui.model.alert_summary import alert_tally
from memtui.model.alloc_rows import events_dict, events_text
from memtui.model.job_state import unrecorded_words
from memtui.model.out_of_memory import explain, shortfall_lines
from memtui.model.recording import Recording, StepAlert, alert_rows
from memtui.model.run_diff import pile_high
from memtui.model.step_ranges import steps_words
from memtui.model.step_rows import (
    NOT_KNOWN,
    activations_known,
    distributed_notes,
    folded_alerts,
    known_piles,
    pile_of,
    severity_order,
    step_peak,
)
from memtui.reports.leak_report import (
    census_line,
    censuses,
    kept_line,
    leak_entries,
    leak_lines,
    step_census,
    step_kept,
    step_leaks,
)
from memtui.reports.report_format import (
    AgentErrorEntry,
    AlertEntry,
    AllocatorEntry,
    ExitEntry,
    HostEntry,
    JobEntry,
    ModuleEntry,
    OutOfMemoryEntry,
    PeakEntry,
    PeakPhases,
    PileBytes,
    Report,
    RunAlert,
    StepEntry,
    WorkersEntry,
)
from memtui_protocol.peak import PEAK_WORDS
from memtui_protocol.schema import (
    AlertKind,
    ExitStatus,
    Pile,
    Piles,
    Severity,
    Step,
    StepTrigger,
    alert_severity,
)
from memtui_protocol.units import format_bytes

ALLOCATOR_KEYS = (
    "allocated",
    "reserved",
    "peak_allocated",
    "process_gpu",
    "device_used",
    "device_total",
)


def _piles(piles: Piles) -> PileBytes:
    return PileBytes(**piles.as_dict())


def step_report(step: Step, recording: Recording, alerts: list[StepAlert]) -> StepEntry:
    """One entry of `steps` in the report contract (plus a few extra keys).

    A pile the step does not know is null: this version's frames hold null for it already;
    an older agent's frame of a step whose activations are not known held what it saw of them
    (`known_piles`), and its partial activation dtypes and top modules are left out too.
    """
    known = activations_known(step)
    peak = known_piles(step, step.peak)
    dtypes = step.dtypes if known else {**step.dtypes, Pile.ACTIVATIONS.value: {}}
    return StepEntry(
        step=step.step,
        optimizer=step.optimizer,
        optimizer_step=step.optimizer_step,
        closed_by=str(step.closed_by.value),
        skipped=step.skipped,
        microbatches=step.microbatches,
        end=_piles(known_piles(step, step.end)),
        max=_piles(known_piles(step, step.max)),
        peak=PeakEntry(total=peak.total, piles=_piles(peak), held=step_peak(step)),
        dtypes={
            pile: {dtype: stat.bytes for dtype, stat in dtypes.get(pile, {}).items()}
            for pile in Pile
        },
        dtype_tensors={
            pile: {dtype: stat.count for dtype, stat in dtypes.get(pile, {}).items()}
            for pile in Pile
        },
        allocator=AllocatorEntry(**{key: getattr(step.allocator, key) for key in ALLOCATOR_KEYS}),
        host=HostEntry(rss=step.host.rss),
        loss=step.loss,
        scale=step.scale,
        grad_norm=step.grad_norm,
        duration_s=round(step.t_end - step.t_start, 6),
        activations_measured=step.activations_measured,
        activations_from=step.activations_from,
        activations_why_at=step.activations_why_at,
        top_activations=[
            ModuleEntry(module=recording.module_name(item.module), bytes=item.bytes)
            for item in (step.top_activations if known else [])
        ],
        distributed=msgspec.to_builtins(step.distributed) if step.distributed else None,
        alerts=[step_alert_entry(item) for item in alerts],
        alloc_events=events_dict(step.alloc_events)
        if step.alloc_events is not None
        else msgspec.UNSET,
        leaks=step_leaks(step),
        census=step_census(step),
        kept=step_kept(step),
        workers=step_workers(step),
    )


def step_workers(step: Step) -> WorkersEntry | msgspec.UnsetType:
    """A step's own `workers`: its DataLoader workers as last sampled (absent without any)."""
    workers = step.workers
    if workers is None:
        return msgspec.UNSET
    return WorkersEntry(
        count=workers.count, uss=workers.uss, pss=workers.pss, growth=workers.growth
    )


def workers_line(steps: Sequence[Step], binary: bool = True) -> str | None:
    """The DataLoader workers at the last step that sampled them: processes of their own,
    beside this process's RSS, never in its piles (None for a job without workers)."""
    last = next((step for step in reversed(steps) if step.workers is not None), None)
    if last is None or last.workers is None:
        return None
    workers = last.workers
    size = partial(format_bytes, binary=binary)
    pss = f", PSS {size(workers.pss)}" if workers.pss is not None else ""
    plural = "es" if workers.count != 1 else ""
    return (
        f"DataLoader workers at step {last.step}: {workers.count} process{plural}, private "
        f"memory (USS) {size(workers.uss)}{pss}, grown {size(workers.growth)} since they "
        "started (not in the piles nor in the RSS above)"
    )


def exit_report(recording: Recording) -> ExitEntry:
    """How the job ended (`how_it_ended`); a job with no final frame was killed (or is still
    running)."""
    end = recording.end
    status = recording.how_it_ended()
    if end is not None:
        return ExitEntry(
            status=status,
            code=end.code,
            error=end.describe_error(),
            step=end.step,
            phase=end.phase,
            oom=end.oom,
            requested=end.requested,
            piles=_piles(end.piles) if end.piles is not None else None,
            # `--alloc-events`: the step the job ended in, which never closed.
            alloc_events=events_dict(end.alloc_events)
            if end.alloc_events is not None
            else msgspec.UNSET,
        )
    last_step = recording.steps[-1].step if recording.steps else 0
    tick = recording.last_tick
    phase = tick.phase if tick is not None and tick.time >= _last_step_time(recording) else None
    return ExitEntry(
        status=status,
        code=None,
        error=None if status == ExitStatus.RUNNING else missing_end_reason(recording),
        step=last_step + 1,
        phase=phase,
    )


def missing_end_reason(recording: Recording) -> str:
    """Why a finished recording has no final frame, as far as the file can tell."""
    if recording.recording_stopped is not None:  # the agent said so (a full disk)
        return unrecorded_words(recording.recording_stopped)
    if recording.warning:
        return f"the recording ends early ({recording.warning}); no final frame"
    return "no final frame: the process was killed"


def _last_step_time(recording: Recording) -> float:
    return recording.steps[-1].t_end if recording.steps else 0.0


def step_alert_entry(item: StepAlert) -> AlertEntry:
    """One alert as its step's entry lists it: the contract's keys, plus `group` when it
    follows another (the one place that maps an alert's fields to the report's)."""
    alert = item.alert
    return AlertEntry(
        kind=item.kind,
        severity=alert_severity(item.kind),
        message=alert.message,
        where=alert.where,
        group=alert.group,
        origin=alert.origin,
        began=alert.began,
    )


def alert_entry(item: StepAlert) -> RunAlert:
    """One alert in the run-wide list: its step's entry, with the step."""
    return RunAlert(step=item.step, **msgspec.structs.asdict(step_alert_entry(item)))


def all_alerts(recording: Recording) -> list[RunAlert]:
    """Every alert with its step, ordered by step; early warnings (a forecast over budget) come
    before their step's own alerts, the job's fatal alerts (OOM) last."""
    alerts = [alert_entry(item) for item in recording.alerts if not item.final]
    alerts.sort(key=lambda entry: entry.step or 0)
    alerts.extend(alert_entry(item) for item in recording.alerts if item.final)
    return alerts


def step_alerts(recording: Recording) -> dict[int, list[StepAlert]]:
    """Each closed step's alerts: raised early, with the step, or when its late values came."""
    by_step: dict[int, list[StepAlert]] = {}
    for item in recording.alerts:
        if item.step is not None and not item.final:
            by_step.setdefault(item.step, []).append(item)
    return by_step


def report_of(recording: Recording, with_steps: bool = True) -> Report:
    """The `memtui report --json` document (docs/report-format.md, extra keys allowed).

    `with_steps=False`: `steps` left empty, for readers that need everything else (the text
    report; `report_json.write_report_json`, which writes the steps one by one)."""
    hello = recording.hello
    alerts = step_alerts(recording) if with_steps else {}
    return Report(
        job=JobEntry(
            argv=hello.argv,
            pid=hello.pid,
            torch=hello.torch,
            device=hello.device,
            started=hello.started,
            recording=str(recording.path),
        ),
        steps=[step_report(step, recording, alerts.get(step.step, [])) for step in recording.steps]
        if with_steps
        else [],
        optimizers=optimizer_steps(recording.steps),
        step_rule=step_rule(recording.steps),
        alerts=all_alerts(recording),
        leaks=leak_entries(recording),
        censuses=censuses(recording),
        exit=exit_report(recording),
        peaks=peak_phases(recording),
        agent_errors=[
            AgentErrorEntry(component=error.component, message=error.message)
            for error in recording.agent_errors
        ],
        warnings=[recording.warning] if recording.warning else [],
        out_of_memory=shortfall_entry(recording),
    )


def shortfall_entry(recording: Recording) -> OutOfMemoryEntry | None:
    """The report's `out_of_memory` entry (`memtui.model.out_of_memory.explain`)."""
    shortfall = explain(recording)
    if shortfall is None:
        return None
    return OutOfMemoryEntry(
        cause=shortfall.cause.value,
        step=shortfall.step,
        phase=shortfall.phase,
        requested=shortfall.requested,
        requested_where=shortfall.requested_where,
        budget=shortfall.budget,
        peak=shortfall.peak,
        piles=_piles(shortfall.piles) if shortfall.piles is not None else None,
        piles_at=shortfall.piles_at,
        piles_step=shortfall.piles_step,
        top_modules=[ModuleEntry(module=name, bytes=size) for name, size in shortfall.modules],
        modules_step=shortfall.modules_step,
        reserved_unallocated=shortfall.reserved_unallocated,
        expandable_segments=shortfall.expandable_segments,
        batch_fraction=shortfall.batch_fraction,
        batch_fraction_why=shortfall.batch_why,
        batch_step=shortfall.batch_step,
    )


def build_report(recording: Recording) -> dict[str, Any]:
    """The report as plain Python data (what `--json` prints, before serialising)."""
    document: dict[str, Any] = msgspec.to_builtins(report_of(recording))
    return document


def optimizer_steps(steps: list[Step]) -> dict[str, int]:
    """Steps closed by each optimizer, in order of first step (`{"AdamW#1": 10}`)."""
    counts: dict[str, int] = {}
    for step in steps:
        if step.optimizer is not None:
            counts[step.optimizer] = counts.get(step.optimizer, 0) + 1
    return counts


def step_rule(steps: list[Step]) -> str | None:
    """What a step means in this recording, in words (None before any step)."""
    if not steps:
        return None
    by_backward = sum(step.closed_by is StepTrigger.BACKWARD for step in steps)
    if by_backward == len(steps):
        return "no optimizer stepped: each step is one top-level backward()"
    names = optimizer_steps(steps)
    rule = "each step is one optimizer.step()" + (
        f" of one of {len(names)} optimizers" if len(names) > 1 else ""
    )
    if by_backward:
        rule += f"; the first {by_backward} were top-level backward() calls, before any did"
    return rule


def peak_phases(recording: Recording) -> PeakPhases:
    """The first update's peak kept apart from the steady state's (warm-up hides one-time
    allocations such as the optimizer's moments, docs/health.md). Steps whose activations are
    not known have no total to compare: a phase of only those has no peak (None)."""
    steps = recording.steps
    if not steps:
        return PeakPhases(first_step=None, steady=None)
    if attached_late(recording):  # `memtui attach` into a running job: its first update is past
        return PeakPhases(first_step=None, steady=highest_peak(steps))
    return PeakPhases(first_step=step_peak(steps[0]), steady=highest_peak(steps[1:]))


def highest_peak(steps: list[Step]) -> int | None:
    """The highest peak among the steps that know theirs (`step_peak`)."""
    totals = [total for step in steps if (total := step_peak(step)) is not None]
    return max(totals, default=None)


def attached_late(recording: Recording) -> bool:
    """Whether the agent was injected into a job that had already stepped (`memtui attach`):
    its first step then carries no forecast, the first update being in the past."""
    if not recording.steps:
        return False
    kinds = {alert.kind for alert in step_alerts(recording).get(recording.steps[0].step, [])}
    return AlertKind.ATTACHED in kinds and AlertKind.FIRST_STEP_FORECAST not in kinds


def pile_peaks(recording: Recording) -> dict[Pile, int | None]:
    """Each pile's highest value over the whole run, over the steps that know it: the
    activations of a step that does not know them are left out, and are None when no step
    knows them (`--activations off`)."""
    return {pile: pile_high(recording.steps, pile) if recording.steps else 0 for pile in Pile}


def activation_line(steps: list[Step]) -> str | None:
    """How many steps' activations were measured, carried from a measured step, or not known
    (`--activations auto` measures the steps that can differ); None when every step was."""
    carried = sum(1 for s in steps if not s.activations_measured and s.activations_from is not None)
    unknown = sum(1 for s in steps if not activations_known(s))
    if not carried and not unknown:
        return None
    line = f"activations: measured on {len(steps) - carried - unknown} steps"
    if carried:
        line += f", carried on {carried} (each repeats a measured step's figures)"
    if unknown:
        line += f", {NOT_KNOWN} on {unknown} ({not_known_steps(steps)}); no activation figures "
        line += "are shown for them"
    return line


def not_known_steps(steps: list[Step]) -> str:
    """Which steps' activations are not known (`steps 2, 5-7, 12 and 3 more`), grouped by the
    step whose `activations_vary` alert says why (`Step.activations_why_at`), so each can be
    traced to its reason."""
    by_reason: dict[int | None, list[int]] = {}
    for step in steps:
        if not activations_known(step):
            by_reason.setdefault(step.activations_why_at, []).append(step.step)
    parts = []
    for why_at, numbers in by_reason.items():
        reason = (
            f"why: the alert of step {why_at}"
            if why_at is not None
            else "why not recorded: --activations off, or an older recording"
        )
        parts.append(f"{steps_words(numbers)}, {reason}")
    return "; ".join(parts)


MAX_ALERT_LINES = 20
"""Alert lines the text report lists (after folding); `--json` lists every alert."""


def alert_lines(recording: Recording) -> list[str]:
    """The alerts other than an OOM (which leads the report), folded as the screen folds them:
    alerts that follow from an earlier one (every step after the weights went non-finite) are
    one line under it. The errors first, then the warnings, then the notes, each by step, each
    line led by its severity. At most `MAX_ALERT_LINES` lines (the notes are the first left
    out), then how many alerts were left out."""
    stepped = [item for item in recording.alerts if not item.final and item.kind != AlertKind.OOM]
    final = [item for item in recording.alerts if item.final and item.kind != AlertKind.OOM]
    total = len(stepped) + len(final)
    if not total:
        return []
    members = Counter(item.alert.group for item in stepped if item.alert.group is not None)
    # The fold lists newest first, as the screen does; the report reads oldest first.
    rows = sorted(reversed(folded_alerts(alert_rows(stepped))), key=lambda row: row.step)
    rows += alert_rows(final)
    rows.sort(key=severity_order)  # errors, warnings, notes; each by step, causes first
    counts = Counter(alert_severity(item.kind) for item in [*stepped, *final])  # every alert
    severities = ", ".join(
        f"{counts[severity]} {severity}{'s' if counts[severity] != 1 else ''}"
        for severity in Severity
        if counts[severity]
    )
    lines = [f"alerts: {total} ({severities})"]
    shown = 0
    for row in rows[:MAX_ALERT_LINES]:
        where = f" [{row.where}]" if row.where else ""
        lines.append(f"  {row.severity:<7} step {row.step}: {row.kind}{where}: {row.message}")
        grouped = row.group if row.kind == AlertKind.GROUPED else None
        shown += members[grouped] if grouped is not None else 1
    if shown < total:
        lines.append(
            f"  and {total - shown} more (memtui report --json lists every alert; "
            "memtui replay shows them by step)"
        )
    return lines


def steps_counted(steps: list[Step]) -> str:
    """How many steps were recorded and, when they are not the job's steps 1 to N (an agent
    attached to a running job), which of the job's steps they are: every reader numbers steps
    as the frames do, by the job's own count."""
    if not steps or (steps[0].step == 1 and steps[-1].step == len(steps)):
        return str(len(steps))
    return f"{len(steps)} recorded, the job's steps {steps[0].step}-{steps[-1].step}"


def render_text(recording: Recording, binary: bool = True) -> str:
    """The readable summary: how it ended first, then the piles, the first step, alerts."""
    report = report_of(recording, with_steps=False)  # the steps are read where they are
    size = partial(format_bytes, binary=binary)
    lines = []
    ending = report.exit
    headline = f"job {ending.status}"
    if ending.code is not None:
        headline += f" (exit code {ending.code})"
    if ending.status not in (ExitStatus.OK, ExitStatus.RUNNING):
        where = f" in {ending.phase}" if ending.phase else ""
        headline += f" at step {ending.step}{where}"
        if ending.error:
            headline += f": {ending.error}"
    worst = alert_tally(recording).error_words()
    if ending.status == ExitStatus.OK and worst is not None:  # exit 0 is not all that happened
        headline = f"job exited (exit code {ending.code}) with an error: {worst}"
    fatal = [alert for alert in report.alerts if alert.kind == AlertKind.OOM]
    for alert in fatal:
        lines.append(f"OUT OF MEMORY at step {alert.step}: {alert.message}")
    lines.append(headline)
    shortfall = explain(recording)
    if shortfall is not None:
        lines.extend(shortfall_lines(shortfall, binary))
    leaks = leak_lines(recording, binary)
    lines.extend(leaks)
    hello = recording.hello
    lines.append(
        f"command: {' '.join(hello.argv)}  (pid {hello.pid}, torch {hello.torch}, "
        f"{hello.device}, started {hello.started})"
    )
    steps = recording.steps
    lines.append(
        f"steps: {steps_counted(steps)}"
        + (f", {sum(s.skipped for s in steps)} skipped" if any(s.skipped for s in steps) else "")
    )
    measured = activation_line(steps)
    if measured is not None:
        lines.append(measured)
    census = census_line(recording) if not leaks else None  # with leaks: in their section
    if census is not None:
        lines.append(census)
    kept = kept_line(recording, binary)
    if kept is not None:
        lines.append(kept)
    names = report.optimizers
    if len(names) > 1:
        lines.append("  " + ", ".join(f"{name}: {count}" for name, count in names.items()))
    rule = report.step_rule
    if rule is not None and (len(names) != 1 or "backward" in rule):
        lines.append(f"  ({rule})")
    if steps:
        peaks = pile_peaks(recording)
        totals = [(total, step) for step in steps if (total := step_peak(step)) is not None]
        known = [step for _, step in totals]
        top_total, top = max(totals, key=lambda item: item[0]) if totals else (None, None)
        if top is None:
            lines.append(f"peak ({PEAK_WORDS}): {NOT_KNOWN} (no step's activations are known)")
        else:
            lines.append(
                f"peak ({PEAK_WORDS}): {size(top_total)} at step {top.step}"
                + (" (of the steps whose activations are known)" if len(known) < len(steps) else "")
            )
        phases = peak_phases(recording)
        steady = phases.steady
        if attached_late(recording):
            lines.append(
                f"peak after the attach: {size(steady, missing=NOT_KNOWN)} "
                "(the first update was earlier)"
            )
        else:
            lines.append(
                f"first update peak: {size(phases.first_step, missing=NOT_KNOWN)}; "
                "steady-state peak (steps 2+): "
                + (
                    size(steady)
                    if steady is not None
                    else "n/a (one step)"
                    if len(steps) < 2
                    else NOT_KNOWN
                )
            )
        lines.append("pile              highest in run   at peak")
        for pile in Pile:
            at_peak = size(pile_of(top.peak, pile), missing=NOT_KNOWN) if top else NOT_KNOWN
            highest = size(peaks[pile], missing=NOT_KNOWN)
            lines.append(f"  {pile:<16}{highest:>14}{at_peak:>12}")
        last = steps[-1]
        lines.extend(distributed_notes(last, binary))
        lines.append(f"host RSS at last step: {size(last.host.rss)}")
        workers = workers_line(steps, binary)
        if workers is not None:
            lines.append(workers)
        losses = [step.loss for step in steps if step.loss is not None]
        if losses:
            lines.append(f"loss: {losses[0]:.4g} at first step, {losses[-1]:.4g} at last")
    lines.extend(alert_lines(recording))
    lines.extend(events_text(steps, recording.end, binary))
    for error in report.agent_errors:
        lines.append(f"agent: {error.component} turned off: {error.message}")
    return "\n".join(lines)
