"""A bounded census of live tensors: what holds memory that no pile explains, named by holder.

When memory grows over a run of closes and no pile grows with it, the question a user has is
"which tensor, and who holds it?". `take_census` answers it by walking the job's objects from
the names the user wrote: the script's globals, the locals of the training thread's frames, the
attributes of its modules (hooks and their closures included). Every tensor found is reduced to
its storages (counted once, as the ledger counts them) and filed under its *holder*: the
variable or attribute that keeps it alive, stopping at the first container on the way, so a
list `history` that gains one tensor per step is one holder, not a thousand. A tensor whose
autograd graph still holds saved tensors (never backpropagated, as `val_total += loss` without
`torch.no_grad()` keeps it) is a retained graph: its graph's nodes are walked and the storages
the agent's pack hook saved for those nodes are filed under the same holder.

Graphs are walked once the objects are, holder by holder, each holder's whole graph before the
next, the holder with the newest root first, and never through another holder's root: a node
(and what it saved) goes to one holder (`Holding.nodes`), the one that built on it last, unless
it lies beneath another holder's root. So the holder that keeps a growing history
(`total_loss += loss` after backward: every step's nodes stay chained, their saved tensors
freed) has the whole chain, whether a value derived from it (`avg = total_loss / n`) was
computed from its current root (its walk stops there) or from an older one (the total's root is
newer, walked first). Each holder's newest root nodes are noted by sequence number
(`Holding.roots`), and a census told the roots of the one before it (`follow`) says which of
them the same holder still reaches (`Census.alive`): a holder whose old root now lies beneath a
new one is extending its graph, not replacing it.

Walking from names rather than from `gc.get_objects()` is what makes the holder nameable, and
breadth first makes it the shortest path. Storages already in a pile (weights, gradients,
optimizer state) are left out by key.

The census never runs the job's code (issue 32). It reads objects only through what the
interpreter exposes in C (`object_access`), tensors and graph nodes only through torch's C
descriptors with torch's Python dispatch off (`tensor_reads`), and never a node's `_saved_*`
(which would unpack: the job's unpack hooks, a checkpoint's recomputed forward). What a graph
saved is known from the agent's own records: the pack hook notes, for each storage it saves,
the autograd node it was saved for (`Ledger.saved_by_node`, by the node's sequence number),
and each root call's graph is marked with the numbers of the nodes its forward built
(`HeldCall`). A graph built while the hooks were off has no such records: the holder that
reaches it says so (`Holding.unknown_graphs`), and its saved bytes are not known.

It is bounded inside the walk, a huge single container included (read in chunks between checks
of the bounds): at most `MAX_OBJECTS` references looked at and `MAX_SECONDS`; when a bound stops
it, the census says which (`stopped`). Any error inside it ends that census only: what it found
so far is returned with `stopped` = error, and the error with it (the caller reports it once).

Known limitations:
    - Only objects reachable from the given roots through containers, attributes, closures,
      bound methods and module hooks are seen; memory held only by C++ (a custom extension's
      cache) or by another thread's frames is not.
    - A node's saved storages are matched by its sequence number, which autograd counts per
      thread: they are the followed thread's. Storages an in-place operation on a view saved
      (hidden inside autograd's `CopySlices`) are matched through the root call whose forward
      saved them; saved outside any root call, they stay unattributed (`Census.unattributed`).
    - A census stopped by a bound while it walked objects walks no graph.
"""

from __future__ import annotations

import bisect
import time
import types
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from memtui_agent.memory.ledger import Key
from memtui_agent.memory.object_access import (
    TypeFacts,
    attributes,
    container_base,
    container_length,
    deque_maxlen,
    derives,
    heap_type,
    key_text,
    namespace_entry,
    referents,
    type_name,
)
from memtui_agent.memory.tensor_reads import (
    NodeType,
    census_guards,
    grad_fn,
    is_tensor,
    leaf_grad,
    storages,
)
from memtui_protocol.schema import CensusStop, LeakKind

MAX_OBJECTS = 1_000_000
"""References looked at by one census at most (container items, attributes, graph nodes): 0.4 s
over plain numbers, and 43 MiB of the walk's own bookkeeping when every one is an object to
visit, on the development machine (`benchmarks/census_cost.py`, docs/numbers.md)."""
MAX_SECONDS = 2.0
MAX_DEPTH = 16
CHUNK = 1024
"""Items of one container read between two checks of the bounds."""
CHECK_EVERY = 256
"""Queue entries between two reads of the clock."""
MAX_QUALNAME = 200
LEAF_NODE = 2**64 - 1
"""The sequence number autograd gives a leaf tensor's `AccumulateGrad` node (a parameter's): it
belongs to the leaf, which every graph through it shares, and is counted in no holder's nodes."""
MAX_ROOTS = 8
"""Root nodes noted per holder (its newest): enough to tell whether the holder's graph is
extended or replaced between two censuses."""

_LEAF_IDS = frozenset(
    id(kind)
    for kind in (
        str,
        bytes,
        bytearray,
        int,
        float,
        complex,
        bool,
        type(None),
        range,
        slice,
        memoryview,
        type(Ellipsis),
        type(NotImplemented),
    )
)
"""Values that hold no tensor, by the identity of their exact class (a class is never hashed:
its metaclass could answer)."""
_SKIPPED_BASES: tuple[type, ...] = (
    type,  # classes (their namespaces are code, not data the job holds)
    types.ModuleType,  # a lazily loaded module executes when touched
    types.FrameType,
    types.TracebackType,
    types.CodeType,
    types.BuiltinFunctionType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    types.GeneratorType,
    types.CoroutineType,
    types.AsyncGeneratorType,
    types.MappingProxyType,
    __import__("weakref").ReferenceType,  # weak: keeps nothing alive
    __import__("weakref").ProxyType,
    __import__("weakref").CallableProxyType,
    torch.optim.Optimizer,  # its state is a pile, its parameters are weights
    torch.dtype,
    torch.device,
    torch.layout,
    torch.Size,
)
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)
_MODULE_INTERNALS = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOK_DICTS}
)
_AGENT = "memtui_agent"


@dataclass(frozen=True)
class HeldCall:
    """A root call's graph still holding its saved tensors, as `held_graphs` marked it: the
    sequence numbers its forward's nodes were given (`first` <= n < `last`), and whether the
    agent's pack hook was on for it (else what it saved was never recorded)."""

    first: int
    last: int
    armed: bool


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
    """The holder's builtin container (`list`, `dict`, ...), None for a variable or attribute
    that refers to a tensor itself (or another kind of object)."""
    attached: int = 0
    """Tensors still attached to an autograd graph (not detached), ran or not."""
    unknown_graphs: int = 0
    """Root-call graphs it keeps alive that were built while the agent's hooks were off: what
    they saved is not known, and not in `graph_storages`."""
    kept_tensors: int = 0
    """Its tensors with a storage in `storages` that the activations pile does not hold
    either (`kept_storages`): what it keeps outside every pile."""
    nodes: int = 0
    """Autograd nodes of its tensors' graphs filed under it (leaves' `AccumulateGrad` nodes
    left out), saved tensors freed or not; each node is filed under one holder only."""
    roots: tuple[int, ...] = ()
    """Sequence numbers of its tensors' own `grad_fn` nodes, the newest `MAX_ROOTS`."""

    def kept_storages(self, activations: frozenset[int] | set[int]) -> int:
        """Bytes of its own tensors' storages that no pile holds: `storages` less those saved
        by graphs still alive (the activations pile counts those)."""
        return sum(size for key, size in self.storages.items() if key not in activations)

    @property
    def bytes(self) -> int:
        """Everything the holder keeps alive that the census could count, each storage once."""
        return sum(self.storages.values()) + sum(self.graph_storages.values())

    @property
    def kind(self) -> LeakKind:
        """A retained graph when saved tensors are part of what it holds."""
        if self.graph_storages or self.unknown_graphs:
            return LeakKind.RETAINED_GRAPH
        return LeakKind.TENSORS


@dataclass
class Census:
    """One walk's result: holdings by holder, and what the walk cost."""

    holdings: dict[str, Holding]
    visited: int
    """References looked at."""
    seconds: float
    complete: bool
    """False when the walk stopped early or a container changed under it: holders found are
    real, more may exist."""
    stopped: CensusStop | None = None
    """Why the walk ended early (None: it did not)."""
    error: BaseException | None = None
    """The error that ended it (`stopped` is then `ERROR`), its traceback dropped."""
    unattributed: int = 0
    """Bytes of saved tensors that live graphs hold and no holder's graph was matched to."""
    alive: frozenset[int] = frozenset()
    """Those of the root sequence numbers it was told to follow (`follow`) that the graph of
    the same holder still reaches."""

    def largest(self, limit: int = 10) -> list[Holding]:
        """The holders keeping the most bytes alive."""
        return sorted(self.holdings.values(), key=lambda h: h.bytes, reverse=True)[:limit]


class Namespace:
    """A root that is a whole namespace (the script's globals): its names are read lazily, in
    chunks like any big dict, each named `<name><suffix>`; dunder names are left out."""

    __slots__ = ("mapping", "suffix")

    def __init__(self, mapping: dict[Any, Any], suffix: str = "") -> None:
        self.mapping = mapping
        self.suffix = suffix


Root = tuple[str, Any] | Namespace

# Queue entries: (what, object, path, holder, depth, cursor).
_VALUE, _ITEMS = 0, 1
# How a container's items are read and named: by index (lists, tuples, an object's referents),
# by iteration (sets, deques), a dict's values, a root namespace's names, or (path, item) pairs
# (attributes, closures, submodules and hooks).
_BY_INDEX, _BY_ITERATION, _BY_ITEMS, _BY_NAME, _BY_PATH = 0, 1, 2, 3, 4


class _Kind:
    """How instances of one class are walked, decided once per class per census."""

    LEAF, SKIP, TENSOR, CONTAINER, MODULE, FUNCTION, METHOD, CELL, OBJECT, OPAQUE = range(10)


@dataclass
class _Walk:
    """State of one census walk."""

    excluded: frozenset[int] | set[int]
    activations: frozenset[int] | set[int]
    deadline: float
    max_objects: int
    saved: dict[int, list[tuple[Key, int]]]
    calls: dict[int, HeldCall]
    queue: deque[tuple[Any, ...]] = field(default_factory=deque)
    examined: int = 0
    visited: set[int] = field(default_factory=set)
    kept: list[Any] = field(default_factory=list)
    """Everything visited stays referenced until the walk ends, so no id() is reused."""
    counted: set[int] = field(default_factory=set)
    holdings: dict[str, Holding] = field(default_factory=dict)
    containers: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    reached_calls: list[tuple[int, int, str]] = field(default_factory=list)
    facts: dict[int, tuple[int, TypeFacts]] = field(default_factory=dict)
    node_types: dict[int, NodeType] = field(default_factory=dict)
    graphs: dict[str, list[Any]] = field(default_factory=dict)
    """Root nodes by holder, in the order the holders were found: walked after the objects."""
    follow: dict[int, str] = field(default_factory=dict)
    alive: set[int] = field(default_factory=set)
    complete: bool = True
    stopped: CensusStop | None = None

    def holding(self, holder: str) -> Holding:
        found = self.holdings.get(holder)
        if found is None:
            found = self.holdings[holder] = Holding(holder)
        return found

    def kind_of(self, cls: type) -> tuple[int, TypeFacts]:
        known = self.facts.get(id(cls))
        if known is None:
            facts = TypeFacts(cls)
            known = self.facts[id(cls)] = (_classify(cls, facts), facts)
        return known

    def node_type(self, cls: type) -> NodeType:
        known = self.node_types.get(id(cls))
        if known is None:
            known = self.node_types[id(cls)] = NodeType(cls)
        return known

    def out_of_budget(self) -> bool:
        if self.examined >= self.max_objects:
            self.stopped = CensusStop.OBJECTS
        elif time.perf_counter() > self.deadline:
            self.stopped = CensusStop.SECONDS
        return self.stopped is not None


def take_census(
    roots: Iterable[Root],
    excluded: frozenset[int] | set[int] = frozenset(),
    max_objects: int = MAX_OBJECTS,
    max_seconds: float = MAX_SECONDS,
    saved: dict[int, list[tuple[Key, int]]] | None = None,
    calls: dict[int, HeldCall] | None = None,
    activations: frozenset[int] | set[int] = frozenset(),
    follow: dict[int, str] | None = None,
) -> Census:
    """Walk from `roots`, breadth first, and file every tensor by holder. Never raises.

    Args:
        roots: the names to start from, in order of preference (the first path found to an
            object names it): `(label, object)` pairs and whole namespaces.
        excluded: storage keys already counted in a pile.
        max_objects: stop after looking at this many references (`stopped` then says so).
        max_seconds: likewise for time.
        saved: what the agent's pack hook recorded, by node (`Ledger.saved_by_node`).
        calls: live root-call graphs by their output nodes' sequence numbers (`held_graphs`).
        activations: storage keys the activations pile holds now: filed like any other, but
            a tensor held only through them is not one the holder keeps outside every pile
            (`Holding.kept_tensors`).
        follow: root sequence numbers of an earlier census (`Holding.roots`) and their
            holders: which of them the same holder's graph still reaches is `Census.alive`.
    """
    started = time.perf_counter()
    walk = _Walk(
        excluded,
        activations,
        started + max_seconds,
        max_objects,
        dict(saved) if saved else {},
        calls or {},
        follow=follow or {},
    )
    error: BaseException | None = None
    try:
        with census_guards():
            for root in roots:
                if isinstance(root, Namespace):  # our own class: nothing of the job's runs
                    # Its first chunk of names is queued now, ahead of the roots after it.
                    cursor = iter(dict.items(root.mapping))
                    _read_items(walk, root, None, None, 0, (_BY_NAME, cursor))
                else:
                    label, value = root
                    walk.queue.append((_VALUE, value, label, None, 0, None))
            _run(walk)
            if walk.stopped is None:
                _walk_graphs(walk)
            unattributed = _attribute_by_call(walk)
    except Exception as exc:  # MemoryError and RecursionError included: this census only
        walk.stopped = CensusStop.ERROR
        exc.__traceback__ = None  # its frames hold the walk's references to the job's objects
        exc.__context__ = None
        error = exc
        unattributed = 0
    finally:
        walk.queue.clear()
        walk.kept.clear()
        walk.facts.clear()
        walk.node_types.clear()
        walk.graphs.clear()
    for path, (container, maxlen) in walk.containers.items():
        holding = walk.holdings.get(path)
        if holding is not None:
            holding.container, holding.bounded = container, maxlen
    return Census(
        holdings={name: h for name, h in walk.holdings.items() if h.bytes or h.unknown_graphs},
        visited=walk.examined,
        seconds=time.perf_counter() - started,
        complete=walk.complete and walk.stopped is None,
        stopped=walk.stopped,
        error=error,
        unattributed=unattributed,
        alive=frozenset(walk.alive),
    )


def _run(walk: _Walk) -> None:
    queue = walk.queue
    since_check = 0
    while queue and walk.stopped is None:
        since_check += 1
        if since_check >= CHECK_EVERY:
            since_check = 0
            if walk.out_of_budget():
                return
        what, value, path, holder, depth, cursor = queue.popleft()
        if what == _VALUE:
            _visit(walk, value, path, holder, depth)
        else:
            _read_items(walk, value, path, holder, depth, cursor)


def _classify(cls: type, facts: TypeFacts) -> int:
    """How to walk instances of `cls`, from its bases only."""
    if id(cls) in _LEAF_IDS:
        return _Kind.LEAF
    if any(derives(cls, base) for base in _SKIPPED_BASES):
        return _Kind.SKIP
    module = namespace_entry(cls, "__module__")
    if type(module) is str and (module == _AGENT or module.startswith(_AGENT + ".")):
        return _Kind.SKIP  # the agent's own objects (its hooks on the job's modules)
    if is_tensor(cls):
        return _Kind.TENSOR
    if container_base(cls) is not None:
        return _Kind.CONTAINER
    if derives(cls, torch.nn.Module):
        return _Kind.MODULE
    if cls is types.FunctionType:
        return _Kind.FUNCTION
    if cls is types.MethodType:
        return _Kind.METHOD
    if cls is types.CellType:
        return _Kind.CELL
    if facts.instance_dict is not None or facts.members or heap_type(cls):
        return _Kind.OBJECT
    return _Kind.OPAQUE


def _enqueue(walk: _Walk, value: Any, path: str | None, holder: str | None, depth: int) -> None:
    """Queue one reference (leaves are looked at and dropped here)."""
    walk.examined += 1
    if id(type(value)) in _LEAF_IDS:
        return
    walk.queue.append((_VALUE, value, path, holder, depth, None))


def _visit(walk: _Walk, value: Any, path: str, holder: str | None, depth: int) -> None:
    identity = id(value)
    if identity in walk.visited:
        return
    kind, facts = walk.kind_of(type(value))
    if kind == _Kind.LEAF or kind == _Kind.SKIP:
        return
    walk.visited.add(identity)
    walk.kept.append(value)
    if kind == _Kind.TENSOR:
        _file_tensor(walk, value, facts, holder or path, depth)
        return
    if depth >= MAX_DEPTH:
        return
    if kind == _Kind.CONTAINER:
        base = container_base(type(value))
        assert base is not None
        if holder is None:
            maxlen = deque_maxlen(value) if base is deque else None
            walk.containers[path] = (type_name(base), maxlen)
            holder = path
        if base is list or base is tuple:
            cursor: tuple[int, Any] = (_BY_INDEX, 0)
        elif base is dict:
            cursor = (_BY_ITEMS, iter(dict.items(value)))
        else:
            cursor = (_BY_ITERATION, base.__iter__(value))  # type: ignore[attr-defined]
        _read_items(walk, value, path, holder, depth, cursor)
        if type(value) is not base:  # a subclass may keep more in its attributes
            named = _named(attributes(value, facts), None, holder)
            _read_items(walk, value, path, holder, depth, (_BY_PATH, named))
        return
    if kind == _Kind.OPAQUE:
        # A C object whose fields have no names: it holds what it refers to, like a container.
        _read_items(walk, referents(value), path, holder or path, depth, (_BY_INDEX, 0))
        return
    if kind == _Kind.MODULE:
        children = _module_children(value, facts, path, holder)
    elif kind == _Kind.FUNCTION:
        children = _closure_children(value, holder)
    elif kind == _Kind.METHOD:
        children = iter(((path, value.__self__),))
    elif kind == _Kind.CELL:
        children = _cell_content(value, path)
    else:
        children = _named(attributes(value, facts), path, holder)
    _read_items(walk, value, path, holder, depth, (_BY_PATH, children))


def _named(
    found: Iterable[tuple[str, Any]], path: str | None, holder: str | None
) -> Iterator[tuple[str | None, Any]]:
    """Attributes with their paths (`path.name`), built only while they can still name a
    holder (inside a container the container is the holder, and paths are not needed)."""
    for name, item in found:
        yield (None if holder is not None or path is None else f"{path}.{name}"), item


def _cell_content(cell: Any, path: str) -> Iterator[tuple[str | None, Any]]:
    try:
        content = cell.cell_contents
    except ValueError:  # an empty cell
        return
    yield path, content


def _read_items(
    walk: _Walk, container: Any, path: str | None, holder: str | None, depth: int, cursor: Any
) -> None:
    """Queue up to `CHUNK` items of a container, a root namespace or an object's attributes
    (never beyond the budget), and queue the rest of it behind what is queued; every chunk
    ends with a check of the bounds."""
    how, position = cursor
    inner = depth + 1
    limit = min(CHUNK, walk.max_objects - walk.examined)
    if limit <= 0:
        walk.out_of_budget()
        return
    read = 0
    try:
        if how == _BY_INDEX:
            base = list if type(container) is list or derives(type(container), list) else tuple
            end = min(container_length(container, base), position + limit)
            getitem = base.__getitem__
            for index in range(position, end):
                _enqueue(walk, getitem(container, index), None, holder, inner)
            if end - position == limit:
                walk.queue.append((_ITEMS, container, path, holder, depth, (how, end)))
        else:
            for item in position:
                read += 1
                if how == _BY_ITEMS:
                    _enqueue(walk, item[1], None, holder, inner)
                elif how == _BY_PATH:
                    _enqueue(walk, item[1], item[0], holder, inner)
                elif how == _BY_NAME:
                    key = item[0]
                    if type(key) is str and not key.startswith("__"):
                        _enqueue(walk, item[1], key_name(key) + container.suffix, None, depth)
                    else:
                        walk.examined += 1
                else:
                    _enqueue(walk, item, None, holder, inner)
                if read == limit:
                    walk.queue.append((_ITEMS, container, path, holder, depth, cursor))
                    break
    except (RuntimeError, IndexError):  # changed size while read (another thread)
        walk.complete = False
    walk.out_of_budget()


def key_name(key: str) -> str:
    """A root name as a holder's path (`key_text` quotes; a variable's name is bare)."""
    return key if len(key) <= 80 else key[:77] + "..."


def _module_children(
    module: Any, facts: TypeFacts, path: str, holder: str | None
) -> Iterator[tuple[str | None, Any]]:
    """Submodules by name, attributes that are not parameters or buffers, and hooks."""

    def at(suffix: str) -> str | None:
        return None if holder is not None else path + suffix

    attrs = dict(attributes(module, facts))
    submodules = attrs.get("_modules")
    if type(submodules) is dict:
        for name, child in dict.items(submodules):
            if child is not None:
                yield at("." + (name if type(name) is str else key_text(name))), child
    for name, item in attrs.items():
        if name not in _MODULE_INTERNALS:
            yield at("." + name), item
    for kind in _HOOK_DICTS:
        hooks = attrs.get(kind)
        if hooks is None or container_base(type(hooks)) is not dict:
            continue
        label = kind.strip("_").replace("_", " ")[:-1]
        for hook in dict.values(hooks):
            yield at(f" {label} {_callable_name(hook)}"), hook


def _callable_name(hook: Any) -> str:
    """A hook's name, from what C exposes of plain functions and bound methods only."""
    kind = type(hook)
    if kind is types.MethodType:
        hook, kind = hook.__func__, type(hook.__func__)
    if kind is types.FunctionType:
        return str.__str__(hook.__qualname__)[:MAX_QUALNAME]
    return type_name(kind)


def _closure_children(
    function: types.FunctionType, holder: str | None
) -> Iterator[tuple[str | None, Any]]:
    """A function's closure cells, named `variable (closure of function)`, and defaults."""
    qualname = str.__str__(function.__qualname__)[:MAX_QUALNAME]
    cells = function.__closure__ or ()
    names = function.__code__.co_freevars
    for name, cell in zip(names, cells, strict=False):
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield f"{name} (closure of {qualname})", content
    for index, default in enumerate(function.__defaults__ or ()):
        yield f"{qualname} default {index}", default
    keywords = function.__kwdefaults__
    if type(keywords) is dict:
        for name, default in dict.items(keywords):
            yield f"{qualname} default {name if type(name) is str else '?'}", default


def _file_tensor(walk: _Walk, tensor: Any, facts: TypeFacts, holder: str, depth: int) -> None:
    """Count a tensor's storages and its `.grad`; queue its autograd graph."""
    holding = walk.holding(holder)
    holding.tensors += 1
    node = grad_fn(tensor)
    if node is not None:
        holding.attached += 1
    found = storages(tensor)
    if found is None:
        # A wrapper subclass (DTensor, a float8 tensor): its memory is its inner tensors'.
        for _name, item in attributes(tensor, facts):
            _enqueue(walk, item, None, holder, depth + 1)
    elif any(key not in walk.activations for key in _count(walk, found, holding.storages)):
        holding.kept_tensors += 1
    grad = leaf_grad(tensor)
    if grad is not None:
        grad_storages = storages(grad)
        if grad_storages:
            _count(walk, grad_storages, holding.storages)
    if node is not None:
        walk.examined += 1
        walk.graphs.setdefault(holder, []).append(node)


def _walk_graphs(walk: _Walk) -> None:
    """The holders' graphs, bounded like the rest of the walk: holder by holder, the one with
    the newest root first, each node to the first holder that reaches it, and never through
    another holder's root (what lies beneath it is that holder's)."""
    order: list[tuple[int, int, str]] = []
    owners: dict[int, str] = {}
    for holder, nodes in walk.graphs.items():
        numbers = sorted(
            {n for node in nodes if (n := walk.node_type(type(node)).sequence(node)) is not None}
        )
        walk.holding(holder).roots = tuple(numbers[-MAX_ROOTS:])
        order.append((numbers[-1] if numbers else -1, len(order), holder))
        for node in nodes:
            owners.setdefault(id(node), holder)
    for _newest, _found, holder in sorted(order, key=lambda item: (-item[0], item[1])):
        holding = walk.holding(holder)
        pending = deque(walk.graphs[holder])
        since_check = 0
        while pending:
            since_check += 1
            if since_check >= CHECK_EVERY:
                since_check = 0
                if walk.out_of_budget():
                    return
            node = pending.popleft()
            if id(node) in walk.visited:
                continue
            _visit_node(walk, node, holding, pending, owners)


def _visit_node(
    walk: _Walk, node: Any, holding: Holding, pending: deque[Any], owners: dict[int, str]
) -> None:
    """One autograd node: counted, the storages the agent saw saved for it and a root call's
    mark on it, then the nodes upstream (never anything it saved)."""
    walk.visited.add(id(node))
    walk.kept.append(node)
    reader = walk.node_type(type(node))
    number = reader.sequence(node)
    if number != LEAF_NODE:
        holding.nodes += 1
    if number is not None:
        if walk.follow.get(number) == holding.holder:
            walk.alive.add(number)
        saved = walk.saved.pop(number, None)
        if saved:
            _count(walk, saved, holding.graph_storages)
        call = walk.calls.get(number)
        if call is not None:
            if call.armed:
                walk.reached_calls.append((call.first, call.last, holding.holder))
            else:
                holding.unknown_graphs += 1
    for edge in reader.upstream(node):
        upstream = edge[0] if type(edge) is tuple and edge else None
        walk.examined += 1
        if upstream is None or id(upstream) in walk.visited:
            continue
        if owners.get(id(upstream), holding.holder) == holding.holder:
            pending.append(upstream)


def _attribute_by_call(walk: _Walk) -> int:
    """Saved storages whose own node no walk reached (an in-place operation on a view saves
    for a node autograd hides inside `CopySlices`) go to the holder of the root call whose
    forward saved them; the bytes left over are returned (unattributed)."""
    calls = sorted(walk.reached_calls)
    starts = [first for first, _last, _holder in calls]
    unattributed = 0
    for number, saved in walk.saved.items():
        index = bisect.bisect_right(starts, number) - 1
        if index >= 0 and calls[index][0] <= number < calls[index][1]:
            _count(walk, saved, walk.holding(calls[index][2]).graph_storages)
            continue
        unattributed += sum(
            nbytes for key, nbytes in saved if key not in walk.excluded and key not in walk.counted
        )
    return unattributed


def _count(walk: _Walk, found: Iterable[tuple[Key, int]], into: dict[int, int]) -> list[Key]:
    """File the storages not counted yet (nor in a pile) `into` a holding; the keys filed."""
    filed = []
    for key, nbytes in found:
        if key in walk.excluded or key in walk.counted:
            continue
        walk.counted.add(key)
        into[key] = nbytes
        filed.append(key)
    return filed
