"""Tensors the job keeps that no pile holds: when a close counts them, and the figure it states.

An EMA kept as a list of tensors (`ema = [p.detach().clone() for p in model.parameters()]`),
a buffer dict kept on the side, the batch and outputs the loop still refers to: no hook sees
them (they are neither weights, gradients, optimizer state nor saved by autograd), and on a
CPU they were only in the RSS. A census (`census.py`) finds them by holder, from the names the
job wrote, without running its code; this module says when a close takes one for them and
turns it into the frame's `Kept`.

A census costs milliseconds on most jobs and up to its bound (`census.MAX_SECONDS`) on a job
whose globals hold millions of objects, so it is taken rarely: at the third close (the
optimizer's state exists by then), then at doubling intervals up to every `MAX_GAP` closes,
and at the first close after a new model or optimizer appears. Any census the leak watch
takes counts too. Between censuses nothing proves the figure unchanged (a tensor appended or
replaced costs nothing a close can see), so no other step states it: the frame's `kept` is
None there, and a reader shows the last census's figure with its step.
"""

from __future__ import annotations

from memtui_agent.memory.census import Census
from memtui_protocol.schema import MAX_KEPT_HOLDERS, Kept, KeptHolder

FIRST = 3
"""The first close that counts them: after an optimizer's first steps built its state."""
MAX_GAP = 256
"""Closes between two counts at most, once the gaps have doubled up to it."""


class KeptSchedule:
    """Which closes take a census to count the tensors the job keeps."""

    def __init__(self) -> None:
        self._next = FIRST
        self._gap = FIRST
        self._generation: int | None = None

    def due(self, step: int, generation: int) -> bool:
        """Whether the close of `step` counts them (`generation`: the module registry's, which
        moves when a model or an optimizer appears)."""
        if self._generation is not None and generation != self._generation:
            return True
        return step >= self._next

    def counted(self, step: int, generation: int, complete: bool = True) -> None:
        """A census ran at the close of `step` (this schedule's or the leak watch's); one that
        stopped at its bound (`complete` False: a job whose names hold millions of objects,
        up to `census.MAX_SECONDS` each time) puts the next count at the longest gap at once."""
        self._generation = generation
        if not complete:
            self._gap = MAX_GAP
        if step >= self._next or not complete:
            self._gap = min(self._gap * 2, MAX_GAP)
            self._next = step + self._gap


def kept_of(census: Census, activations: frozenset[int] | set[int]) -> Kept:
    """The frame's figure from one census: every holder's storages that no pile holds, each
    storage once (the census files a storage under the first holder that reaches it), the
    largest holders named. `activations`: the keys the activations pile holds now."""
    holders = []
    for holding in census.holdings.values():
        size = holding.kept_storages(activations)
        if size:
            holders.append(KeptHolder(holding.holder, size, holding.kept_tensors))
    holders.sort(key=lambda item: item.bytes, reverse=True)
    total = sum(item.bytes for item in holders)
    return Kept(
        bytes=total if census.complete else None,
        tensors=sum(item.tensors for item in holders),
        holders=holders[:MAX_KEPT_HOLDERS],
    )
