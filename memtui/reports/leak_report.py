"""The leaks in the report: the JSON's `leaks` (and a step's own), the text report's section.

Everything comes from the fold's `LeakBook` (`recording.leaks`): one row per holder, the job's
last count (`End.leaks`) where it has one, else the latest census's, with the fix the agent
proposed (`Leak.fix`).
"""

from __future__ import annotations

from functools import partial

import msgspec

from memtui.model.kept_trail import kept_words
from memtui.model.leaks import CensusTally, LeakRow, leak_cadence
from memtui.model.recording import Recording
from memtui.reports.report_format import CensusEntry, KeptEntry, KeptHolderEntry, LeakEntry
from memtui_protocol.schema import LeakKind, Step
from memtui_protocol.units import format_bytes

NOTABLE_SHARE = 0.01
"""Censuses are worth a line in the text report when they took at least this share of the
steps' time in all (or when one stopped at its bound)."""
KIND_WORDS: dict[LeakKind, str] = {
    LeakKind.RETAINED_GRAPH: "autograd graphs kept alive",
    LeakKind.TENSORS: "tensors kept",
    LeakKind.WORKERS: "copied into the DataLoader workers",
    LeakKind.GRAPH_HISTORY: "autograd history growing",
}


def leak_entry(row: LeakRow) -> LeakEntry:
    """One holder as the report's `leaks` lists it."""
    return LeakEntry(
        holder=row.holder,
        kind=str(row.kind),
        bytes=row.bytes,
        tensors=row.tensors,
        per_step=row.per_step,
        first_step=row.first_step,
        graphs_not_known=row.graphs_not_known,
        fix=row.fix,
        every=row.every,
        nodes=row.nodes,
        nodes_per_step=row.nodes_per_step,
    )


def leak_entries(recording: Recording) -> list[LeakEntry]:
    """The report's top-level `leaks`: one per holder, largest first."""
    return [leak_entry(row) for row in recording.leaks.latest()]


def step_leaks(step: Step) -> list[LeakEntry] | msgspec.UnsetType:
    """A step's own `leaks`: what its census named (absent on the steps that took none or
    named nothing)."""
    if not step.leaks:
        return msgspec.UNSET
    return [leak_entry(LeakRow.of(leak, step.step)) for leak in step.leaks]


def step_census(step: Step) -> CensusEntry | msgspec.UnsetType:
    """A step's own `census`: what its close's census cost (absent where none ran)."""
    cost = step.census
    if cost is None:
        return msgspec.UNSET
    return CensusEntry(
        seconds=cost.seconds, objects=cost.objects, complete=cost.complete, stopped=cost.stopped
    )


def step_kept(step: Step) -> KeptEntry | msgspec.UnsetType:
    """A step's own `kept`: the tensors the job kept outside every pile as its census found
    them (absent where no census ran)."""
    kept = step.kept
    if kept is None:
        return msgspec.UNSET
    holders = [KeptHolderEntry(item.holder, item.bytes, item.tensors) for item in kept.holders]
    return KeptEntry(bytes=kept.bytes, tensors=kept.tensors, holders=holders)


KEPT_NAMED = 5
"""Holders the text report's kept line names (the JSON has up to 16 per step)."""


def kept_line(recording: Recording, binary: bool = True) -> str | None:
    """The tensors the job kept outside every pile at the last step whose census counted them
    (None when no step did): their total, and the largest holders by name."""
    found = recording.kept.last()
    return kept_words(found, binary, KEPT_NAMED) if found is not None else None


def censuses(recording: Recording) -> CensusTally | None:
    """The report's `censuses`: every census of the run, in all (None when none ran)."""
    tally = recording.leaks.censuses
    return tally if tally.count else None


def leak_lines(recording: Recording, binary: bool = True) -> list[str]:
    """The text report's "Leaks" section (empty without leaks): each holder with what it keeps,
    its growth per step and since when, the fix, then the censuses' cost if notable (without
    leaks the report says that cost on a line of its own, `census_line`)."""
    rows = recording.leaks.latest()
    if not rows:
        return []
    size = partial(format_bytes, binary=binary)
    counted = "as the job ended" if recording.leaks.final else "at the last census"
    lines = [f"Leaks ({counted}): memory no pile holds, growing step after step"]
    for row in rows:
        kind = KIND_WORDS[row.kind] if isinstance(row.kind, LeakKind) else row.kind
        plural = "s" if row.tensors != 1 else ""
        unknown = ""
        if row.graphs_not_known:
            graphs = "graph" + ("s" if row.graphs_not_known != 1 else "")
            unknown = (
                f" and {row.graphs_not_known} {graphs} whose saved tensors are not known "
                "(built while memtui's hooks were off)"
            )
        cadence = leak_cadence(row.every)
        if row.kind is LeakKind.GRAPH_HISTORY:
            growing = (
                f"{row.nodes:,} autograd nodes alive (host bytes not known), "
                f"growing {row.nodes_per_step:,} per step"
            )
        elif row.kind is LeakKind.WORKERS:
            growing = (
                f"{size(row.bytes)} of the workers' private memory (USS), outside this process, "
                f"growing {size(row.per_step)} per step"
            )
        else:
            growing = (
                f"{size(row.bytes)} in {row.tensors} tensor{plural}{unknown}, "
                f"growing {size(row.per_step)} per step"
            )
        lines.append(
            f"  {row.holder} ({kind}): {growing} since step {row.first_step}"
            + (f", {cadence}" if cadence else "")
        )
        if row.fix:
            lines.append(f"    fix: {row.fix}")
    cost = census_line(recording)
    if cost is not None:
        lines.append(f"  {cost}")
    return lines


def census_line(recording: Recording) -> str | None:
    """What the censuses cost, when it is worth saying: a noticeable share of the steps' time,
    or a census stopped at its bound."""
    tally = recording.leaks.censuses
    if not tally.count:
        return None
    stepping = sum(step.t_end - step.t_start for step in recording.steps)
    share = tally.seconds / stepping if stepping > 0 else None
    if not tally.incomplete and (share is None or share < NOTABLE_SHARE):
        return None
    line = (
        f"censuses of live tensors: {tally.count}, {tally.seconds:.3f} s in all"
        + (f" ({share:.1%} of the steps' time)" if share is not None else "")
        + f", the longest {tally.longest:.3f} s; up to {tally.objects:,} objects visited"
    )
    if tally.incomplete:
        changed = tally.incomplete - tally.bounded - tally.errors
        parts = [
            f"{count} {what}"
            for count, what in (
                (tally.bounded, "stopped at their bound"),
                (tally.errors, "at an error inside them"),
                (changed, "saw a container change under them"),
            )
            if count
        ]
        line += f"; {', '.join(parts)} (the holders named are real, more may exist)"
    return line
