"""Memory that grows step after step and that no pile explains: when to look, and what to say.

At each close the agent knows, exactly on a GPU (the caching allocator's `allocated`) and with a
few hundred bytes of noise on a CPU (glibc's in-use heap), how much memory the process holds
beyond the weights, gradients and optimizer state. A job that leaks grows it at nearly every
close; a healthy one does not, once warm. When it has grown at nearly every close of a window,
a census (`census.py`) files every tensor no pile counts under its holder; a second census a few
steps later shows which holders grew, by how much per step, and since when. Those are the leaks:
one `leak` alert each, and a `Leak` entry in the frames of the steps that took a census, each
with the fix that usually applies (`Leak.fix`, the same words that end the alert). A deque with
a `maxlen` is bounded and never a leak; a holder that stops growing stops being reported.

A holder can also grow in autograd nodes alone: `total_loss += loss` after backward chains every
step's graph onto the last, whose saved tensors backward freed; the tensor's bytes do not move.
It is a `graph_history` leak when its node count grew and its graph was extended, not replaced:
one of its roots at the census before is still reached from it, beneath a newer root. A value
derived from it and recomputed (`avg = total_loss / n`) replaces its own root each time, and
the census files the chain under the total (`census.py`): the growth shows on the holder that
grows. A single tensor bound to a name since the census before has not grown: it appeared.

Censuses cost time on the training thread (they walk the job's objects while nothing else
mutates them; a walk from another thread could race autograd freeing a graph), so they are
rare: only while growth lasts, and spaced further apart each time they find nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise

from memtui_agent.memory.census import Census, Holding
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, CensusCost, Leak, LeakKind
from memtui_protocol.units import format_bytes

MAX_FOLLOWED = 4096
"""Root nodes followed from one census to the next at most (the holders with the most nodes
first): a job with thousands of attached tensors in its names keeps this bounded."""
WINDOW = 8
"""Closes over which growth must be sustained before a census."""
GROWING = 7
"""Of the window's intervals, how many must grow."""
CONFIRM_AFTER = 4
"""Steps between the census that found holders and the one that measures their growth."""
FOLLOW_FIRST = 8
FOLLOW_MAX = 128
"""While leaks last, censuses follow them at growing intervals up to this many steps."""
EXACT_FLOOR = 1
HEAP_FLOOR = 4096
"""On a CPU, growth below this between two closes is noise: glibc's in-use bytes move by a few
hundred bytes between equal steps once warm, and by 1 to 3 KiB a step for the first few dozen
steps of a job with many modules (601 in benchmarks' `stack`); the smallest leak of
tests/fixtures/growing (a list of logits) grows it by 11 KiB a step. A CPU leak slower than
this is not told from the heap's noise."""


@dataclass
class LeakReport:
    """What a close adds to its frame."""

    alerts: list[schema.Alert] = field(default_factory=list)
    leaks: list[Leak] = field(default_factory=list)
    census: CensusCost | None = None


@dataclass
class _Named:
    """A holder already reported, and the census numbers it was last seen with."""

    first_step: int
    bytes: int
    step: int
    per_step: int
    kind: LeakKind
    fix: str
    """The fix its alert proposed: every later `Leak` of the holder carries the same words."""
    graphs_not_known: int = 0
    nodes: int = 0
    nodes_per_step: int = 0


@dataclass(frozen=True)
class Growth:
    """A holder that grew between two censuses: by how many bytes and nodes a step, and what
    kind of leak that makes it."""

    holding: Holding
    per_step: int
    nodes_per_step: int
    kind: LeakKind


class LeakWatch:
    """Decides, close after close, when to take a census and what it found growing."""

    def __init__(self, take: Callable[[], Census]) -> None:
        self._take = take
        self._floor = HEAP_FLOOR
        self._samples: deque[tuple[int, int]] = deque(maxlen=4 * WINDOW)
        self._previous: tuple[int, Census] | None = None
        """The last census and its step: the next one is compared with it."""
        self._next_census: int | None = None
        self._quiet_until = 0
        self._backoff = 2 * WINDOW
        self._follow = FOLLOW_FIRST
        self._named: dict[str, _Named] = {}

    def at_close(
        self,
        step: int,
        kept: int | None,
        headroom: int | None = None,
        exact: bool = False,
    ) -> LeakReport:
        """One close.

        Args:
            step: the closing step.
            kept: memory held beyond weights, gradients and optimizer state (held activations
                included); None where nothing can be read.
            headroom: what is left before the budget or the device's end (the out-of-memory
                forecast), None if unknown.
            exact: `kept` is the CUDA allocator's (exact), not glibc's heap (noisy).
        """
        report = LeakReport()
        if kept is None:
            return report
        self._floor = EXACT_FLOOR if exact else HEAP_FLOOR
        self._samples.append((step, kept))
        if self._next_census is not None:
            if step < self._next_census:
                return report  # a census is already planned: growth alone does not hurry it
        elif step < self._quiet_until or not self._growing():
            return report
        census = self._take()
        report.census = census_cost(census)
        previous, self._previous = self._previous, (step, census)
        if previous is None or previous[0] >= step:
            self._next_census = step + CONFIRM_AFTER
            return report
        leaks = self._growing_holders(previous, step, census)
        if not leaks:
            self._next_census = None
            self._quiet_until = step + self._backoff
            self._backoff = min(self._backoff * 2, 1024)
            self._follow = FOLLOW_FIRST
            return report
        for growth in leaks:
            holding = growth.holding
            named = self._named.get(holding.holder)
            first = (
                named.first_step if named else self._growth_start(step, holding, growth.per_step)
            )
            fix = named.fix if named else usual_fix(holding, growth.kind)
            leak = leak_of(growth, first, fix)
            report.leaks.append(leak)
            if named is None:
                report.alerts.append(leak_alert(leak, headroom))
            self._named[holding.holder] = _Named(
                first,
                holding.bytes,
                step,
                growth.per_step,
                growth.kind,
                fix,
                holding.unknown_graphs,
                holding.nodes,
                growth.nodes_per_step,
            )
        self._next_census = step + self._follow
        self._follow = min(self._follow * 2, FOLLOW_MAX)
        return report

    def final(self, step: int, take: Callable[[], Census]) -> list[Leak]:
        """The named leaks as the job ends (`take`: a census from what is left of it), with the
        rates of their last two censuses; a holder no longer reachable (a local of a function
        that returned) keeps its last census's figures. `step`: the last close."""
        if not self._named:
            return []
        census = take()
        found = []
        for holder, named in self._named.items():
            holding = census.holdings.get(holder)
            if holding is None:
                found.append(
                    Leak(
                        holder=holder,
                        kind=named.kind.value,
                        bytes=named.bytes,
                        tensors=0,
                        per_step=named.per_step,
                        first_step=named.first_step,
                        graphs_not_known=named.graphs_not_known,
                        fix=named.fix,
                        nodes=named.nodes,
                        nodes_per_step=named.nodes_per_step,
                    )
                )
                continue
            # Its rates stay those between its last two censuses, both taken at a close: the
            # job's end is no close (what the last step did after it is counted now), and a
            # rate from it would count that part of a step as none (4 evaluations in 3 steps).
            kind = holding.kind
            if named.kind is LeakKind.GRAPH_HISTORY and kind is LeakKind.TENSORS:
                kind = LeakKind.GRAPH_HISTORY
            growth = Growth(holding, named.per_step, named.nodes_per_step, kind)
            found.append(leak_of(growth, named.first_step, named.fix))
        return found

    def following(self) -> dict[int, str]:
        """The roots of the last census's holders (`Holding.roots`), for the next census to
        say which are still alive beneath their holder's graph (`Census.alive`)."""
        if self._previous is None:
            return {}
        followed: dict[int, str] = {}
        holdings = sorted(self._previous[1].holdings.values(), key=lambda h: -h.nodes)
        for holding in holdings:
            if len(followed) + len(holding.roots) > MAX_FOLLOWED:
                break
            followed.update((root, holding.holder) for root in holding.roots)
        return followed

    def _growing(self) -> bool:
        """Growth above the noise at nearly every close of the last window, and by the floor a
        step on average over it."""
        samples = list(self._samples)[-(WINDOW + 1) :]
        if len(samples) <= WINDOW:
            return False
        steps = [b[1] - a[1] for a, b in pairwise(samples)]
        grew = sum(1 for delta in steps if delta > self._floor)
        return grew >= GROWING and samples[-1][1] - samples[0][1] > WINDOW * self._floor

    def _growing_holders(
        self, previous: tuple[int, Census], step: int, census: Census
    ) -> list[Growth]:
        """Holders that grew since the previous census, in bytes or in graph history (bounded
        deques never count)."""
        then_step, then = previous
        found = []
        for holding in census.holdings.values():
            if holding.bounded is not None:
                continue
            before = then.holdings.get(holding.holder)
            if before is None and holding.container is None:
                continue  # a name bound since (`avg = total_loss / n`): nothing of it grew yet
            grown = holding.bytes - (before.bytes if before else 0)
            nodes = history_growth(before, holding, census.alive)
            if grown > 0 or nodes > 0:
                kind = holding.kind if grown > 0 else LeakKind.GRAPH_HISTORY
                steps = step - then_step
                found.append(Growth(holding, max(grown, 0) // steps, nodes // steps, kind))
        return sorted(found, key=lambda item: item.holding.bytes, reverse=True)

    def _growth_start(self, step: int, holding: Holding, per_step: int) -> int:
        """The step growth began at: the first close of the run of growing closes, or, when
        that run reaches back past the samples kept, where the holder's bytes began at its
        rate."""
        samples = list(self._samples)
        start = samples[-1][0]
        reaches_oldest = True
        for earlier, later in zip(reversed(samples[:-1]), reversed(samples[1:]), strict=False):
            if later[1] - earlier[1] <= self._floor:
                reaches_oldest = False
                break
            start = later[0]
        if reaches_oldest and per_step > 0:
            start = min(start, max(1, step - holding.bytes // per_step + 1))
        return start


def history_growth(before: Holding | None, now: Holding, alive: frozenset[int]) -> int:
    """Nodes the holder's graphs grew by since `before`, when they were extended rather than
    replaced: one of its roots then is still reached from it now, and is no longer a root (a
    newer node was chained on top of it). 0 otherwise (a name rebound to a new graph, however
    large, replaced its old one)."""
    if before is None or now.nodes <= before.nodes:
        return 0
    if any(root in alive and root not in now.roots for root in before.roots):
        return now.nodes - before.nodes
    return 0


def leak_of(growth: Growth, first_step: int, fix: str) -> Leak:
    """The `Leak` a growing holder makes."""
    holding = growth.holding
    return Leak(
        holder=holding.holder,
        kind=growth.kind.value,
        bytes=holding.bytes,
        tensors=holding.tensors,
        per_step=growth.per_step,
        first_step=first_step,
        graphs_not_known=holding.unknown_graphs,
        fix=fix,
        nodes=holding.nodes,
        nodes_per_step=growth.nodes_per_step,
    )


def leak_alert(leak: Leak, headroom: int | None) -> schema.Alert:
    """The alert for a newly named leak: who, how much, how fast, since when, and the fix (the
    leak's own `fix`, which the report reads from the `Leak`, never from this message)."""
    if leak.kind == LeakKind.GRAPH_HISTORY:
        return _history_alert(leak)
    message = (
        f"{leak.holder} keeps {format_bytes(leak.bytes)} alive in {leak.tensors} "
        f"tensor{'s' if leak.tensors != 1 else ''}"
    )
    if leak.graphs_not_known:
        message += (
            f" and {leak.graphs_not_known} autograd graph"
            f"{'s' if leak.graphs_not_known != 1 else ''} built while memtui's hooks were off "
            "(what they saved is not known, not in that figure)"
        )
    message += f" and grows {format_bytes(leak.per_step)} per step since step {leak.first_step}"
    if headroom is not None and leak.per_step > 0:
        message += f"; at this rate, out of memory in about {headroom // leak.per_step:,} steps"
    if leak.fix:
        message += f": {leak.fix}"
    return schema.Alert(kind=AlertKind.LEAK, message=message, where=leak.holder)


def _history_alert(leak: Leak) -> schema.Alert:
    """A growing graph history: what grows is nodes, whose host bytes are not known."""
    message = (
        f"{leak.holder} keeps {leak.nodes:,} autograd nodes alive (every step's graph chained "
        f"onto the last; backward freed their saved tensors; the host memory they take is not "
        f"known) and grows {leak.nodes_per_step:,} node"
        f"{'s' if leak.nodes_per_step != 1 else ''} per step since step {leak.first_step}"
    )
    if leak.fix:
        message += f": {leak.fix}"
    return schema.Alert(kind=AlertKind.LEAK, message=message, where=leak.holder)


def usual_fix(holding: Holding, kind: LeakKind | None = None) -> str:
    """The one-line fix that applies to most leaks of this shape (`kind`: the leak's, when it
    is not the holding's own, a graph history)."""
    kind = kind or holding.kind
    if kind is LeakKind.GRAPH_HISTORY:
        return "accumulate `loss.item()` (or `loss.detach()`), not the loss tensor itself"
    if kind is LeakKind.RETAINED_GRAPH:
        if holding.container is not None:
            return (
                "run evaluation under `torch.no_grad()`, or store `.detach()` (or `.item()`) "
                "of each output"
            )
        return "run evaluation under `torch.no_grad()`, or accumulate `loss.item()`"
    if holding.attached:
        return "store `.detach()` (or `.item()`) instead of tensors still attached to a graph"
    if holding.container == "dict":
        return "clear or bound the cache"
    if holding.container in ("list", "set", "deque"):
        return "clear it, or bound it (`collections.deque(maxlen=...)`)"
    return "drop the reference once it is no longer needed"


def census_cost(census: Census) -> CensusCost:
    """What one census cost, as the frame states it."""
    return CensusCost(
        seconds=round(census.seconds, 4),
        objects=census.visited,
        complete=census.complete,
        stopped=census.stopped.value if census.stopped is not None else None,
    )
