"""A step close's gradients, read once for the two things that need them.

Between measured steps (`--activations auto`) the gradients pile is counted outside the ledger
(bytes and dtype inventory), and the fused NaN check reads the same gradients grouped by device
and dtype. With hundreds of parameters every attribute read costs 60-100 ns per tensor per step,
so a close reads of each gradient only what torch does not already guarantee: its type, its data
pointer, and whether it is a view or starts inside its storage. Its dtype, device and size are
its parameter's (torch checks them when a gradient is assigned, and autograd produces gradients
so), and are read once per change of the parameters (`ParameterFacts`). Anything else (sparse
gradients, subclasses, views into a shared bucket) gets no shortcut: the ledger's general
`summarize` and the health check's own grouping take it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from itertools import compress, repeat

import torch

from memtui_agent.memory.ledger import dtype_inventory, dtype_name
from memtui_protocol.schema import DtypeStat

_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_NBYTES = operator.attrgetter("nbytes")
_LAYOUT = operator.attrgetter("layout")


@dataclass(frozen=True)
class ParameterFacts:
    """Per parameter, in `parameters()` order: bytes, dtype and device index, which are also its
    dense gradient's."""

    nbytes: list[int]
    dtypes: list[torch.dtype]
    devices: list[int]

    @classmethod
    def of(cls, parameters: list[torch.Tensor]) -> ParameterFacts | None:
        """The facts, or None for parameters that are not all plain strided tensors."""
        tensor = torch.Tensor
        if set(map(type, parameters)) - {torch.nn.Parameter, tensor}:
            return None
        try:
            if set(map(operator.attrgetter("layout"), parameters)) - {torch.strided}:
                return None
            return cls(
                list(map(_NBYTES, parameters)),
                list(map(_DTYPE, parameters)),
                list(map(tensor.get_device, parameters)),
            )
        except (RuntimeError, TypeError):
            return None


@dataclass
class GradientBatch:
    """The gradients present at this close, and what is known of them without another pass."""

    tensors: list[torch.Tensor]
    summary: tuple[int, dict[str, DtypeStat]] | None = None
    """(bytes, dtype inventory) when every gradient owns a storage of its own; None otherwise."""
    pointers: list[int] = field(default_factory=list)
    """Their data pointers (each the start of its own storage), with `summary`."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] | None = None
    """`(device, dtype) -> gradients` for the fused check, when they are all on one device in
    one dtype (otherwise the health check groups them)."""


def gather(parameters: list[torch.Tensor], facts: ParameterFacts | None) -> GradientBatch:
    """The `.grad` of each of `parameters` that has one, with its pile figures when exact.

    `facts` describes `parameters` (same list, same order); without it (parameters of a
    subclass) each gradient's own size, dtype and device are read.
    """
    raw = list(map(_GRAD, parameters))
    usable = False
    if facts is not None and len(facts.nbytes) == len(raw):
        usable = True
        sizes, dtypes, devices = facts.nbytes, facts.dtypes, facts.devices
    # Not `None in raw`: that compares each tensor to None with `Tensor.__eq__` (milliseconds).
    present = list(map(operator.is_not, raw, repeat(None)))
    if not all(present):
        raw = list(compress(raw, present))
        if usable:
            sizes = list(compress(sizes, present))
            dtypes = list(compress(dtypes, present))
            devices = list(compress(devices, present))
    if not raw:
        return GradientBatch([], (0, {}), [], {})
    plain = torch.Tensor
    if set(map(type, raw)) != {plain}:
        return GradientBatch(raw)
    if not usable and set(map(_LAYOUT, raw)) != {torch.strided}:
        return GradientBatch(raw)
    try:
        pointers = list(map(plain.data_ptr, raw))  # raises for sparse gradients: no storage
    except RuntimeError:
        return GradientBatch(raw)
    # A view (DDP's bucket views, a gradient stolen from a `cat`'s backward) or a tensor that
    # starts inside its storage shares or leaves part of a storage: only the general count
    # (`Ledger.summarize`) is exact for it.
    if (
        any(map(plain._is_view, raw))
        or any(map(plain.storage_offset, raw))
        or 0 in pointers
        or len(set(pointers)) != len(pointers)
    ):
        return GradientBatch(raw)
    if not usable:
        sizes = list(map(_NBYTES, raw))
        dtypes = list(map(_DTYPE, raw))
        devices = list(map(plain.get_device, raw))
    kinds = set(dtypes)
    groups = None
    if len(kinds) == 1:
        kind = kinds.pop()
        total = sum(sizes)
        summary = (total, {dtype_name(kind): DtypeStat(total, len(sizes))})
        if len(set(devices)) == 1:
            groups = {(raw[0].device, kind): raw}
    else:
        summary = dtype_inventory(zip(sizes, dtypes, strict=True))
    return GradientBatch(raw, summary, pointers, groups)
