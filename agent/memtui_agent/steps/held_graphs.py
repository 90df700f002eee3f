"""Which autograd graphs built by the job's model calls are still held at a close.

A graph that outlives its step (a validation loss accumulated without `torch.no_grad()`, a
list of non-detached outputs that never ran backward, a GAN critic graph built in one step and
backpropagated in the next) keeps its saved tensors alive. Such activations are real memory at
the close, and a step that holds them is not a repeat of one that did not: "held across steps
is never carried" (docs/design.md#steps).

The signal must be exact and cost nothing on healthy steps, and it must see graphs built while
the saved-tensor hooks were off. So each root call's output nodes get one small marker, as a
post hook of the node: autograd calls it when backward runs the node (its buffers are then
freed, unless backward retained the graph), and the node releases it when the graph is freed.
A marker alive and never run is a graph still holding what its forward saved. Nothing of the
job's is referenced: the node holds the marker, the watch holds markers weakly.

A marker also says which graph it marks, for the census (`memory/census.py`): the sequence
number of the node it rides on, and the numbers the call's forward gave its nodes (`first` <=
n < `last`: autograd numbers the nodes a thread builds in order). A holder whose walk reaches
the node is keeping that call's graph, with the storages the pack hook saved during the call.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol, cast

import torch

from memtui_agent.memory.census import HeldCall
from memtui_agent.memory.object_access import container_base, heap_type
from memtui_agent.memory.tensor_reads import NodeType, grad_fn, is_tensor, next_sequence_number

MAX_MARKED_PER_CALL = 16
"""Output tensors marked per root call at most (a model returning a long list of tensors)."""
MAX_PASSED_OVER = 16
"""Nodes that save nothing passed over per output before the node reached is marked itself."""


class Adopter(Protocol):
    """What takes in the values a counted graph saved without any hook
    (`hooks.saved_tensors.UnhookedSaves`)."""

    def packed_nodes(self) -> set[int]:
        """Sequence numbers of the nodes whose saves the agent's pack hook counted, alive."""
        ...

    def adopt(self, saved: object) -> bool:
        """Count `saved` (a `SavedTensor`) if it has no hooks; whether it did."""
        ...


class GraphMarker:
    """Rides on one output node of one root call; autograd calls it when backward runs it."""

    __slots__ = (
        "__weakref__",
        "armed",
        "executed",
        "first",
        "last",
        "node",
        "retained",
        "seen",
        "step",
        "watch",
    )

    def __init__(
        self, watch: HeldGraphs, step: int, armed: bool, node: int | None, first: int, last: int
    ) -> None:
        self.watch = watch
        self.step = step
        self.armed = armed
        """Whether the call ran with the agent's saved-tensor hooks counting what it saved."""
        self.node = node
        """The sequence number of the node it rides on (None if unreadable)."""
        self.first = first
        self.last = last
        """The sequence numbers the call's forward gave its nodes: `first` <= n < `last`."""
        self.executed = False
        self.retained = False
        self.seen = False
        """Already found held at an earlier close."""

    def __call__(
        self,
        grad_inputs: tuple[torch.Tensor | None, ...],
        grad_outputs: tuple[torch.Tensor | None, ...],
    ) -> None:
        self.executed = True
        if self.watch.retaining:
            self.retained = True  # backward(retain_graph=True): the buffers stay

    @property
    def holds_buffers(self) -> bool:
        """The node's graph still holds its saved tensors."""
        return not self.executed or self.retained


@dataclass(frozen=True)
class Held:
    """Graphs of root calls still holding saved tensors at a close."""

    graphs: int
    unarmed: int
    """Of those, built while the hooks were off: what they saved is in no pile."""
    oldest_step: int | None
    new_unarmed: int = 0
    """Of the unarmed ones, those no earlier close found held."""


class HeldGraphs:
    """The markers of live root-call graphs, and what they say at a close."""

    def __init__(self) -> None:
        self._markers: weakref.WeakSet[GraphMarker] = weakref.WeakSet()
        self.retaining = False
        """A top-level backward with `retain_graph=True` is running."""
        self._node_types: dict[int, NodeType] = {}

    def mark(
        self,
        output: object,
        step: int,
        armed: bool,
        first: int = 0,
        adopt: Adopter | None = None,
    ) -> None:
        """Mark the graph nodes of a root call's output (tensors, sequences, mappings); `first`
        is the first sequence number the call's forward could give a node. `adopt`: for a call
        the agent's pack hook counted, what takes the values its graph saved without any hook
        (`_adopt_unhooked`)."""
        last = next_sequence_number()
        with torch._C.DisableTorchFunction():  # a tensor subclass's `grad_fn` is read in C
            if armed and adopt is not None:
                self._adopt_unhooked(output, first, last, adopt)
            self._mark(output, step, armed, first, last)

    def _adopt_unhooked(self, output: object, first: int, last: int, adopt: Adopter) -> None:
        """Hand `adopt` what the call's graph (its nodes: numbered `first` <= n < `last`) saved
        without any hook. Autograd never gives a Python number wrapped as a tensor to
        saved-tensor hooks (`scores / math.sqrt(d)`, `h * 0.5` save a 0-dim float64), so a graph
        the pack hook counted missed 8 B per such number: 128-192 B per step on a validation
        loop that keeps its graphs. `adopt` sets the agent's pair on such a value, which is
        counted from here and released with its graph, so a graph kept past the close is in the
        activations pile to the byte. Only nodes whose saves the pack hook never saw are asked
        (a number's operation saves nothing else: `x * 0.5` needs no `x` for its gradient),
        their `other` first, and one adopted value per node: trying a value that has hooks
        raises inside torch, which costs; bounded by the call's own nodes."""
        packed = adopt.packed_nodes()
        pending = [grad_fn(tensor) for tensor in _tensors_in(output)]
        visited: set[int] = set()
        while pending:
            node = pending.pop()
            if node is None or id(node) in visited:
                continue
            visited.add(id(node))
            kind = self._node_type(type(node))
            number = kind.sequence(node)
            if number is None or not first <= number < last:
                continue  # another call's graph, or a leaf's AccumulateGrad
            if kind.raw_saved and number not in packed:
                for value in kind.saved_values(node):
                    if adopt.adopt(value):
                        break
            for edge in kind.upstream(node):
                if type(edge) is tuple and edge and edge[0] is not None:
                    pending.append(edge[0])

    def _mark(self, output: object, step: int, armed: bool, first: int, last: int) -> None:
        """One marker per node standing for an output's graph (`_saving_nodes`)."""
        marked: set[int] = set()
        for tensor in _tensors_in(output):
            for node, number in self._saving_nodes(grad_fn(tensor), first, last):
                if id(node) in marked:
                    continue
                marked.add(id(node))
                marker = GraphMarker(self, step, armed, number, first, last)
                node.register_hook(marker)
                self._markers.add(marker)
                if len(marked) >= MAX_MARKED_PER_CALL:
                    return

    def _saving_nodes(
        self, node: torch.autograd.graph.Node | None, first: int, last: int
    ) -> Iterator[tuple[torch.autograd.graph.Node, int | None]]:
        """The nodes that stand for an output's graph: the first ones from its node that can
        hold saved tensors, passing over those that save none. An output converted after the
        forward (accelerate's `convert_outputs_to_fp32` turns bf16 logits into fp32 with
        `.float()`; a loss computed inside the model never reaches that copy) has a node of its
        own that backward never runs but that saves nothing: the graph behind it is the one
        backward frees. Nodes the call did not build (numbered outside `first` <= n < `last`:
        an input's graph, a leaf's `AccumulateGrad`) are not its graph; a node whose number is
        unreadable, or one still found after `MAX_PASSED_OVER` passed over, is marked itself."""
        frontier = [node] if node is not None else []
        passed = 0
        while frontier:
            current = frontier.pop()
            kind = self._node_type(type(current))
            number = kind.sequence(current)
            if number is not None and not first <= number < last:
                continue  # not built by this call
            if kind.may_save or number is None or passed >= MAX_PASSED_OVER:
                yield current, number
                continue
            passed += 1
            for edge in kind.upstream(current):
                upstream = edge[0] if type(edge) is tuple and edge else None
                if upstream is not None:
                    frontier.append(upstream)

    def _node_type(self, cls: type) -> NodeType:
        """How to read nodes of `cls`, kept for torch's own (static) node types only: a custom
        Function's node class is the job's, and is not kept alive here."""
        known = self._node_types.get(id(cls))
        if known is not None and known.cls is cls:
            return known
        found = NodeType(cls)
        if not heap_type(cls) and len(self._node_types) < 4096:
            self._node_types[id(cls)] = found
        return found

    def held(self) -> Held:
        """What is still held now (at a close, after the step's backward passes)."""
        holding = [marker for marker in list(self._markers) if marker.holds_buffers]
        new = sum(1 for marker in holding if not marker.armed and not marker.seen)
        for marker in holding:
            marker.seen = True
        return Held(
            graphs=len(holding),
            unarmed=sum(1 for marker in holding if not marker.armed),
            oldest_step=min((marker.step for marker in holding), default=None),
            new_unarmed=new,
        )

    def calls(self) -> dict[int, HeldCall]:
        """The graphs still holding their saved tensors, by the sequence number of the node
        each marker rides on (for the census)."""
        return {
            marker.node: HeldCall(marker.first, marker.last, marker.armed)
            for marker in list(self._markers)
            if marker.holds_buffers and marker.node is not None
        }


def _tensors_in(output: object, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a forward's output: a tensor, a tuple/list, a dict or a Hugging Face
    `ModelOutput` (a dict), two levels deep. Recognised by their classes' bases and read
    through the builtins' own methods: no code of an output object runs."""
    kind = type(output)
    if kind is torch.Tensor or is_tensor(kind):
        yield cast(torch.Tensor, output)  # told by its class, never by `isinstance`
        return
    if depth >= 2:
        return
    base = container_base(kind)
    if base is tuple or base is list:
        # Read through `base`'s own method, tuple's or list's (the object may be the job's
        # subclass): which of the two, mypy cannot follow.
        sequence: Any = output
        for index in range(min(base.__len__(sequence), MAX_MARKED_PER_CALL)):
            yield from _tensors_in(base.__getitem__(sequence, index), depth + 1)
    elif base is dict:
        mapping = cast("dict[object, object]", output)  # dict or the job's subclass of it
        for item in islice(dict.values(mapping), MAX_MARKED_PER_CALL):
            yield from _tensors_in(item, depth + 1)
