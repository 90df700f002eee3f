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
from memtui_agent.memory.ledger import NODE_SHIFT, Key, Ledger, plain_storage

if TYPE_CHECKING:  # for annotations only
    import torch


class Saved:
    """What autograd holds instead of a saved tensor while our pack hook is active: the tensor
    as `held_form` keeps it, its storages' keys, and the version it was saved at."""

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


class SavedScalar:
    """A tensor autograd saved without calling any pack hook, adopted afterwards: a Python
    number wrapped as a tensor (`x / math.sqrt(d)`, `h * 0.5` save a 0-dim float64; autograd
    never hands such "wrapped numbers" to saved-tensor hooks). Holds the tensor itself: unpacked
    it must stay the same wrapped number (a plain 0-dim tensor promotes types differently), and
    it references no graph, so no cycle can form."""

    __slots__ = ("__weakref__", "key", "ledger", "tensor")

    def __init__(self, tensor: torch.Tensor, key: Key, ledger: Ledger) -> None:
        self.tensor = tensor
        self.key = key
        self.ledger = ledger

    def __del__(self) -> None:
        try:
            self.ledger.release_activation(self.key)
        except BaseException as error:  # a Ctrl-C landing here is the job's
            hand_back(error)


class UnhookedSaves:
    """Adopts into the activations pile what a graph saved without any saved-tensor hook
    (`adopt`, called by `steps.held_graphs` on the saved values of a graph the agent's pair
    counted): the agent's own pair is set on that one saved value, which counts it now and
    releases it with its graph."""

    def __init__(self, ledger: Ledger, module: int) -> None:
        self._ledger = ledger
        self._module = module
        """Where `top_activations` files them (no module runs when a call has returned)."""

    def packed_nodes(self) -> set[int]:
        """The sequence numbers of the nodes whose saved tensors the agent's pack hook counted
        and that are still alive (from its own records: `Ledger.saved_nodes`, which holds the
        number after the node's, and `saved_nodes_multi`, the node's own)."""
        ledger = self._ledger
        found = {(value >> NODE_SHIFT) - 1 for value in list(ledger.saved_nodes.values())}
        found.update(number for number, _keys in list(ledger.saved_nodes_multi.values()))
        return found

    def adopt(self, saved: object) -> bool:
        """Set the pair on `saved` (a `torch._C._autograd.SavedTensor`); False where it has
        hooks already (the agent's, the job's: autograd refuses a second pair and changes
        nothing), holds nothing, or was released by backward."""
        try:
            saved.register_hooks(self._pack, _unpack_scalar)  # type: ignore[attr-defined]
        except RuntimeError:
            return False
        return True

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | SavedScalar:
        plain = plain_storage(tensor)
        if plain is None:
            return tensor
        key, nbytes, name, _storage = plain
        if not nbytes or not key >> 8:
            return tensor
        self._ledger.acquire_activation(key, nbytes, name, self._module)
        return SavedScalar(tensor, key, self._ledger)


def _unpack_scalar(saved: torch.Tensor | SavedScalar) -> torch.Tensor:
    """The adopted number itself (the very tensor autograd saved, still a wrapped number)."""
    if isinstance(saved, SavedScalar):  # the agent's own class: no job code runs
        return saved.tensor
    return saved
