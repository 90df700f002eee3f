"""What autograd holds for a saved tensor while the agent's pack hook is on, and the unpack
hook that gives it back.

An activation is held through a wrapper whose `__del__` tells the ledger autograd released it
(and forgets which autograd node it was saved for: `Ledger.saved_nodes`);
a weight is kept as autograd would keep it. Every wrapper records the tensor's version when it
was saved: under saved-tensor hooks autograd no longer checks that a saved tensor was not
modified in place before backward used it, so `unpack` makes that check itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from memtui_agent.memory.finalizer_interrupts import hand_back
from memtui_agent.memory.ledger import Key, Ledger

if TYPE_CHECKING:  # for annotations only
    import torch


class Saved:
    """What autograd holds instead of a saved tensor while our pack hook is active.

    It holds `tensor.detach()`, never the tensor itself: ops that save their own output would
    otherwise form a reference cycle through the graph and the wrapper would never be freed.
    The alias shares the tensor's version counter, so unpacking can make the check autograd
    skips under saved-tensor hooks (`unpack`).
    """

    __slots__ = ("__weakref__", "keys", "ledger", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, keys: list[Key], ledger: Ledger, version: int) -> None:
        self.tensor = tensor
        self.keys = keys
        self.ledger = ledger
        self.version = version

    def __del__(self) -> None:
        try:
            self.ledger.saved_nodes_multi.pop(id(self), None)
            for key in self.keys:
                self.ledger.release_activation(key)
        except BaseException as error:  # a Ctrl-C landing here is the job's
            hand_back(error)


unpack_samplers: list[Callable[[], None]] = []
"""Called on every unpack while non-empty: FSDP2's gathered parameters are measured there."""


class SavedOne:
    """`Saved` for the common case of one storage: the key itself, no list."""

    __slots__ = ("__weakref__", "key", "ledger", "tensor", "version")

    def __init__(self, tensor: torch.Tensor, key: Key, ledger: Ledger, version: int) -> None:
        self.tensor = tensor
        self.key = key
        self.ledger = ledger
        self.version = version

    def __del__(self) -> None:
        try:
            self.ledger.saved_nodes.pop(id(self), None)
            self.ledger.release_activation(self.key)
        except BaseException as error:  # a Ctrl-C landing here is the job's
            hand_back(error)


class SavedWeight:
    """A parameter (or a view of one) saved for backward: kept as autograd would keep it, with
    the version it was saved at (a weight updated between forward and backward, a GAN's
    classic mistake, must still stop the job as it does without hooks). No `__del__`: a weight
    is not an activation."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int) -> None:
        self.tensor = tensor
        self.version = version


Packed: TypeAlias = "Saved | SavedOne | SavedWeight | torch.Tensor"
"""What the agent's pack hook gives autograd to keep: a tracked tensor's holder, or the tensor."""

MODIFIED_HINT = (
    "Hint: the backtrace further above shows the operation that failed to compute its "
    "gradient. (memtui's saved-tensor hooks make this check, which autograd skips under "
    "saved-tensor hooks.)"
)


def unpack(saved: Packed) -> torch.Tensor:
    """The tensor a `Saved*` holds (after autograd's version check), or the tensor packed as
    it is."""
    if unpack_samplers:
        unpack_samplers[0]()
    kind = type(saved)
    if kind is SavedOne or kind is Saved or kind is SavedWeight:
        # Narrowed by the exact-type test above, which mypy does not follow through `kind`.
        held: SavedOne | Saved | SavedWeight = saved  # type: ignore[assignment]
        tensor = held.tensor
        if tensor._version != held.version:
            # What autograd raises without saved-tensor hooks: with them it checks nothing, and
            # a job that modified a saved tensor in place would train on wrong gradients.
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
                f"{tensor._version}; expected version {held.version} instead. {MODIFIED_HINT}"
            )
        return tensor
    return saved  # type: ignore[return-value]  # a plain tensor, by the exact-type test above
