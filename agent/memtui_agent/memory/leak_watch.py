"""Memory that grows step after step and that no pile explains: when to look, and what to say.

At each close the agent knows, exactly on a GPU (the caching allocator's `allocated`) and with a
few hundred bytes of noise on a CPU (glibc's in-use heap, less what the agent's own frame log
holds), how much memory the process holds beyond the weights, gradients and optimizer state.
That series says when to look; three shapes of growth are looked for (`growth`):

- at nearly every close of the last 8 (a list that gains a tensor per step);
- by steps: jumps at some closes with the level flat between them and never falling back (an
  evaluation every k steps that keeps its graphs or appends to a list), as soon as two jumps
  are seen;
- a trend: over a long window (up to 256 closes) every quarter's lowest point stands above the
  one before by more than the noise, and the whole rise by more than any quarter's own spread
  (a slow leak under the noise of one interval, growth hidden under batches of varying size).

A census (`census.py`) then files every tensor no pile counts under its holder; it is compared
with the census before it (the leak watch's own or one the kept-tensors schedule took), and the
holders that grew *while keeping what they held* are the leaks: one `leak` alert each, and a
`Leak` entry in the frames of the steps that took a census, with the fix that usually applies
(`Leak.fix`) and the cadence seen (`Leak.every`). A name rebound to a new object (`out =
model(x)`, an evaluation's `vx, vy`, a one-off `logits`) keeps none of its old storages and is
never a leak, whatever its size; a holder the previous census did not see is not one yet (a
second census after the next growth decides). A deque with a `maxlen` is bounded and never a
leak; a holder that stops growing stops being reported.

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
from enum import Enum
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
this is not told from the heap's noise close by close: the trend finds it (`HEAP_TREND_RATE`)."""
HEAP_JUMP = 4 * HEAP_FLOOR
"""On a CPU, a close that grew by more than this is a step of a staircase (an evaluation that
keeps its graphs): a warming job's heap moves by a few KiB between some closes, and a growth
every k steps smaller than this is left to the trend."""
HEAP_TREND_RATE = 512
"""On a CPU, the slowest growth the trend names, in bytes per step over its long windows: a
healthy job's heap, the agent's own frame log taken out, drifts by less (a list of Python
floats, 32 B a step), and a leak of 1 KiB a step is twice this."""
TREND_WINDOWS_EXACT = (16, 32, 64, 128, 256)
"""Closes a trend is looked for over on a GPU (exact: any rise of every quarter counts)."""
TREND_WINDOWS_HEAP: tuple[tuple[int, int], ...] = ((32, HEAP_FLOOR), (64, HEAP_FLOOR))
TREND_WINDOWS_SLOW: tuple[tuple[int, int], ...] = ((128, HEAP_TREND_RATE), (256, HEAP_TREND_RATE))
"""On a CPU, (closes, bytes per step) a trend must reach: the short windows at the floor of one
interval (a fast leak hidden by batches of varying size), the long ones at the slow rate; a
warming job's 1 to 3 KiB a step lasts a few dozen closes, less than a long window's last three
quarters."""
HOLD = 3
"""Closes a level must hold, flat, after each of two growths before they prove growth by
steps (`by_steps`)."""
SPAN = 6
"""Closes that three growths or more at equal gaps must span to prove growth by steps."""
LONG_WINDOW = 128
LONG_EVERY = 8
"""Windows of `LONG_WINDOW` closes or more are looked at every `LONG_EVERY`-th step only (a
slow leak is named up to 7 steps later; the look costs tens of microseconds a close)."""
KEPT_SAMPLES = 256
"""Closes kept for the trend (the longest window)."""
WARM_STEP = 3
"""Jumps at closes before this are a job warming up (its first steps allocate once)."""
RETAINED = 0.5
"""A holder that grew is a leak only if at least this share of the bytes it held at the
census before is still among what it holds (by storage): a name rebound to a new, larger
object keeps none of it."""


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
    every: int | None = None
    nodes: int = 0
    nodes_per_step: int = 0


class Shape(Enum):
    """The shapes of growth that make a census due (the agent's own: never on the wire)."""

    CLOSES = "closes"
    """At nearly every close (`nearly_every_close`)."""
    STEPS = "steps"
    """By steps: growths at equal gaps, flat closes between (`by_steps`)."""
    TREND = "trend"
    """A trend over a long window (`rising`)."""


@dataclass(frozen=True)
class Growth:
    """What the closes' series shows, and why a census is due."""

    shape: Shape
    every: int | None
    """The cadence seen (`cadence`), None when not known."""


Sample = tuple[int, int]
"""A close: its step and the memory held beyond the persistent piles."""


@dataclass(frozen=True)
class HolderGrowth:
    """A holder that grew between two censuses: the bytes and the nodes it grew by, and what
    kind of leak that makes it."""

    holding: Holding
    grown: int
    """Bytes (0 for a graph history, whose bytes do not move)."""
    nodes: int
    """Autograd nodes its graphs grew by (`history_growth`)."""
    kind: LeakKind


class LeakWatch:
    """Decides, close after close, when to take a census and what it found growing."""

    def __init__(self, take: Callable[[], Census]) -> None:
        self._take = take
        self._floor = HEAP_FLOOR
        self._exact = False
        self._samples: deque[Sample] = deque(maxlen=KEPT_SAMPLES + 1)
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
        self._exact = exact
        self._floor = EXACT_FLOOR if exact else HEAP_FLOOR
        self._samples.append((step, kept))
        planned = self._next_census is not None
        if self._next_census is not None:
            if step < self._next_census:
                return report  # a census is already planned: growth alone does not hurry it
        elif step < self._quiet_until or self.growth() is None:
            return report
        census = self._take()
        report.census = census_cost(census)
        previous, self._previous = self._previous, (step, census)
        leaks: list[HolderGrowth] = []
        candidates = True
        if previous is not None and previous[0] < step:
            leaks, candidates = self._growing_holders(previous, step, census)
        if not leaks:
            if candidates and not planned:
                # Something appeared or grew without proof yet: look again after the next
                # growth (one cadence on, at least `CONFIRM_AFTER` steps).
                self._next_census = self._after_next_growth(step)
                return report
            self._next_census = None
            self._quiet_until = step + self._backoff
            self._backoff = min(self._backoff * 2, 1024)
            self._follow = FOLLOW_FIRST
            return report
        every = cadence(list(self._samples), self._floor, self._jump_floor())
        then = previous[0] if previous else step
        for growth in leaks:
            holding = growth.holding
            named = self._named.get(holding.holder)
            per_step = self._per_step(growth.grown, then, step, every)
            nodes_per_step = self._per_step(growth.nodes, then, step, every)
            first = named.first_step if named else self._growth_start(step, holding, per_step)
            fix = named.fix if named else usual_fix(holding, growth.kind)
            seen_every = every if every is not None else named.every if named else None
            leak = leak_of(holding, growth.kind, per_step, nodes_per_step, first, fix, seen_every)
            report.leaks.append(leak)
            if named is None:
                report.alerts.append(leak_alert(leak, headroom))
            self._named[holding.holder] = _Named(
                first,
                holding.bytes,
                step,
                per_step,
                growth.kind,
                fix,
                holding.unknown_graphs,
                seen_every,
                holding.nodes,
                nodes_per_step,
            )
        self._next_census = step + max(self._follow, every or 1)
        self._follow = min(self._follow * 2, FOLLOW_MAX)
        return report

    def seen(self, step: int, census: Census) -> None:
        """A census another schedule took at this close (the kept tensors'): the next census
        of the leak watch is compared with it, unless one is already planned against an
        earlier one (its interval must hold the growth it waits for)."""
        if self._next_census is not None:
            return
        if self._previous is None or self._previous[0] < step:
            self._previous = (step, census)

    def final(self, step: int, take: Callable[[], Census]) -> list[Leak]:
        """The named leaks as the job ends (`take`: a census from what is left of it), with the
        growth per step their last census measured; a holder no longer reachable keeps its
        last census's figures (a local of a function that returned). `step`: the last close."""
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
                        every=named.every,
                        nodes=named.nodes,
                        nodes_per_step=named.nodes_per_step,
                    )
                )
                continue
            # The growth per step stays the one measured between two closes: the job's code
            # after its last close (an append that follows `optimizer.step()`) is part of no
            # step, and counting its growth over whole steps overstated it (8,495 B a step for
            # 8,192 on `rebound_names.py`).
            kind = holding.kind
            if named.kind is LeakKind.GRAPH_HISTORY and kind is LeakKind.TENSORS:
                kind = LeakKind.GRAPH_HISTORY  # its bytes never moved: its nodes did
            found.append(
                leak_of(
                    holding,
                    kind,
                    named.per_step,
                    named.nodes_per_step,
                    named.first_step,
                    named.fix,
                    named.every,
                )
            )
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

    def growth(self) -> Growth | None:
        """Whether the closes kept show memory growing, and how (None: they do not)."""
        samples = list(self._samples)
        if nearly_every_close(samples, self._floor):
            return Growth(Shape.CLOSES, cadence(samples, self._floor, self._jump_floor()))
        # A staircase proves itself only at a growth or `HOLD` closes after one: the walk back
        # through the samples is for those closes alone.
        recent = [b[1] - a[1] for a, b in pairwise(samples[-(HOLD + 2) :])]
        if recent and (recent[-1] > self._jump_floor() or recent[0] > self._jump_floor()):
            jumps = regular(staircase(samples, self._floor, self._jump_floor()))
            if by_steps(jumps, samples[-1][0]):
                return Growth(Shape.STEPS, cadence(samples, self._floor, self._jump_floor()))
        windows = (
            tuple((size, EXACT_FLOOR) for size in TREND_WINDOWS_EXACT)
            if self._exact
            else TREND_WINDOWS_HEAP + TREND_WINDOWS_SLOW
        )
        for size, rate in windows:
            if size >= LONG_WINDOW and samples[-1][0] % LONG_EVERY:
                continue  # a long window's trend moves little in a close: looked at every 8th
            window = samples[-size:]
            if not self._exact and rate < HEAP_FLOOR:
                window = healed(window)
            if rising(window, size, rate, self._floor):
                return Growth(Shape.TREND, None)
        return None

    def _after_next_growth(self, step: int) -> int:
        """The close a second census sees one more growth at: the next step of a staircase
        (its last growth plus its cadence), else `CONFIRM_AFTER` steps on."""
        samples = list(self._samples)
        every = cadence(samples, self._floor, self._jump_floor())
        jumps = regular(staircase(samples, self._floor, self._jump_floor()))
        if every is None or every == 1 or not jumps:
            return step + CONFIRM_AFTER
        after = jumps[-1][0] + every
        while after <= step:
            after += every
        return after

    def _jump_floor(self) -> int:
        return self._floor if self._exact else HEAP_JUMP

    def _growing_holders(
        self, previous: tuple[int, Census], step: int, census: Census
    ) -> tuple[list[HolderGrowth], bool]:
        """Holders that grew since the previous census while keeping what they held, in bytes
        or in graph history (bounded deques never count); and whether any other holder
        appeared or grew (rebound), so that one more census may tell."""
        _then_step, then = previous
        found = []
        candidates = False
        for holding in census.holdings.values():
            if holding.bounded is not None:
                continue
            before = then.holdings.get(holding.holder)
            if before is None or not before.bytes:
                candidates = True  # new since then: a leak only once it grows again
                continue
            grown = holding.bytes - before.bytes
            if grown <= 0:
                nodes = history_growth(before, holding, census.alive)
                if nodes > 0:  # its bytes never move: its chained graph does
                    found.append(HolderGrowth(holding, 0, nodes, LeakKind.GRAPH_HISTORY))
                continue
            if kept_since(before, holding) < RETAINED * before.bytes:
                candidates = True  # rebound to a new object: never a leak by itself
                continue
            nodes = max(0, holding.nodes - before.nodes)
            found.append(HolderGrowth(holding, grown, nodes, holding.kind))
        return sorted(found, key=lambda item: item.holding.bytes, reverse=True), candidates

    def _per_step(self, grown: int, then: int, step: int, every: int | None) -> int:
        """Bytes a step: over a cadence of k steps, what one growth added divided by k (the
        interval between two censuses may hold fewer steps than one cadence)."""
        if every is not None and every > 1:
            # Every close of the interval that grew by a jump, not only the newest regular run
            # (a close between two growths whose heap fell cut that run short: one growth in
            # three counted, 811,040 B a step stated for 148 KiB on an evaluation every 2 steps).
            jump = self._jump_floor()
            growths = sum(
                1
                for earlier, later in pairwise(self._samples)
                if then < later[0] <= step and later[1] - earlier[1] > jump
            )
            if growths:
                return grown // (growths * every)
        return grown // max(1, step - then)

    def _growth_start(self, step: int, holding: Holding, per_step: int) -> int:
        """The step growth began at: the first close of the regular run of growing closes (a
        staircase's first step, two growths at least), or, when that run reaches back past the
        samples kept or no run stands above the noise (a slow trend), where the holder's bytes
        began at its rate."""
        samples = list(self._samples)
        by_rate = max(1, step - holding.bytes // per_step + 1) if per_step > 0 else step
        jumps = regular(staircase(samples, self._floor, self._jump_floor()))
        if len(jumps) < 2:
            return max(by_rate, samples[0][0])
        start = jumps[0][0]
        if start <= samples[1][0]:  # the run reaches the oldest sample
            start = min(start, by_rate)
        # The staircase leaves out the closes before `WARM_STEP` (first-time allocations): a run
        # it cut there goes back as far as those closes grew at the same cadence.
        gap = jumps[1][0] - jumps[0][0]
        growth = dict((later[0], later[1] - earlier[1]) for earlier, later in pairwise(samples))
        while start == jumps[0][0] and start - gap >= 2 and start - gap < WARM_STEP:
            if growth.get(start - gap, 0) <= self._jump_floor():
                break
            start -= gap
        return start


def nearly_every_close(samples: list[Sample], floor: int) -> bool:
    """Growth above the noise at nearly every close of the last window, and by the floor a
    step on average over it."""
    window = samples[-(WINDOW + 1) :]
    if len(window) <= WINDOW:
        return False
    grew = sum(1 for a, b in pairwise(window) if b[1] - a[1] > floor)
    return grew >= GROWING and window[-1][1] - window[0][1] > WINDOW * floor


def staircase(samples: list[Sample], floor: int, jump: int) -> list[tuple[int, int]]:
    """The closes that grew by more than `jump` (step, bytes) in the newest run of closes
    that never fell by more than `floor` (a staircase: growths with flat closes between),
    from the newest back to the first close that fell; closes before `WARM_STEP` left out."""
    found: list[tuple[int, int]] = []
    for earlier, later in zip(reversed(samples[:-1]), reversed(samples[1:]), strict=False):
        if later[0] < WARM_STEP:
            break
        delta = later[1] - earlier[1]
        if delta < -floor:
            break
        if delta > jump:
            found.append((later[0], delta))
    found.reverse()
    return found


def by_steps(jumps: list[tuple[int, int]], now: int) -> bool:
    """Whether a staircase's growths at equal gaps (`regular`, flat closes between: growing
    closes in a row are `nearly_every_close`'s) prove growth by steps at the close of `now`:
    three or more over `SPAN` closes at least, the newest at this close; or two at a gap of
    more than `HOLD` closes, the level
    held flat for `HOLD` closes since the second. Sizes that vary between a few values
    (sequence lengths in buckets) climb two steps by chance now and then, seldom three, or
    two that each hold."""
    if len(jumps) < 2 or jumps[-1][0] - jumps[-2][0] < 2:
        return False
    if len(jumps) >= 3:
        return jumps[-1][0] == now and now - jumps[0][0] >= SPAN
    return jumps[1][0] - jumps[0][0] > HOLD and now - jumps[1][0] == HOLD


def regular(jumps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The newest run of `jumps` at equal gaps (the newest jump alone when there is no gap)."""
    if len(jumps) < 2:
        return jumps[-1:]
    gap = jumps[-1][0] - jumps[-2][0]
    start = len(jumps) - 2
    while start > 0 and jumps[start][0] - jumps[start - 1][0] == gap:
        start -= 1
    return jumps[start:]


def cadence(samples: list[Sample], floor: int, jump: int) -> int | None:
    """Every how many closes memory grew: 1 when each close of the last window grew above the
    noise; else from the newest run of growths above `jump` at equal gaps (two at least), flat
    closes between, whose last one is no further back than one gap; None when not known."""
    window = samples[-(WINDOW + 1) :]
    if len(window) > WINDOW and all(b[1] - a[1] > floor for a, b in pairwise(window)):
        return 1
    jumps = regular(staircase(samples, floor, jump))
    if len(jumps) < 2:
        return None
    gap = jumps[-1][0] - jumps[-2][0]
    return gap if samples[-1][0] - jumps[-1][0] <= gap else None


def rising(window: list[Sample], size: int, rate: int, floor: int) -> bool:
    """A trend over `size` closes: each quarter's lowest point above the previous quarter's by
    more than `rate` a step (and the noise `floor`), and the whole rise larger than any
    quarter's own spread (noise, or sizes that vary, spread a quarter as wide as the rise)."""
    if len(window) < size:
        return False
    quarter = size // 4
    parts = [[value for _step, value in window[i * quarter : (i + 1) * quarter]] for i in range(4)]
    lows = [min(part) for part in parts]
    margin = max(floor, rate * quarter)
    if any(later - earlier <= margin for earlier, later in pairwise(lows)):
        return False
    spread = max(max(part) - min(part) for part in parts)
    return lows[-1] - lows[0] > spread


def healed(window: list[Sample]) -> list[Sample]:
    """A CPU heap's window with its sudden falls taken out, when no close in it rose as much:
    memory handed back at once (a garbage collection, a cache cleared) does not undo a slow
    leak, and a falling close counts as a flat one. A window whose closes also rise that much
    (sizes that vary) is left as it is."""
    deltas = [later[1] - earlier[1] for earlier, later in pairwise(window)]
    if not deltas or max(deltas) > HEAP_JUMP or min(deltas) >= -HEAP_JUMP:
        return window
    level = window[0][1]
    found = [window[0]]
    for (step, _value), delta in zip(window[1:], deltas, strict=True):
        level += delta if delta >= -HEAP_JUMP else 0
        found.append((step, level))
    return found


def kept_since(before: Holding, now: Holding) -> int:
    """Bytes of what a holder held at an earlier census that it still holds (by storage)."""
    held = now.storages.keys() | now.graph_storages.keys()
    return sum(
        size
        for storages in (before.storages, before.graph_storages)
        for key, size in storages.items()
        if key in held
    )


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


def leak_of(
    holding: Holding,
    kind: LeakKind,
    per_step: int,
    nodes_per_step: int,
    first_step: int,
    fix: str,
    every: int | None,
) -> Leak:
    """The `Leak` a growing holder makes."""
    return Leak(
        holder=holding.holder,
        kind=kind.value,
        bytes=holding.bytes,
        tensors=holding.tensors,
        per_step=per_step,
        first_step=first_step,
        graphs_not_known=holding.unknown_graphs,
        fix=fix,
        every=every,
        nodes=holding.nodes,
        nodes_per_step=nodes_per_step,
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
    if leak.every is not None and leak.every > 1:
        each = format_bytes(leak.per_step * leak.every)
        message += f", by steps: {each} every {leak.every} steps"
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
    if leak.every is not None and leak.every > 1:
        message += f", every {leak.every} steps"
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
