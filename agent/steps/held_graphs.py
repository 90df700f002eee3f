"""Which autograd graphs built by the job's model calls are still held at a close.

A graph that outlives its step (a validation loss accumulated without `torch.no_grad()`, a
list of non-detached outputs that never ran backward, a GAN critic graph built in one step and
backpropagated in the next) keeps its saved tensors alive. Such activations are real memory at
the close, and a step that holds them is not a repeat of one that did not: "held across steps
is never carried" (DESIGN.md, "Steps").

The signal must be exact and cost nothing on healthy steps, and it must see graphs built while
the saved-tensor hooks were off. So each root call's output nodes get one small marker, as a
post hook of the node: autograd calls it when backward runs the node (its buffers are then
freed, unless backward retained the graph), and the node releases it when the graph is freed.
A marker alive and never run is a graph still holding what its forward saved. Nothing of the
job's is referenced: the node holds the marker, the watch holds markers weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

MAX_MARKED_PER_CALL = 16
"""Output tensors marked per root call at most (a model returning a long list of tensors)."""


class GraphMarker:
    """Rides on one output node of one root call; autograd calls it when backward runs it."""

    __slots__ = ("__weakref__", "armed", "executed", "retained", "step", "watch")

    def __init__(self, watch: HeldGraphs, step: int, armed: bool) -> None:
        self.watch = watch
        self.step = step
        self.armed = armed
        """Whether the call ran with the saved-tensor hooks armed (the ledger counted it)."""
        self.executed = False
        self.retained = False

    def __call__(self, grad_inputs: Any, grad_outputs: Any) -> None:
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
    """Of those, built while the hooks were off: their saved tensors are in no pile yet."""
    oldest_step: int | None


class HeldGraphs:
    """The markers of live root-call graphs, and what they say at a close."""

    def __init__(self) -> None:
        self._markers: weakref.WeakSet[GraphMarker] = weakref.WeakSet()
        self.retaining = False
        """A top-level backward with `retain_graph=True` is running."""

    def mark(self, output: Any, step: int, armed: bool) -> None:
        """Mark the graph nodes of a root call's output (tensors, sequences, mappings)."""
        marked: set[int] = set()
        for tensor in _tensors_in(output):
            node = tensor.grad_fn
            if node is None or id(node) in marked:
                continue
            marked.add(id(node))
            marker = GraphMarker(self, step, armed)
            node.register_hook(marker)
            self._markers.add(marker)
            if len(marked) >= MAX_MARKED_PER_CALL:
                break

    def held(self) -> Held:
        """What is still held now (at a close, after the step's backward passes)."""
        holding = [marker for marker in list(self._markers) if marker.holds_buffers]
        return Held(
            graphs=len(holding),
            unarmed=sum(1 for marker in holding if not marker.armed),
            oldest_step=min((marker.step for marker in holding), default=None),
        )

    def forget_unarmed(self) -> None:
        """The unarmed graphs held now were counted another way (a census adopted their saved
        tensors into the ledger): from now on they count as armed."""
        for marker in list(self._markers):
            marker.armed = True


def _tensors_in(output: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a forward's output: a tensor, a tuple/list, a dict or a Hugging Face
    `ModelOutput` (a dict), two levels deep."""
    if isinstance(output, torch.Tensor):
        yield output
    elif depth < 2 and isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors_in(item, depth + 1)
    elif depth < 2 and isinstance(output, dict):
        for item in output.values():
            yield from _tensors_in(item, depth + 1)
