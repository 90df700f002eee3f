"""memtui's own share of glibc's heap at a measured step's first backward, so that a CPU step
measured by the hooks and one run without them compare exactly (`step_signature`).

Under the agent's saved-tensor pack hook autograd keeps each saved tensor otherwise than without
it: a hook object per saved tensor (a 48-byte glibc chunk on this project's machines) that
holds the agent's wrapper. The wrapper keeps the tensor itself, as autograd alone does, except a
node's own output, kept as a detached alias (`memory.saved_form.held_form`). Before that choice
every saved input was a detached alias too (about 240 bytes more each), and whether autograd
alone would have kept the original whole depended on what the job dropped: per-kind costs of
-650 to +240 bytes whose small errors, summed over thousands of saved tensors, were more than
the tolerance kept for the job's own noise (`MEMORY_TOLERANCE`) on the 601-module benchmark
model. The counting's own containers are the agent's too, taken off exactly (`own_bytes`).

What each saved tensor costs, by kind, is a property of this torch and allocator: `calibrate`
measures it once, at start, on a small graph built with and without a pack hook that keeps what
the agent's keeps. During a measured step the pack hook counts the saved tensors by kind
(`HookShare`); at the first backward their count times the calibrated costs is the agent's
share, taken off the heap reading. Where the calibration is not steady, there is no share and
the reading stays as it is: a repeat is then confirmed only where it was before.
"""

from __future__ import annotations

import gc
import statistics
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from memtui_agent.memory.saved_form import held_form

if TYPE_CHECKING:  # for annotations only
    import torch


class Kind(Enum):
    """How autograd keeps a saved tensor without the agent's hook, against how it keeps it with
    it: each differs by its own number of heap bytes."""

    HELD = "kept as it is"
    """A weight (or a tensor the hook returns as it is): only the hook object differs."""
    OUTPUT = "the node's own output"
    """Without the hook a copy without metadata is kept; with it, the agent's detached one."""
    KEPT = "an input the job still holds"
    """Without the hook the tensor itself is kept; with it, a detached tensor besides."""
    KEPT_VIEW = "a view the job still holds"
    DROPPED = "an input requiring grad the job dropped"
    """Without the hook the tensor is kept whole (with autograd's metadata); with it only the
    detached one, the tensor itself freed."""
    DROPPED_VIEW = "a view the job dropped with its base"
    """As `DROPPED`, for a view: autograd alone keeps its base too."""
    DROPPED_VIEW_ONLY = "a view the job dropped, its base held"
    DROPPED_PLAIN = "an input without grad the job dropped"
    """As `DROPPED`, for a tensor that never had autograd's metadata (a mask, an index)."""


@dataclass(frozen=True)
class Costs:
    """Heap bytes per saved tensor of each kind, with the agent's hook less without it, as
    calibrated (each kind's graph saves tensors of that one kind)."""

    per_kind: dict[Kind, float]

    def share(self, saved: dict[Kind, int], freed: dict[Kind, int]) -> float:
        """The agent's share for `saved` tensors of each kind kept (`HELD`, `OUTPUT`, `KEPT`,
        `KEPT_VIEW`: what the hook adds for each) and `freed` tensors autograd alone would keep
        (`DROPPED`, `DROPPED_PLAIN`, `DROPPED_VIEW` for a view, `DROPPED_VIEW_ONLY` for a base:
        each counted once however many saved tensors it backs)."""
        cost = self.per_kind
        each = {
            Kind.DROPPED: cost[Kind.DROPPED] - cost[Kind.KEPT],
            Kind.DROPPED_PLAIN: cost[Kind.DROPPED_PLAIN] - cost[Kind.KEPT],
            Kind.DROPPED_VIEW: cost[Kind.DROPPED_VIEW_ONLY] - cost[Kind.KEPT_VIEW],
            # A base freed with its view: the graph of views dropped with their bases less
            # that of views alone. A base without grad is as any tensor without grad.
            Kind.DROPPED_VIEW_ONLY: cost[Kind.DROPPED_VIEW] - cost[Kind.DROPPED_VIEW_ONLY],
        }
        return sum(cost[kind] * count for kind, count in saved.items()) + sum(
            each[kind] * count for kind, count in freed.items()
        )


CALIBRATION_NODES = 256
"""Saved tensors per kind in the calibration graph: enough that glibc's noise (a few hundred
bytes, `step_signature`) is about a byte per tensor."""
CALIBRATION_ROUNDS = 7
CHUNK = 16
"""glibc's chunk granularity on 64-bit platforms (`MALLOC_ALIGNMENT`): every block it hands out
is a multiple of it, so is what a saved tensor adds."""
STEADY_SPREAD = 6.0
"""Bytes per tensor by which a round of one kind may differ from their median..."""
QUORUM = 4
"""...in this many rounds of `CALIBRATION_ROUNDS` for the costs to be trusted (a round that
glibc's bins made an outlier is left out)."""


class _Keep:
    """What the calibration's pack hook keeps: the agent's holders (`hooks.saved_tensors`)
    keep one tensor in a slotted object too."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _build(kind: Kind, hooked: bool, heap: Callable[[], int | None]) -> int | None:
    """Heap bytes a graph of `CALIBRATION_NODES` saved tensors of `kind` holds."""
    import torch

    n = CALIBRATION_NODES
    leaf = torch.ones(4, 4, requires_grad=True)
    inputs: list[torch.Tensor] = []
    if kind is Kind.KEPT:
        inputs = [leaf * 2.0 for _ in range(n)]
    elif kind is Kind.KEPT_VIEW:
        inputs = [(leaf * 2.0).t() for _ in range(n)]
    elif kind is Kind.DROPPED_VIEW_ONLY:
        inputs = [leaf * 2.0 for _ in range(n)]

    # The pack hook counts as the agent's does: what counting itself holds is in the costs.
    scratch = HookShare(Costs(dict.fromkeys(Kind, 0.0)))
    sequence = torch._C._autograd._get_sequence_nr

    def pack(tensor: torch.Tensor) -> _Keep:
        if kind is Kind.HELD:
            scratch.held()
            return _Keep(tensor)
        node = sequence() - 1
        scratch.saved(tensor, node)
        return _Keep(held_form(tensor, node))

    def unpack(kept: _Keep) -> torch.Tensor:
        return kept.tensor

    kept: list[Any] = []
    own = scratch.own_bytes()
    before = heap()
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if hooked else None
    if hooks is not None:
        hooks.__enter__()
    try:
        if kind is Kind.HELD:
            kept = [leaf.sin() for _ in range(n)]  # each saves the leaf, held as it is
        elif kind in (Kind.KEPT, Kind.KEPT_VIEW):
            kept = [tensor.sin() for tensor in inputs]  # each saves an input still held
        elif kind is Kind.DROPPED_VIEW_ONLY:
            kept = [tensor.t().sin() for tensor in inputs]  # each saves a view dropped after
        else:
            chain = leaf * 2.0
            for _ in range(n):
                if kind is Kind.OUTPUT:
                    chain = chain.exp()  # saves its own output
                elif kind is Kind.DROPPED:
                    chain = chain.sin()  # saves its input, dropped as `chain` moves on
                elif kind is Kind.DROPPED_VIEW:
                    chain = chain.t().sin()  # saves a view, dropped as `chain` moves on
                else:
                    # Saves its input (dropped) and two statistics without grad, made by the op
                    # itself as non-differentiable outputs: the commonest such saved tensors
                    # (a norm's statistics, a dropout's mask). Per tensor: `calibrate`.
                    chain = torch.nn.functional.layer_norm(chain, (4,))
            kept = [chain]
    finally:
        if hooks is not None:
            hooks.__exit__(None, None, None)
    after = heap()
    # The counting's containers are taken off as memtui's own (`own_bytes`), not per tensor.
    counted = scratch.own_bytes() - own
    del kept, inputs
    return None if before is None or after is None else after - before - counted


def calibrate(heap: Callable[[], int | None] | None) -> Costs | None:
    """The agent's cost per saved tensor of each kind, on this torch and allocator; None where
    it cannot be read or is not steady (then no share is taken off: `HookShare`)."""
    if heap is None:
        return None
    collecting = gc.isenabled()
    # A collection inside a build frees whatever garbage the process had (a test suite's, a
    # job's imports) in the middle of its two heap readings: held off for the calibration's
    # few tenths of a second, then as the job had it.
    gc.disable()
    try:
        import torch

        per_kind: dict[Kind, float] = {}
        with torch.enable_grad():
            for kind in Kind:
                _build(kind, True, heap)  # the first build of a kind warms glibc's bins up
                costs = []
                for _ in range(CALIBRATION_ROUNDS):
                    bare, hooked = _build(kind, False, heap), _build(kind, True, heap)
                    if bare is None or hooked is None:
                        return None
                    costs.append((hooked - bare) / CALIBRATION_NODES)
                middle = statistics.median(costs)

                if sum(1 for cost in costs if abs(cost - middle) <= STEADY_SPREAD) < QUORUM:
                    return None
                per_kind[kind] = middle
            # Its graph saved a dropped input besides the two statistics.
            plain = (per_kind[Kind.DROPPED_PLAIN] - per_kind[Kind.DROPPED]) / 2
            per_kind[Kind.DROPPED_PLAIN] = plain
        # What a saved tensor adds is a whole number of glibc chunks: the median of rounds
        # lands a few bytes under it (bins reused by the build itself), which over the
        # thousands of saved tensors of a step was 4 to 7 KB of the 16 KiB tolerance.
        return Costs({kind: round(cost / CHUNK) * CHUNK for kind, cost in per_kind.items()})
    except Exception:
        return None
    finally:
        if collecting:
            gc.enable()


class HookShare:
    """Counts a measured step's saved tensors by kind until its first backward, where their
    costs are the agent's share of the heap (`at_backward`)."""

    def __init__(self, costs: Costs) -> None:
        self._costs = costs
        self.on = True
        """Whether the pack hook counts (until the step's first backward)."""
        self._held = 0
        self._outputs = 0
        self._inputs: list[weakref.ref[torch.Tensor]] = []
        """Saved tensors not their node's output: autograd alone keeps each whole."""
        self._views: list[weakref.ref[torch.Tensor]] = []
        """Of those, the views."""
        self._bases: list[weakref.ref[torch.Tensor]] = []
        """The views' bases: autograd alone keeps each through its views."""
        self._plain: set[int] = set()
        """Tensors without grad among them (by their reference's id)."""

    def own_bytes(self) -> int:
        """Bytes of the containers the counting itself grows (a list's array and a set's table
        are glibc's above 512 bytes): memtui's own, like the ledger's tables (`Ledger.own_bytes`),
        so taken off with them. On the 601-module benchmark model they held 35 KB at the first
        backward (802 saved inputs), which a share per saved tensor did not follow."""
        return (
            sys.getsizeof(self._inputs)
            + sys.getsizeof(self._views)
            + sys.getsizeof(self._bases)
            + sys.getsizeof(self._plain)
        )

    def held(self) -> None:
        """A saved tensor kept as it is (a weight)."""
        self._held += 1

    def saved(self, tensor: torch.Tensor, node: int) -> None:
        """A saved tensor the agent keeps detached; `node`: the sequence number of the node
        being built (its own output carries it as `grad_fn`)."""
        function = tensor.grad_fn
        if function is not None and function._sequence_nr() == node:
            self._outputs += 1
            return
        ref = weakref.ref(tensor)  # the same object for the same tensor: counted once below
        if not tensor.requires_grad:
            self._plain.add(id(ref))
        base = tensor._base
        if base is None:
            self._inputs.append(ref)
            return
        self._views.append(ref)
        base_ref = weakref.ref(base)
        if not base.requires_grad:
            self._plain.add(id(base_ref))
        self._bases.append(base_ref)

    def at_backward(self) -> int:
        """The agent's share of the heap now (the step's first backward; 0 in a step the hooks
        did not measure); counting stops."""
        views = {id(ref): ref for ref in self._views}
        saved = {
            Kind.HELD: self._held,
            Kind.OUTPUT: self._outputs,
            Kind.KEPT: len(self._inputs),
            Kind.KEPT_VIEW: len(self._views),
        }
        freed = dict.fromkeys((Kind.DROPPED, Kind.DROPPED_PLAIN, Kind.DROPPED_VIEW), 0)
        freed[Kind.DROPPED_VIEW_ONLY] = 0
        plain = self._plain
        for ref in views.values():
            if ref() is None:
                freed[Kind.DROPPED_VIEW] += 1
        # A base that is also saved itself is one tensor: counted once, as a tensor.
        originals = {id(ref): ref for ref in (*self._inputs, *self._bases)}
        bases = {id(ref) for ref in self._bases} - {id(ref) for ref in self._inputs}
        for key, ref in originals.items():
            if ref() is not None:
                continue
            if key in plain:
                freed[Kind.DROPPED_PLAIN] += 1
            else:
                freed[Kind.DROPPED_VIEW_ONLY if key in bases else Kind.DROPPED] += 1
        self.on = False
        return round(self._costs.share(saved, freed))

    def reset(self, counting: bool = True) -> None:
        """A step closed: the next one counts afresh (`counting`: whether its heap is compared
        at all; on a GPU the allocator's counters are exact and nothing is counted)."""
        self._held = self._outputs = 0
        self._inputs, self._views, self._bases = [], [], []
        self._plain = set()
        self.on = counting
