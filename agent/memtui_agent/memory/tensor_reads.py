"""Tensors and autograd nodes read for a census through torch's own C descriptors.

The census reaches tensors and graph nodes the job made: a tensor subclass can override any
method in Python, define `__torch_function__` (a `MagicMock(spec=Tensor)` answers every
attribute), and a node's `_saved_*` attributes unpack what autograd saved, which runs the
job's unpack hooks and, under `checkpoint(use_reentrant=False)`, the model's forward again
(changing BatchNorm's running statistics). So:

- a tensor is recognised by `TensorBase` among its class's bases (`object_access.derives`),
  never by `isinstance` (a mock's `__class__` says Tensor);
- its storage, gradient and `grad_fn` are read through `torch._C.TensorBase`'s and
  `torch._C.StorageBase`'s C descriptors, called directly (a subclass's Python override is
  never looked up), while `census_guards` has torch's Python dispatch off (`__torch_function__`
  and `__torch_dispatch__`, of subclasses and of modes the job left active);
- a node's upstream nodes come from its type's C getset `next_functions` and its identity from
  its C method `_sequence_nr`, both found in the type's namespaces and checked to be C
  descriptors; nothing a node saved is ever read. Which storages a node saved is known from what
  the agent's own pack hook recorded (`Ledger.saved_by_node`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch

from memtui_agent.memory.ledger import Key, storage_key
from memtui_agent.memory.object_access import derives, heap_type, mro, namespace_entry

_TENSOR = torch._C.TensorBase
_STORAGE = torch._C.StorageBase
_T = _TENSOR.__dict__
_GRAD_FN = _T["grad_fn"]
_GRAD = _T["grad"]
_REQUIRES_GRAD = _T["requires_grad"]
_IS_LEAF = _T["is_leaf"]
_LAYOUT = _T["layout"]
_UNTYPED_STORAGE = _T["untyped_storage"]
_SPARSE_PARTS: dict[torch.layout, tuple[Any, ...]] = {
    torch.sparse_coo: (_T["_indices"], _T["_values"]),
    torch.sparse_csr: (_T["crow_indices"], _T["col_indices"], _T["values"]),
    torch.sparse_bsr: (_T["crow_indices"], _T["col_indices"], _T["values"]),
    torch.sparse_csc: (_T["ccol_indices"], _T["row_indices"], _T["values"]),
    torch.sparse_bsc: (_T["ccol_indices"], _T["row_indices"], _T["values"]),
}
_NBYTES = _STORAGE.__dict__["nbytes"]
_DATA_PTR = _STORAGE.__dict__["data_ptr"]
_STORAGE_DEVICE = _STORAGE.__dict__["device"]
_DEVICE_INDEX = torch.device.__dict__["index"]
_GETSET = types.GetSetDescriptorType
_METHOD = types.MethodDescriptorType


def _no_sequence_numbers() -> int:
    return 0


next_sequence_number = getattr(torch._C._autograd, "_get_sequence_nr", _no_sequence_numbers)
"""The sequence number autograd gives the next node this thread builds (torch's own counter;
without it every node looks like number -1 to the pack hook, and no saved storage is ever
matched to a node: retained graphs' bytes are then unattributed, never wrong)."""


def is_tensor(cls: type) -> bool:
    """Instances of `cls` are tensors (it derives from torch's C tensor type)."""
    return derives(cls, _TENSOR)


@contextlib.contextmanager
def census_guards() -> Iterator[None]:
    """Torch's Python dispatch off while the census reads tensors: no `__torch_function__` and
    no `__torch_dispatch__` (subclasses' or modes' the job left active) runs."""
    no_dispatch = getattr(torch._C, "_DisableTorchDispatch", contextlib.nullcontext)
    with torch._C.DisableTorchFunction(), no_dispatch():
        yield


def storages(tensor: torch.Tensor) -> list[tuple[Key, int]] | None:
    """`(key, nbytes)` of the storages a tensor keeps alive, keyed as the ledger keys them;
    None for a tensor with no storage of its own (a wrapper subclass, whose inner tensors the
    walk finds among its attributes). Meta and fake tensors own no memory: an empty list."""
    layout = _LAYOUT.__get__(tensor)
    parts = _SPARSE_PARTS.get(layout)
    pieces = [tensor] if parts is None else [part(tensor) for part in parts]
    found: list[tuple[Key, int]] = []
    for piece in pieces:
        try:
            storage = _UNTYPED_STORAGE(piece)
            nbytes = _NBYTES(storage)
            pointer = _DATA_PTR(storage)
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper's invalid storage
            return None
        if not nbytes or not pointer:
            if type(piece) is torch.Tensor or type(piece) is torch.nn.Parameter:
                continue  # meta or empty
            return None
        index = _DEVICE_INDEX.__get__(_STORAGE_DEVICE.__get__(storage))
        found.append((storage_key(-1 if index is None else index, pointer), nbytes))
    return found


def grad_fn(tensor: torch.Tensor) -> torch.autograd.graph.Node | None:
    """The tensor's autograd node (None for a leaf or a detached tensor)."""
    node: torch.autograd.graph.Node | None = _GRAD_FN.__get__(tensor)  # a C getset: untyped
    return node


def leaf_grad(tensor: torch.Tensor) -> torch.Tensor | None:
    """A leaf tensor's `.grad` (None otherwise: reading it on a non-leaf warns)."""
    if not _REQUIRES_GRAD.__get__(tensor) or not _IS_LEAF.__get__(tensor):
        return None
    grad: torch.Tensor | None = _GRAD.__get__(tensor)
    return grad


class NodeType:
    """How to read nodes of one autograd node type: its C `next_functions` getset and its C
    `_sequence_nr` method (None where the type has none that is C)."""

    __slots__ = ("cls", "may_save", "next_functions", "raw_saved", "sequence_nr")

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.next_functions = _c_descriptor(cls, "next_functions", _GETSET)
        self.sequence_nr = _c_descriptor(cls, "_sequence_nr", _METHOD)
        self.raw_saved = _raw_saved(cls)  # `other` first: where a Python number is saved
        """The C getsets `_raw_saved_*` of torch's own node types: each gives the saved value
        as autograd holds it (a `SavedTensor`, or a list of them), never unpacked."""
        self.may_save = heap_type(cls) or bool(self.raw_saved)
        """Whether nodes of this type can hold saved tensors: torch's own node types expose each
        tensor they save as a `_raw_saved_*` getset (`ToCopyBackward0`, `ViewBackward0` have
        none); a type that is not torch's (a custom `Function`'s node) may save anything."""

    def saved_values(self, node: torch.autograd.graph.Node) -> Iterator[Any]:
        """The node's saved values as autograd holds them (`SavedTensor` objects: reading one
        unpacks nothing); an undefined or released one is still listed."""
        for getset in self.raw_saved:
            try:
                value = getset.__get__(node)
            except RuntimeError:
                continue
            if type(value) is list or type(value) is tuple:
                yield from value
            else:
                yield value

    def upstream(self, node: torch.autograd.graph.Node) -> tuple[Any, ...]:
        """The nodes `node` passes gradients to (`(node, input index)` pairs)."""
        if self.next_functions is None:
            return ()
        edges = self.next_functions.__get__(node)
        return edges if type(edges) is tuple else ()

    def sequence(self, node: torch.autograd.graph.Node) -> int | None:
        """The node's sequence number: its identity on the thread that built it."""
        if self.sequence_nr is None:
            return None
        number = self.sequence_nr(node)
        return number if type(number) is int else None


def _raw_saved(cls: type) -> tuple[Any, ...]:
    if heap_type(cls):
        return ()
    found = []
    for entry in mro(cls):
        for name, value in _TYPE_NAMESPACE.__get__(entry).items():
            if type(name) is str and name.startswith("_raw_saved_") and type(value) is _GETSET:
                found.append(value)
    found.sort(key=lambda getset: getset.__name__ != "_raw_saved_other")
    return tuple(found)


_TYPE_NAMESPACE = type.__dict__["__dict__"]


def _c_descriptor(cls: type, name: str, kind: type) -> Any:
    for entry in mro(cls):
        found = namespace_entry(entry, name)
        if found is not None:
            return found if type(found) is kind else None
    return None
