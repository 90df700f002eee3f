"""The leaks a job's censuses named, folded from the frame stream: per holder, step by step.

The agent sends a `Leak` per growing holder in the frame of each step whose close took a census
(`Step.leaks`), the census's cost with it (`Step.census`), and counts the named leaks once more
as the job ends (`End.leaks`: the most accurate final figures). `recording.apply` folds all of
it into one `LeakBook`, which both the report (`leaks`, the text report's "Leaks" section) and
the screen ("Where the bytes are", as of the cursor step) read, so they cannot disagree.

Bounded against a hostile recording: at most `MAX_HOLDERS` holders are kept (more are counted,
not stored) and each holder's history is thinned past `MAX_HISTORY` entries, so the fold stays
linear in the stream and the book bounded whatever a live stream sends.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field

from memtui_protocol import schema
from memtui_protocol.schema import LeakKind

MAX_HOLDERS = schema.MAX_ITEMS
"""The most holders the book keeps (a real job names a handful)."""
MAX_HISTORY = 1024
"""The most census entries kept per holder; the older half goes when it is reached (a real job
takes a census at most every 128 steps once a leak is followed)."""

LeakKindShown = LeakKind | str
"""The `LeakKind`, or the string of a kind a newer agent sent (shown as written)."""


def leak_kind(text: str) -> LeakKindShown:
    """The member for a kind read from the wire; the string itself for one this version does
    not know."""
    try:
        return LeakKind(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class LeakRow:
    """One holder's leak as a census counted it: what it keeps alive and how fast it grows."""

    holder: str
    kind: LeakKindShown
    bytes: int
    tensors: int
    per_step: int
    """Bytes it grew by per step between its last two censuses."""
    first_step: int
    """The step its growth began at."""
    counted_at: int | None
    """The step whose census gave these figures; None: counted as the job ended (`End`)."""
    graphs_not_known: int = 0
    """Graphs it keeps whose saved tensors are not known: `bytes` is then a lower bound."""
    fix: str | None = None
    """The fix the agent proposed (`Leak.fix`); None from agents before it was a field."""
    every: int | None = None
    """Its cadence (`Leak.every`): it grew at every `every`-th close; None: not known."""
    nodes: int = 0
    """Autograd nodes its graphs keep alive (0 from agents before it was a field)."""
    nodes_per_step: int = 0
    """Nodes they grew by per step: what a graph history grows by."""

    @classmethod
    def of(cls, leak: schema.Leak, counted_at: int | None) -> LeakRow:
        """The wire's `Leak` as the viewer holds it, its kind converted once."""
        return cls(
            leak.holder,
            leak_kind(leak.kind),
            leak.bytes,
            leak.tensors,
            leak.per_step,
            leak.first_step,
            counted_at,
            leak.graphs_not_known,
            leak.fix,
            leak.every,
            leak.nodes,
            leak.nodes_per_step,
        )


@dataclass
class _Trail:
    """One holder's censuses, in stream order: the steps and the rows they gave."""

    steps: list[int] = field(default_factory=list)
    rows: list[LeakRow] = field(default_factory=list)

    def add(self, row: LeakRow, step: int) -> None:
        if len(self.rows) >= MAX_HISTORY:
            del self.steps[: MAX_HISTORY // 2], self.rows[: MAX_HISTORY // 2]
        self.steps.append(step)
        self.rows.append(row)

    def at(self, step: int) -> LeakRow | None:
        """The latest row counted at or before `step` (steps only grow in a stream)."""
        index = bisect_right(self.steps, step)
        return self.rows[index - 1] if index else None


@dataclass(frozen=True)
class CensusTally:
    """What the job's censuses of live tensors cost, in all."""

    count: int = 0
    seconds: float = 0.0
    longest: float = 0.0
    objects: int = 0
    """The most objects one census visited."""
    incomplete: int = 0
    """Censuses that ended early (a bound, an error) or saw a container change under them: the
    holders they named are real, more may exist."""
    errors: int = 0
    """Of those, censuses an error inside them ended (`CensusStop.ERROR`)."""
    bounded: int = 0
    """Of those, censuses a bound stopped (objects or seconds)."""

    def plus(self, cost: schema.CensusCost) -> CensusTally:
        return CensusTally(
            self.count + 1,
            round(self.seconds + cost.seconds, 6),
            max(self.longest, cost.seconds),
            max(self.objects, cost.objects),
            self.incomplete + (not cost.complete),
            self.errors + (cost.stopped == schema.CensusStop.ERROR),
            self.bounded + (cost.stopped in (schema.CensusStop.OBJECTS, schema.CensusStop.SECONDS)),
        )


@dataclass
class LeakBook:
    """Every holder a census named, with each census's figures, and the job's final count."""

    trails: dict[str, _Trail] = field(default_factory=dict)
    final: dict[str, LeakRow] = field(default_factory=dict)
    """`End.leaks`, by holder."""
    censuses: CensusTally = CensusTally()
    holders_dropped: int = 0
    """Leak entries of holders beyond `MAX_HOLDERS`, not kept."""

    def stepped(self, step: schema.Step) -> None:
        """A step's census: its cost and the leaks it named (a step without one adds nothing)."""
        if step.census is not None:
            self.censuses = self.censuses.plus(step.census)
        for leak in step.leaks:
            trail = self._trail(leak.holder)
            if trail is not None:
                trail.add(LeakRow.of(leak, step.step), step.step)

    def ended(self, end: schema.End) -> None:
        """The job's last count of the named leaks."""
        for leak in end.leaks:
            if self._trail(leak.holder) is not None:
                self.final[leak.holder] = LeakRow.of(leak, None)

    def _trail(self, holder: str) -> _Trail | None:
        trail = self.trails.get(holder)
        if trail is None:
            if len(self.trails) >= MAX_HOLDERS:
                self.holders_dropped += 1
                return None
            trail = self.trails[holder] = _Trail()
        return trail

    def as_of(self, step: int | None, final: bool) -> tuple[LeakRow, ...]:
        """Each holder's latest figures at or before `step` (every census when None); with
        `final`, the job's own last count where it has one (the End's). Largest first, and
        of equal size the oldest (the growth that began first)."""
        rows = []
        for holder, trail in self.trails.items():
            row = self.final.get(holder) if final else None
            if row is None:
                row = trail.at(step) if step is not None else trail.rows[-1] if trail.rows else None
            if row is not None:
                rows.append(row)
        return tuple(sorted(rows, key=lambda row: (-row.bytes, row.first_step, row.holder)))

    def latest(self) -> tuple[LeakRow, ...]:
        """One row per holder: the End's where it has one, else the latest census's."""
        return self.as_of(None, final=True)


def leak_holding(row: LeakRow) -> str:
    """What a holder keeps alive, in a few words: `54 tensors`, `1 tensor + graph` (a tensor
    whose autograd graph still holds its saved tensors)."""
    plural = "s" if row.tensors != 1 else ""
    tensors = f"{row.tensors} tensor{plural}"
    if row.kind is LeakKind.RETAINED_GRAPH:
        unknown = f", {row.graphs_not_known} not known" if row.graphs_not_known else ""
        return f"{tensors} + graph{plural}{unknown}"
    if row.kind is LeakKind.TENSORS:
        return tensors
    if row.kind is LeakKind.WORKERS:
        return "workers' USS"
    if row.kind is LeakKind.GRAPH_HISTORY:
        return f"{row.nodes:,} graph nodes"
    return f"{tensors} ({row.kind})"


def leak_cadence(every: int | None) -> str | None:
    """How often a holder grew, in words (None when not known): `at every step`, `every 5
    steps`."""
    if every is None:
        return None
    return "at every step" if every == 1 else f"every {every} steps"


def leak_growth(row: LeakRow, size: Callable[[int], str]) -> str:
    """What it grows by per step: bytes (`size` formats them), or nodes for a graph history
    (whose host bytes are not known)."""
    if row.kind is LeakKind.GRAPH_HISTORY:
        return f"+{row.nodes_per_step:,} nodes"
    return "+" + size(row.per_step)
