"""A bounded census of live tensors: what holds memory that no pile explains, named by holder.

When memory grows over a run of closes and no pile grows with it, the question a user has is
"which tensor, and who holds it?". `take_census` answers it by walking the job's objects from
the names the user wrote: the script's globals, the locals of the training thread's frames, the
attributes of its modules (hooks and their closures included). Every tensor found is reduced to
its storages (counted once, as the ledger counts them) and filed under its *holder*: the
variable or attribute that keeps it alive, stopping at the first container on the way, so a
list `history` that gains one tensor per step is one holder, not a thousand. A tensor whose
autograd graph still holds saved tensors (never backpropagated, as `val_total += loss` without
`torch.no_grad()` keeps it) is a retained graph: its graph is walked and the saved storages are
filed under the same holder.

Walking from names rather than from `gc.get_objects()` is what makes the holder nameable, and
breadth first makes it the shortest path. It is bounded in objects and seconds, and says when it
stopped early; storages already in a pile (weights, gradients, optimizer state, counted
activations) are left out by key.

Known limitations:
    - Only objects reachable from the given roots through containers, attributes, closures,
      bound methods and module hooks are seen; memory held only by C++ (a custom extension's
      cache) or by another thread's frames is not.
    - Saved tensors are read through autograd's `_saved_*` attributes; a node type that exposes
      none (custom C++ autograd functions) contributes nothing.
"""

from __future__ import annotations

import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memtui_agent.memory.ledger import StorageInfo, storages_of
from memtui_protocol.schema import LeakKind

MAX_OBJECTS = 2_000_000
"""Objects visited at most by one census (about a second of walking here)."""
MAX_SECONDS = 2.0
MAX_DEPTH = 16
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
"""Values that hold no tensor: never followed."""
_SKIPPED = (
    type,
    types.ModuleType,
    types.FrameType,
    types.CodeType,
    types.BuiltinFunctionType,
    types.GeneratorType,
    types.CoroutineType,
    torch.optim.Optimizer,  # its state is a pile, its parameters are weights
    torch.dtype,
    torch.device,
)
_NOT_FOLLOWED = _LEAVES + _SKIPPED
_LEAF_TYPES = frozenset(_LEAVES)
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_MODULE_INTERNALS = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOK_DICTS}
)


@dataclass
class Holding:
    """What one holder keeps alive that no pile counts."""

    holder: str
    storages: dict[int, int] = field(default_factory=dict)
    """Storage key -> bytes, for the tensors the holder refers to."""
    graph_storages: dict[int, int] = field(default_factory=dict)
    """Storage key -> bytes saved by autograd graphs those tensors keep alive."""
    tensors: int = 0
    bounded: int | None = None
    """The `maxlen` of a deque holder: it stops growing there."""
    container: str | None = None
    """The holder's type when it is a container (`list`, `dict`, ...), None for a variable or
    attribute that refers to a tensor itself."""
    attached: int = 0
    """Tensors still attached to an autograd graph (not detached), ran or not."""

    @property
    def bytes(self) -> int:
        """Everything the holder keeps alive, each storage once."""
        return sum(self.storages.values()) + sum(self.graph_storages.values())

    @property
    def kind(self) -> LeakKind:
        """A retained graph when saved tensors are part of what it holds."""
        return LeakKind.RETAINED_GRAPH if self.graph_storages else LeakKind.TENSORS


@dataclass
class Census:
    """One walk's result: holdings by holder, and what the walk cost."""

    holdings: dict[str, Holding]
    visited: int
    seconds: float
    complete: bool
    """False when a bound stopped the walk: holders found are real, more may exist."""

    def largest(self, limit: int = 10) -> list[Holding]:
        """The holders keeping the most bytes alive."""
        return sorted(self.holdings.values(), key=lambda h: h.bytes, reverse=True)[:limit]


@dataclass
class _Walk:
    """State of one census walk."""

    excluded: frozenset[int] | set[int]
    deadline: float
    max_objects: int
    visited: set[int] = field(default_factory=set)
    kept: list[Any] = field(default_factory=list)
    """Everything visited stays referenced until the walk ends, so no id() is reused."""
    counted: set[int] = field(default_factory=set)
    nodes: set[Any] = field(default_factory=set)
    holdings: dict[str, Holding] = field(default_factory=dict)
    complete: bool = True
    adopt: Callable[[StorageInfo], object] | None = None

    def holding(self, holder: str) -> Holding:
        found = self.holdings.get(holder)
        if found is None:
            found = self.holdings[holder] = Holding(holder)
        return found


def take_census(
    roots: Iterable[tuple[str, Any]],
    excluded: frozenset[int] | set[int] = frozenset(),
    max_objects: int = MAX_OBJECTS,
    max_seconds: float = MAX_SECONDS,
    adopt: Callable[[StorageInfo], object] | None = None,
) -> Census:
    """Walk from `roots` (label, object), breadth first, and file every tensor by holder.

    Args:
        roots: the names to start from, in order of preference (the first path found to an
            object names it): script globals, then frame locals, then modules.
        excluded: storage keys already counted in a pile.
        max_objects: stop after visiting this many objects (`complete` is then False).
        max_seconds: likewise for time.
        adopt: called with each storage a retained graph saves (not excluded), while the walk
            still holds it: the ledger counts those as activations from then on.
    """
    started = time.perf_counter()
    walk = _Walk(excluded, started + max_seconds, max_objects, adopt=adopt)
    queue: deque[tuple[Any, str, str | None, int]] = deque()
    for label, value in roots:
        queue.append((value, label, None, 0))
    while queue:
        if len(walk.visited) >= walk.max_objects or (
            len(walk.visited) % 1024 == 0 and time.perf_counter() > walk.deadline
        ):
            walk.complete = False
            break
        value, path, holder, depth = queue.popleft()
        if isinstance(value, _NOT_FOLLOWED):
            continue
        if isinstance(value, _Container):
            holding = walk.holding(path)
            holding.container, holding.bounded = value.kind, value.maxlen
            continue
        identity = id(value)
        if identity in walk.visited:
            continue
        walk.visited.add(identity)
        walk.kept.append(value)
        if isinstance(value, torch.Tensor):
            _file_tensor(walk, value, holder or path)
            continue
        if depth >= MAX_DEPTH:
            continue
        for child, child_path, child_holder in _children(value, path, holder):
            queue.append((child, child_path, child_holder, depth + 1))
    census = Census(
        holdings={name: h for name, h in walk.holdings.items() if h.bytes},
        visited=len(walk.visited),
        seconds=time.perf_counter() - started,
        complete=walk.complete,
    )
    walk.kept.clear()
    walk.nodes.clear()
    return census


def _file_tensor(walk: _Walk, tensor: Any, holder: str) -> None:
    """Count a tensor's storages, its `.grad` and the saved tensors of a retained graph."""
    holding = walk.holding(holder)
    holding.tensors += 1
    if tensor.grad_fn is not None:
        holding.attached += 1
    _count(walk, storages_of(tensor), holding.storages)
    if not tensor.requires_grad:
        return
    grad = tensor.grad if tensor.is_leaf else None
    if grad is not None:
        _count(walk, storages_of(grad), holding.storages)
    node = tensor.grad_fn
    if node is not None:
        for saved in saved_tensors(node, walk.nodes):
            infos = storages_of(saved)
            if walk.adopt is not None:
                for info in infos:
                    if info[0] not in walk.excluded:
                        walk.adopt(info)
            _count(walk, infos, holding.graph_storages)


def _count(walk: _Walk, infos: Iterable[Any], into: dict[int, int]) -> None:
    for key, nbytes, _dtype, _storage in infos:
        if key in walk.excluded or key in walk.counted:
            continue
        walk.counted.add(key)
        into[key] = nbytes


def _children(value: Any, path: str, holder: str | None) -> Iterator[tuple[Any, str, str | None]]:
    """What `value` refers to, with the path to each and the holder it files under.

    Entering a container (list, dict, deque...) fixes the holder at the container's path:
    whatever is found inside, however deep, belongs to it.
    """
    if isinstance(value, dict):
        inner = holder or path
        if holder is None:
            yield _Container(type(value).__name__), path, path
        for key, item in list(value.items()):
            if type(item) not in _LEAF_TYPES:
                yield item, f"{path}[{_key_text(key)}]", inner
    elif isinstance(value, (list, tuple, deque, set, frozenset)):
        inner = holder or path
        if holder is None:
            maxlen = value.maxlen if isinstance(value, deque) else None
            yield _Container(type(value).__name__, maxlen), path, path
        items = list(value)
        # A dataset's million numbers: skipped in C before any path string is made.
        kept = [i for i, item in enumerate(items) if type(item) not in _LEAF_TYPES]
        for index in kept:
            yield items[index], f"{path}[{index}]", inner
    elif isinstance(value, torch.nn.Module):
        yield from _module_children(value, path, holder)
    elif isinstance(value, types.FunctionType):
        yield from _closure_children(value, holder)
    elif isinstance(value, types.MethodType):
        yield value.__self__, path, holder
    else:
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            for name, item in list(attributes.items()):
                yield item, f"{path}.{name}", holder
        for name in _slot_names(type(value)):
            item = getattr(value, name, None)
            if item is not None:
                yield item, f"{path}.{name}", holder


def _module_children(
    module: torch.nn.Module, path: str, holder: str | None
) -> Iterator[tuple[Any, str, str | None]]:
    """Submodules by name, attributes that are not parameters or buffers, and hooks."""
    for name, child in list(module._modules.items()):
        if child is not None:
            yield child, f"{path}.{name}", holder
    for name, item in list(module.__dict__.items()):
        if name not in _MODULE_INTERNALS:
            yield item, f"{path}.{name}", holder
    for kind in _HOOK_DICTS:
        hooks = module.__dict__.get(kind)
        for hook in list(hooks.values()) if isinstance(hooks, dict) else ():
            name = getattr(hook, "__qualname__", type(hook).__name__)
            yield hook, f"{path} {kind.strip('_').replace('_', ' ')[:-1]} {name}", holder


def _closure_children(
    function: types.FunctionType, holder: str | None
) -> Iterator[tuple[Any, str, str | None]]:
    """A function's closure cells, named `variable (closure of function)`."""
    cells = function.__closure__ or ()
    for name, cell in zip(function.__code__.co_freevars, cells, strict=False):
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield content, f"{name} (closure of {function.__qualname__})", holder
    defaults = function.__defaults__ or ()
    for index, default in enumerate(defaults):
        yield default, f"{function.__qualname__} default {index}", holder


class _Container:
    """Says what kind of container a holder is (a deque with a `maxlen` is bounded)."""

    __slots__ = ("kind", "maxlen")

    def __init__(self, kind: str, maxlen: int | None = None) -> None:
        self.kind = kind
        self.maxlen = maxlen


_slots_cache: dict[type, tuple[str, ...]] = {}


def _slot_names(kind: type) -> tuple[str, ...]:
    names = _slots_cache.get(kind)
    if names is None:
        found: list[str] = []
        for cls in kind.__mro__:
            slots = cls.__dict__.get("__slots__", ())
            found.extend([slots] if isinstance(slots, str) else slots)
        names = _slots_cache[kind] = tuple(n for n in found if n not in ("__dict__", "__weakref__"))
    return names


def _key_text(key: Any) -> str:
    text = repr(key) if isinstance(key, (str, int, float, tuple)) else type(key).__name__
    return text if len(text) <= 40 else text[:37] + "..."


_saved_names: dict[type, tuple[str, ...]] = {}


def saved_tensors(node: Any, seen: set[Any]) -> Iterator[Any]:
    """The tensors an autograd graph still holds for backward, from `node` upstream.

    Nodes already in `seen` (walked for another holder) are skipped; `seen` keeps them
    referenced until the caller clears it. A node whose buffers were freed (backward ran
    without `retain_graph`) raises on access and holds nothing.
    """
    stack = [node]
    while stack:
        current = stack.pop()
        if current is None or current in seen:
            continue
        seen.add(current)
        for name in _saved_attribute_names(type(current)):
            try:
                value = getattr(current, name)
            except Exception:  # freed by backward, or an unpack hook that refuses
                continue
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (tuple, list)):
                yield from (item for item in value if isinstance(item, torch.Tensor))
        try:
            upstream = current.next_functions
        except Exception:
            continue
        stack.extend(function for function, _index in upstream if function is not None)


def _saved_attribute_names(kind: type) -> tuple[str, ...]:
    """The attributes of a node type that unpack saved tensors: `_saved_*` on autograd's own
    nodes (sizes and strides left out), `saved_tensors` on a custom `autograd.Function`'s."""
    names = _saved_names.get(kind)
    if names is None:
        found = [
            name
            for name in dir(kind)
            if name.startswith("_saved_")
            and not name.endswith(("_sym_sizes", "_sym_strides", "_sizes", "_strides"))
        ]
        if issubclass(kind, torch.autograd.function.BackwardCFunction):
            found.append("saved_tensors")
        names = _saved_names[kind] = tuple(found)
    return names
