"""Incremental pile counters over unique storages.

Every tensor the hooks see is reduced to its storages, keyed by `(device index, data_ptr)`, and
each storage is counted once with `nbytes()`, so tied weights, views and flat buffers never count
twice (docs/design.md#memory-piles). A storage can belong to several piles at once (a weight packed
by autograd as `weight.t()`); it is counted in the first of weights, gradients, optimizer state,
activations that claims it.

Updates are O(1) per hook event. Membership in weights, gradients and optimizer state lasts until
the next `sync()` of that pile or until the storage is freed (a weakref callback on the storage,
as PyTorch's mem_tracker does); activation membership lasts while any autograd pack wrapper holds
the storage. Callbacks can fire on autograd worker threads, hence the lock.

Known limitations:
    - Tensor subclasses whose storage is not reachable through `untyped_storage()` (wrapper
      subclasses, some quantized types) are skipped rather than guessed.
    - Storages packed inside `checkpoint(use_reentrant=False)` regions are packed by the
      checkpoint's own hooks, not ours, so recomputed activations are not counted.
"""

from __future__ import annotations

import heapq
import operator
import sys
import threading
import weakref
from collections.abc import Iterable
from enum import IntEnum
from itertools import repeat
from typing import Any

import torch

from memtui_agent.memory.finalizer_interrupts import hand_back
from memtui_protocol.schema import DtypeStat, ModuleBytes, Pile, Piles


class PileIndex(IntEnum):
    """A pile's position in the ledger's lists: `schema.Pile` in its order, as ints, because the
    hooks index lists on every event (an int indexes a list in C; a `Pile` would need a dict).

    `pile` gives the schema's spelling back; the order is checked against `Pile` at import.
    """

    WEIGHTS = 0
    GRADIENTS = 1
    OPTIMIZER_STATE = 2
    ACTIVATIONS = 3

    @property
    def pile(self) -> Pile:
        """The schema's member for this pile."""
        return _PILE_OF[self]


_PILE_OF = tuple(Pile)
if [index.name for index in PileIndex] != [pile.name for pile in Pile]:
    raise ImportError("PileIndex must list schema.Pile's members in its order")

WEIGHTS = PileIndex.WEIGHTS
GRADIENTS = PileIndex.GRADIENTS
OPTIMIZER_STATE = PileIndex.OPTIMIZER_STATE
ACTIVATIONS = PileIndex.ACTIVATIONS
PERSISTENT = (WEIGHTS, GRADIENTS, OPTIMIZER_STATE)
"""The piles whose members are claimed by `sync`/`claim` (activations are packed instead)."""
_PERSISTENT_NAMED = tuple((index, index.pile) for index in PERSISTENT)
_BITS = tuple(1 << index for index in PileIndex)
"""A storage's membership mask: one bit per pile; the lowest set bit is the pile it counts in."""
ACTIVATION_BIT = _BITS[ACTIVATIONS]
_ACTIVATIONS_AT = int(ACTIVATIONS)
_GRADIENTS_AT = int(GRADIENTS)
_GRADIENTS_BIT = _BITS[GRADIENTS]
"""The hot paths' spelling of `ACTIVATIONS`: a plain int indexes and compares in CPython's fast
paths, an IntEnum member in the generic ones (80 against 30 ns for four list reads)."""
NO_PILE = -1
"""`_Entry.pile` of a storage no pile counts (its bits are all clear)."""
NO_MODULE = -1
"""Module id for activations packed outside any module's forward (e.g. the loss function)."""

Key = int
"""A storage's identity: its data pointer and device in one int (`storage_key`)."""
StorageInfo = tuple[Key, int, str, torch.UntypedStorage]
_Cached = Key | tuple[int, tuple[Key, ...]]
"""`sync`'s cache of a tensor's storages (by id): its key alone when it has one storage that
starts at its data (the tensor's data pointer is then the key's: `key >> 8`), an int, which the
garbage collector does not track (a gradient hook writes one per gradient per step); otherwise
(the tensor's data pointer, the keys)."""
"""(key, nbytes, dtype name, untyped storage) for one storage of a tensor."""
NODE_SHIFT = 80
"""Bits of a `saved_nodes` value below the node's sequence number: a key is under 2^66 (an
address of at most 57 bits shifted by 8, plus the device)."""
ENTRY_POOL = 4096
"""Freed entries kept for reuse: hooks then allocate no new objects the garbage collector
tracks, which matters because each young-generation collection also walks autograd graphs."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its local shard); any other tensor as it is.

    Health checks and forecasts must work on the local shard: operating on the DTensor itself
    would dispatch a distributed op (a collective, or an implicit replication) inside the job.
    """
    if type(tensor) is torch.Tensor:  # the common case, without a failing attribute lookup
        return tensor
    inner = getattr(tensor, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else tensor


def storage_key(device: int, pointer: int) -> Key:
    """`(device, data_ptr)` as one int: unlike a tuple, nothing for the garbage collector."""
    return (pointer << 8) | (device + 1)


_dtype_names: dict[torch.dtype, str] = {}
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")


def dtype_inventory(
    storages: Iterable[tuple[int, torch.dtype]],
) -> tuple[int, dict[str, DtypeStat]]:
    """Total bytes and dtype inventory of `(nbytes, dtype)` pairs, one per unique storage."""
    inventory: dict[torch.dtype, list[int]] = {}
    for size, dtype in storages:
        stat = inventory.get(dtype)
        if stat is None:
            stat = inventory[dtype] = [0, 0]
        stat[0] += size
        stat[1] += 1
    total = sum(stat[0] for stat in inventory.values())
    named = {
        dtype_name(dtype): DtypeStat(size, count) for dtype, (size, count) in inventory.items()
    }
    return total, named


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> `"float32"`, cached because it runs on every pack."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype).removeprefix("torch.")
    return name


_fake_storages = False
"""Whether fake tensors (FakeTensorMode) are counted; see `count_fake_storages`."""


def count_fake_storages(enabled: bool) -> None:
    """Count fake tensors' storages as if they were real (`memtui estimate` only).

    A FakeTensor's storage lives on the meta device with data pointer 0, so by default it
    counts zero, like any meta tensor. The estimate's child process runs a training step on
    fake tensors through the real hooks and ledger, and turns this on so each fake storage is
    keyed by its StorageImpl address instead. Off in a training job, where fake tensors are
    torch.compile's tracing values, never memory. The check sits in the zero-pointer branch of
    `storages_of` only, so real tensors' hot path (`plain_storage`) is unchanged.
    """
    global _fake_storages
    _fake_storages = enabled


def storages_of(tensor: torch.Tensor) -> list[StorageInfo]:
    """The storages a tensor keeps alive: one for strided tensors, several for sparse ones.

    Meta tensors own no memory and give an empty list, as do empty storages (fake tensors too,
    unless `count_fake_storages` is on). Wrapper subclasses
    (nested jagged tensors, DTensor, float8 wrappers) have no storage of their own: their inner
    tensors are followed through `__tensor_flatten__`; anything else unreachable is skipped.
    """
    if tensor.is_meta:
        return []
    layout = tensor.layout
    if layout is torch.strided:
        parts = [tensor]
    elif layout is torch.sparse_coo:
        parts = [tensor._indices(), tensor._values()]
    elif layout is torch.sparse_csr or layout is torch.sparse_bsr:
        parts = [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    elif layout is torch.sparse_csc or layout is torch.sparse_bsc:
        parts = [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    else:
        parts = [tensor]
    found: list[StorageInfo] = []
    for part in parts:
        try:
            storage = part.untyped_storage()
            nbytes = storage.nbytes()
            pointer = storage.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):
            found.extend(_inner_storages(part))
            continue
        if nbytes == 0 or pointer == 0:
            if nbytes and _fake_storages and storage.device.type == "meta":
                # A fake tensor: its storage is a meta storage (pointer 0) that still has a
                # distinct StorageImpl, alive exactly as long as a real one would be.
                key = storage_key(part.get_device(), storage._cdata)
                found.append((key, nbytes, dtype_name(part.dtype), storage))
                continue
            if type(part) is not torch.Tensor and type(part) is not torch.nn.Parameter:
                found.extend(_inner_storages(part))
            continue
        found.append(
            (storage_key(part.get_device(), pointer), nbytes, dtype_name(part.dtype), storage)
        )
    return found


def plain_storage(tensor: torch.Tensor) -> StorageInfo | None:
    """`storages_of` for the hooks' common case, a plain strided tensor, without building a
    list (it runs for every saved tensor and every gradient); None for anything else.

    A meta tensor's storage has data pointer 0, so its key has no pointer (`not key >> 8`),
    which callers treat as "holds no memory": no separate `is_meta` test on the hot path.
    """
    if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided:
        return None
    storage = tensor.untyped_storage()
    dtype = tensor.dtype
    name = _dtype_names.get(dtype)
    if name is None:
        name = dtype_name(dtype)
    key = (storage.data_ptr() << 8) | (tensor.get_device() + 1)  # storage_key, inlined
    return key, storage.nbytes(), name, storage


def _inner_storages(wrapper: torch.Tensor, depth: int = 0) -> list[StorageInfo]:
    """Storages of a traceable wrapper subclass's inner tensors (bounded recursion)."""
    flatten = getattr(wrapper, "__tensor_flatten__", None)
    if flatten is None or depth > 4:
        return []
    names, _context = flatten()
    found = []
    for name in names:
        inner = getattr(wrapper, name, None)
        if isinstance(inner, torch.Tensor) and inner is not wrapper:
            found.extend(storages_of(inner) if depth < 4 else [])
    return found


class _Entry:
    """One unique storage and the piles that claim it."""

    __slots__ = ("act_refs", "dtype", "mask", "module", "nbytes", "pile", "ref")

    def __init__(self, nbytes: int, dtype: str) -> None:
        self.ref: weakref.ref[torch.UntypedStorage] | None = None
        self.reset(nbytes, dtype)

    def reset(self, nbytes: int, dtype: str) -> _Entry:
        """A fresh entry for a new storage (also how a pooled entry is reused)."""
        self.nbytes = nbytes
        self.dtype = dtype
        self.mask = 0
        self.pile = NO_PILE
        self.act_refs = 0
        self.module = NO_MODULE
        return self


class Ledger:
    """The four piles, their per-step high-water marks and their dtype inventories."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: dict[Key, _Entry] = {}
        self._members: list[set[Key]] = [set() for _ in PERSISTENT]
        self._membership_changes = 0
        """Bumped whenever a storage joins or leaves a persistent pile."""
        self._pointer_sets: dict[int, tuple[int, frozenset[int]]] = {}
        self.piles = [0 for _ in PileIndex]
        self._dtypes: list[dict[str, list[int]]] = [{} for _ in PileIndex]
        self._module_live: dict[int, int] = {}
        self._sync_cache: list[dict[int, _Cached]] = [{} for _ in PERSISTENT]
        self._fingerprints: list[Any] = [None for _ in PERSISTENT]
        self._act_max_pending = False
        self._peak_pending = False
        self._pool: list[_Entry] = []
        self._ref_keys: dict[int, Key] = {}
        """id(weakref) -> key, for the one shared free callback."""
        self._on_freed = self._freed
        """The callback bound once: `self._freed` would make a new bound method per weakref."""
        self.saved_nodes: dict[int, int] = {}
        """id(a live saved-tensor wrapper of one storage) -> `(node + 1 << NODE_SHIFT) | key`:
        the autograd node (its sequence number) the pack hook saved the storage for. Written by
        the pack hook, removed by the wrapper's `__del__`; ints only, so the hook allocates
        nothing the garbage collector tracks. A census reads it (`saved_by_node`) to know
        which storages a retained graph holds without unpacking anything."""
        self.saved_nodes_multi: dict[int, tuple[int, tuple[Key, ...]]] = {}
        """The same for the rare wrapper of several storages (sparse and wrapper tensors)."""
        self.watching_gradients = True
        """Whether the gradients pile is kept here by the gradient hooks (`pile_count`): False
        between measured steps, where the gradients are counted at each close beside the
        ledger and its gradients pile is empty."""
        self._touched = 0
        """Bits (`_BITS`) of the persistent piles whose bytes moved since the step opened."""
        self._watched_from_open = True
        self.reset_step()

    def own_bytes(self) -> int:
        """Bytes of the tables that grow with the activations counted (a dict's table is
        reallocated as it grows, and stays as large once its entries go): what the ledger
        itself adds to glibc's heap during a measured forward (`steps.step_signature`)."""
        tables: tuple[object, ...] = (
            self._entries,
            self.saved_nodes,
            self.saved_nodes_multi,
            self._module_live,
            self._module_max,
            self._ref_keys,
            self._pool,
        )
        return sum(sys.getsizeof(table) for table in tables)

    # ----- step window ---------------------------------------------------------------------

    def reset_step(self, start_gradients: int | None = None) -> None:
        """Start a new step window: high-water marks restart from the current state.

        `start_gradients`: the gradients alive as the step opens, counted at the close that
        opened it. When the ledger does not hold them (`watching_gradients` false: the hooks
        are disarmed), they still are the opening moment's gradients, so the opening
        composition the marks start from has them: a step that arms at its first root call, after
        the job's `zero_grad()` freed them, still has them in its high and its peak.
        """
        with self._lock:
            start = list(self.piles)
            if start_gradients is not None and not self.watching_gradients:
                start[GRADIENTS] = start_gradients
            self.max = start
            self.peak = list(start)
            self.peak_total = sum(start)
            self._touched = 0
            self._watched_from_open = self.watching_gradients
            self._act_dtypes_at_max = self._dtype_snapshot(ACTIVATIONS)
            self._act_max_pending = False
            self._peak_pending = False
            self._module_max = dict(self._module_live)

    def at_close(self) -> tuple[Piles, Piles, Piles, dict[str, dict[str, DtypeStat]]]:
        """(current, max, peak, dtypes) for the step that is closing."""
        with self._lock:
            self._settle()
            dtypes: dict[str, dict[str, DtypeStat]] = {
                pile: self._dtype_snapshot(index) for index, pile in _PERSISTENT_NAMED
            }
            dtypes[Pile.ACTIVATIONS] = dict(self._act_dtypes_at_max)
            return Piles(*self.piles), Piles(*self.max), Piles(*self.peak), dtypes

    def current(self) -> Piles:
        """The piles now."""
        return Piles(*self.piles)

    def steady(self) -> frozenset[Pile]:
        """The persistent piles the ledger watched for the whole step and whose bytes never
        moved in it (read at the close, after the close's own recount): known at every
        moment of the step, the peak's unseen one included. The gradients pile is one only
        while the gradient hooks kept it here from the step's opening on."""
        with self._lock:
            touched = self._touched
            steady = {index.pile for index in PERSISTENT if not touched & _BITS[index]}
            if not (self._watched_from_open and self.watching_gradients):
                steady.discard(Pile.GRADIENTS)
            return frozenset(steady)

    def gradients_watched(self) -> bool:
        """Whether the gradient hooks kept the gradients pile here from the step's opening to
        now (its high is then the ledger's own)."""
        with self._lock:
            return self._watched_from_open and self.watching_gradients

    def module_maxima(self) -> dict[int, int]:
        """Each module's most saved-activation bytes live at once during the step (a copy)."""
        with self._lock:
            return {module: size for module, size in self._module_max.items() if size > 0}

    def top_modules(self, limit: int) -> list[ModuleBytes]:
        """Modules with the most saved-activation bytes live at once during the step."""
        with self._lock:
            held = [(module, size) for module, size in self._module_max.items() if size > 0]
        ranked = heapq.nlargest(limit, held, key=operator.itemgetter(1))
        return [ModuleBytes(module, size) for module, size in ranked]

    def _settle(self) -> None:
        """Take the high-water details owed since a pile last reached a new high.

        While piles only grow, every increase is a new high, so the peak's composition and the
        activation dtype inventory at the activations' maximum are taken lazily: just before
        the first decrease after a new high, or when the step closes. Same result as a copy at
        every new high, without allocating one per pack during forward.
        """
        if self._peak_pending:
            self.peak = list(self.piles)
            self._peak_pending = False
        if self._act_max_pending:
            self._act_dtypes_at_max = self._dtype_snapshot(ACTIVATIONS)
            self._act_max_pending = False

    def _dtype_snapshot(self, pile: PileIndex) -> dict[str, DtypeStat]:
        return {name: DtypeStat(size, count) for name, (size, count) in self._dtypes[pile].items()}

    # ----- membership ----------------------------------------------------------------------

    def sync(self, pile: PileIndex, tensors: Iterable[torch.Tensor]) -> bool:
        """Make `pile` exactly the storages of `tensors` (weights or optimizer state or grads).

        Called at a step close when the pile may have changed (`pile_watch.PileWatch`); it catches
        reassigned buffers, `p.data = ...`, state loaded from a checkpoint and anything else no
        hook reports. Returns whether the pile's storages changed.
        """
        tensors = tensors if isinstance(tensors, list) else list(tensors)
        members = self._members[pile]
        # The usual close changes nothing: the same tensor objects on the same pointers, and no
        # storage of the pile freed or claimed since (both change its size). Checked in C.
        try:
            fingerprint = (
                list(map(id, tensors)),
                list(map(torch.Tensor.data_ptr, tensors)),
                len(members),
            )
        except RuntimeError:  # sparse and wrapper tensors have no single data pointer
            fingerprint = None
        if fingerprint is not None and fingerprint == self._fingerprints[pile]:
            return False
        if fingerprint is not None and self._confirmed(pile, fingerprint):
            return False
        # Otherwise a cache keyed by id() and confirmed by data_ptr() skips re-deriving the
        # storages of tensors seen before. It holds keys only, never tensors or storages, so it
        # keeps nothing alive; a cached key no longer in the pile (freed, and its pointer
        # reused) is derived again.
        cache = self._sync_cache[pile]
        fresh: dict[int, _Cached] = {}
        found: set[Key] = set()
        new_infos: list[StorageInfo] = []
        for tensor in tensors:
            ident = id(tensor)
            try:
                pointer = tensor.data_ptr()
                if not pointer:  # a DTensor's own is 0: its local shard's identifies it
                    pointer = local_tensor(tensor).data_ptr()
            except RuntimeError:
                pointer = 0
            cached = cache.get(ident)
            if isinstance(cached, int):  # one storage, starting at the tensor's data
                if cached >> 8 == pointer and pointer != 0 and cached in members:
                    fresh[ident] = cached
                    found.add(cached)
                    continue
            elif cached is not None and cached[0] == pointer and pointer != 0:
                keys = cached[1]
                if len(keys) == 1:
                    if keys[0] in members:
                        fresh[ident] = cached
                        found.add(keys[0])
                        continue
                elif all(key in members for key in keys):
                    fresh[ident] = cached
                    found.update(keys)
                    continue
            infos = storages_of(tensor)
            keys = tuple(info[0] for info in infos)
            if len(keys) == 1 and keys[0] >> 8 == pointer:
                fresh[ident] = keys[0]
            else:
                fresh[ident] = (pointer, keys)
            for info in infos:
                found.add(info[0])
                new_infos.append(info)
        self._sync_cache[pile] = fresh
        changed = False
        with self._lock:
            for key in members - found:
                self._clear_bit(key, pile)
                changed = True
            for info in new_infos:
                if info[0] not in members:
                    self._claim(info, pile)
                    changed = True
            if fingerprint is not None and 0 not in fingerprint[1]:
                self._fingerprints[pile] = (fingerprint[0], fingerprint[1], len(members))
        return changed

    def _confirmed(self, pile: PileIndex, fingerprint: tuple[list[int], list[int], int]) -> bool:
        """Whether every tensor is in the pile's cache at its pointer with one storage, and
        those storages are exactly the pile's members: the loop of `sync` would then change
        nothing. The usual armed close (every gradient claimed by its hook, `claim_gradient`),
        checked with C iterators instead of a Python loop per tensor."""
        ids, pointers, _count = fingerprint
        if not ids or 0 in pointers:
            return False
        cache = self._sync_cache[pile]
        cached = list(map(cache.get, ids))
        if set(map(type, cached)) != {int}:  # one not cached, or not a single storage
            return False
        # Narrowed by the test above, which mypy does not follow into the list.
        keys: list[Key] = cached  # type: ignore[assignment]
        if list(map(operator.rshift, keys, repeat(8))) != pointers:
            return False
        with self._lock:
            members = self._members[pile]
            if len(members) > len(keys) or set(keys) != members:
                return False
            self._sync_cache[pile] = dict(zip(ids, keys, strict=True))
            self._fingerprints[pile] = (ids, pointers, len(members))
        return True

    def summarize(
        self, pile: PileIndex, tensors: list[torch.Tensor]
    ) -> tuple[int, dict[str, DtypeStat]] | None:
        """Bytes and dtype inventory of `tensors`' unique storages, as `sync` would count them
        for `pile`, without making them members (no entry, no weakref, no free callback).

        For gradients between measured steps (`--activations auto`) that `gradient_batch`
        cannot count from their parameters (views into shared storages): a fresh `.grad` per
        parameter each step would otherwise cost a claim and a free callback per tensor. None
        when this cannot be exact cheaply (a tensor that is not plain and strided, or a storage
        another pile holds): the caller then syncs.
        """
        plain = torch.Tensor
        if not tensors:
            return 0, {}
        if set(map(type, tensors)) != {plain} or set(map(_LAYOUT, tensors)) != {torch.strided}:
            return None
        storages = list(map(plain.untyped_storage, tensors))
        unique = {
            (pointer << 8) | (device + 1): (size, dtype)
            for pointer, size, device, dtype in zip(
                map(torch.UntypedStorage.data_ptr, storages),
                map(torch.UntypedStorage.nbytes, storages),
                map(plain.get_device, tensors),
                map(_DTYPE, tensors),
                strict=False,
            )
            if pointer and size
        }
        if not self.pointers_elsewhere(pile).isdisjoint(key >> 8 for key in unique):
            return None
        return dtype_inventory(unique.values())

    def pointers_elsewhere(self, pile: PileIndex) -> frozenset[int]:
        """Data pointers of the storages the other piles hold (any device), kept until their
        membership changes: a close checks a few hundred fresh gradients against it in C,
        without building a key per gradient. A pointer equal on two devices only makes the
        caller take the exact general path."""
        with self._lock:
            cached = self._pointer_sets.get(pile)
            if cached is not None and cached[0] == self._membership_changes:
                return cached[1]
            pointers = frozenset(
                key >> 8
                for other, members in enumerate(self._members)
                if other != pile
                for key in members
            )
            self._pointer_sets[pile] = (self._membership_changes, pointers)
            return pointers

    def member_count(self, pile: PileIndex) -> int:
        """Storages in a persistent pile; it drops when one is freed (a weakref callback), which
        tells a step close that the pile changed without a walk."""
        return len(self._members[pile])

    def add(self, pile: PileIndex, tensor: torch.Tensor) -> None:
        """Claim the storages of one tensor for a persistent pile (a fresh gradient)."""
        infos = storages_of(tensor)
        with self._lock:
            for info in infos:
                if info[0] not in self._members[pile]:
                    self._claim(info, pile)

    def claim(
        self,
        pile: PileIndex,
        key: Key,
        nbytes: int,
        dtype: str,
        storage: torch.UntypedStorage,
        tensor: torch.Tensor | None = None,
    ) -> None:
        """Claim one storage for a persistent pile (a fresh gradient's, read by its hook).

        With `tensor` (whose data starts at the storage's), the next `sync` of the pile finds
        it in its cache instead of deriving its storage again.
        """
        with self._lock:
            if key not in self._members[pile]:
                self._claim((key, nbytes, dtype, storage), pile)
        if tensor is not None:
            self._sync_cache[pile][id(tensor)] = key

    def claim_gradient(
        self, key: Key, nbytes: int, dtype: str, storage: torch.UntypedStorage, tensor: torch.Tensor
    ) -> None:
        """`claim(GRADIENTS, ...)` for the gradient hook, whose tensor starts at its storage's
        data (every fresh `.grad`, a new storage no pile holds): one call, the accounting
        inlined. Anything else (a storage already in the ledger, an empty one) takes `claim`.
        """
        with self._lock:
            members = self._members[_GRADIENTS_AT]
            if key in members:
                pass
            elif nbytes <= 0 or key in self._entries:
                self._claim((key, nbytes, dtype, storage), GRADIENTS)
            else:
                # `_claim` of a new storage, with `_new_entry`, `_set_mask` and `_account`
                # inlined (the same steps in the same order; a test replays both).
                pool = self._pool
                if pool:
                    entry = pool.pop()
                    entry.dtype = dtype
                    entry.act_refs = 0
                    entry.module = NO_MODULE
                else:
                    entry = _Entry(nbytes, dtype)
                entry.nbytes = nbytes
                entry.mask = _GRADIENTS_BIT
                entry.pile = _GRADIENTS_AT
                self._entries[key] = entry
                ref = entry.ref = weakref.ref(storage, self._on_freed)
                self._ref_keys[id(ref)] = key
                members.add(key)
                self._membership_changes += 1
                piles = self.piles
                size = piles[_GRADIENTS_AT] + nbytes
                piles[_GRADIENTS_AT] = size
                self._touched |= _GRADIENTS_BIT  # the pile moved: not steady (`steady`)
                dtypes = self._dtypes[_GRADIENTS_AT]
                stat = dtypes.get(dtype)
                if stat is None:
                    stat = dtypes[dtype] = [0, 0]
                stat[0] += nbytes
                stat[1] += 1
                if size > self.max[_GRADIENTS_AT]:
                    self.max[_GRADIENTS_AT] = size
                total = sum(piles)
                if total > self.peak_total:
                    self.peak_total = total
                    self._peak_pending = True
        self._sync_cache[_GRADIENTS_AT][id(tensor)] = key  # an int: nothing for the collector

    def _claim(self, info: StorageInfo, pile: PileIndex) -> None:
        key, nbytes, dtype, storage = info
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._new_entry(nbytes, dtype)
        if entry.ref is None:
            entry.ref = weakref.ref(storage, self._on_freed)
            self._ref_keys[id(entry.ref)] = key
        self._members[pile].add(key)
        self._membership_changes += 1
        self._set_mask(key, entry, entry.mask | _BITS[pile])

    def _clear_bit(self, key: Key, pile: PileIndex) -> None:
        self._members[pile].discard(key)
        self._membership_changes += 1
        entry = self._entries.get(key)
        if entry is not None:
            self._set_mask(key, entry, entry.mask & ~_BITS[pile])

    def _freed(self, ref: weakref.ref[torch.UntypedStorage]) -> None:
        """A claimed storage was deallocated: it leaves every pile. A finalizer: what a signal
        handler raises here goes back to the job (`finalizer_interrupts`)."""
        try:
            self._forget_freed(ref)
        except BaseException as error:
            hand_back(error)

    def _forget_freed(self, ref: weakref.ref[torch.UntypedStorage]) -> None:
        with self._lock:
            key = self._ref_keys.pop(id(ref), None)
            if key is None:
                return
            entry = self._entries.get(key)
            if entry is None or entry.ref is not ref:
                return
            for members in self._members:
                members.discard(key)
            self._membership_changes += 1
            old = entry.pile
            if old in (NO_PILE, _ACTIVATIONS_AT) or entry.nbytes <= 0:
                self._set_mask(key, entry, 0)
                return
            # `_set_mask(key, entry, 0)` for a storage counted in a persistent pile (a freed
            # gradient, every step), with `_account` and `_drop_entry` inlined.
            entry.mask = 0
            entry.pile = NO_PILE
            if self._peak_pending or self._act_max_pending:
                self._settle()
            nbytes = entry.nbytes
            self.piles[old] -= nbytes
            self._touched |= _BITS[old]  # the pile moved: not steady (`steady`)
            dtypes = self._dtypes[old]
            name = entry.dtype
            stat = dtypes.get(name)
            if stat is None:
                stat = dtypes[name] = [0, 0]
            stat[0] -= nbytes
            stat[1] -= 1
            if stat[1] == 0:
                del dtypes[name]
            del self._entries[key]
            entry.ref = None  # its `_ref_keys` item was popped above
            if len(self._pool) < ENTRY_POOL:
                self._pool.append(entry)

    def _new_entry(self, nbytes: int, dtype: str) -> _Entry:
        pool = self._pool
        return pool.pop().reset(nbytes, dtype) if pool else _Entry(nbytes, dtype)

    def _drop_entry(self, key: Key, entry: _Entry) -> None:
        del self._entries[key]
        if entry.ref is not None:
            self._ref_keys.pop(id(entry.ref), None)
            entry.ref = None
        if len(self._pool) < ENTRY_POOL:
            self._pool.append(entry)

    # ----- activations ---------------------------------------------------------------------

    def acquire_activation(self, key: Key, nbytes: int, dtype: str, module: int) -> None:
        """A pack hook saved a tensor on this storage.

        A storage no pile holds yet (most activations) goes straight to the activations pile;
        one already counted elsewhere keeps its pile by precedence.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.act_refs += 1
                if entry.act_refs == 1:
                    entry.module = module
                    self._set_mask(key, entry, entry.mask | ACTIVATION_BIT)
                return
            pool = self._pool
            entry = pool.pop() if pool else _Entry(nbytes, dtype)
            self._entries[key] = entry
            entry.nbytes = nbytes
            entry.dtype = dtype
            entry.act_refs = 1
            entry.module = module
            entry.mask = ACTIVATION_BIT
            entry.pile = _ACTIVATIONS_AT
            if nbytes <= 0:
                self._account(_ACTIVATIONS_AT, entry, nbytes)
                return
            # `_account(ACTIVATIONS, entry, nbytes)` inlined (every saved tensor; a test
            # replays the inlined paths against the general ones).
            piles = self.piles
            size = piles[_ACTIVATIONS_AT] + nbytes
            piles[_ACTIVATIONS_AT] = size
            dtypes = self._dtypes[_ACTIVATIONS_AT]
            stat = dtypes.get(dtype)
            if stat is None:
                stat = dtypes[dtype] = [0, 0]
            stat[0] += nbytes
            stat[1] += 1
            live = self._module_live.get(module, 0) + nbytes
            self._module_live[module] = live
            if live > self._module_max.get(module, 0):
                self._module_max[module] = live
            if size > self.max[_ACTIVATIONS_AT]:
                self.max[_ACTIVATIONS_AT] = size
                self._act_max_pending = True
            total = sum(piles)
            if total > self.peak_total:
                self.peak_total = total
                self._peak_pending = True

    def release_activation(self, key: Key) -> None:
        """A pack wrapper was freed (its graph was released)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.act_refs == 0:
                return
            entry.act_refs -= 1
            if entry.act_refs:
                return
            if entry.mask != ACTIVATION_BIT:
                self._set_mask(key, entry, entry.mask & ~ACTIVATION_BIT)
                return
            # An activation and nothing else: it leaves every pile.
            entry.mask = 0
            entry.pile = NO_PILE
            nbytes = entry.nbytes
            if nbytes <= 0:
                self._account(_ACTIVATIONS_AT, entry, -nbytes)
                self._drop_entry(key, entry)
                return
            # `_account(ACTIVATIONS, entry, -nbytes)` and `_drop_entry` inlined.
            if self._peak_pending or self._act_max_pending:
                self._settle()
            self.piles[_ACTIVATIONS_AT] -= nbytes
            dtypes = self._dtypes[_ACTIVATIONS_AT]
            name = entry.dtype
            stat = dtypes.get(name)
            if stat is None:
                stat = dtypes[name] = [0, 0]
            stat[0] -= nbytes
            stat[1] -= 1
            if stat[1] == 0:
                del dtypes[name]
            module = entry.module
            live = self._module_live.get(module, 0) - nbytes
            self._module_live[module] = live
            if live > self._module_max.get(module, 0):
                self._module_max[module] = live
            del self._entries[key]
            ref = entry.ref
            if ref is not None:
                self._ref_keys.pop(id(ref), None)
                entry.ref = None
            if len(self._pool) < ENTRY_POOL:
                self._pool.append(entry)

    def saved_by_node(self) -> dict[int, list[tuple[Key, int]]]:
        """What the live saved-tensor wrappers hold, by the autograd node each was packed for:
        node sequence number -> `(key, nbytes)` of the storages still counted as activations.

        Read at a census from the agent's own records (`saved_nodes`, `saved_nodes_multi`),
        never from a graph's `_saved_*` attributes (which would unpack, and run the job's
        hooks or a checkpoint's recomputation). A wrapper freed meanwhile may still be listed
        (its `__del__` can run on another thread during the copy); a storage no longer counted
        is left out.
        """
        single: dict[int, int] = {}
        multi: dict[int, tuple[int, tuple[Key, ...]]] = {}
        for _attempt in range(4):
            try:
                single = self.saved_nodes.copy()
                multi = self.saved_nodes_multi.copy()
                break
            except RuntimeError:  # changed size during the copy (a wrapper freed elsewhere)
                continue
        found: dict[int, list[tuple[Key, int]]] = {}
        mask = (1 << NODE_SHIFT) - 1
        with self._lock:
            entries = self._entries
            for packed in single.values():
                key = packed & mask
                entry = entries.get(key)
                if entry is not None and entry.act_refs:
                    node = (packed >> NODE_SHIFT) - 1
                    found.setdefault(node, []).append((key, entry.nbytes))
            for node, keys in multi.values():
                for key in keys:
                    entry = entries.get(key)
                    if entry is not None and entry.act_refs:
                        found.setdefault(node, []).append((key, entry.nbytes))
        return found

    def persistent_keys(self) -> frozenset[Key]:
        """Keys of every storage in weights, gradients or optimizer state now."""
        with self._lock:
            return frozenset().union(*self._members)

    def activation_keys(self) -> frozenset[Key]:
        """Keys of every storage the activations pile holds now (saved by graphs still
        alive); a walk over the ledger's entries, for a census only."""
        with self._lock:
            return frozenset(
                key for key, entry in self._entries.items() if entry.mask & ACTIVATION_BIT
            )

    # ----- the one place where bytes move --------------------------------------------------

    def _set_mask(self, key: Key, entry: _Entry, mask: int) -> None:
        entry.mask = mask
        pile = (mask & -mask).bit_length() - 1 if mask else NO_PILE
        old = entry.pile
        if pile == old:
            return
        nbytes = entry.nbytes
        if old != NO_PILE:
            self._account(old, entry, -nbytes)
        entry.pile = pile
        if pile != NO_PILE:
            self._account(pile, entry, nbytes)
        else:
            self._drop_entry(key, entry)

    def _account(self, pile: int, entry: _Entry, delta: int) -> None:
        if delta < 0 and (self._peak_pending or self._act_max_pending):
            self._settle()
        piles = self.piles
        piles[pile] += delta
        stat = self._dtypes[pile].get(entry.dtype)
        if stat is None:
            stat = self._dtypes[pile][entry.dtype] = [0, 0]
        stat[0] += delta
        stat[1] += 1 if delta > 0 else -1
        if stat[1] == 0:
            del self._dtypes[pile][entry.dtype]
        if pile == _ACTIVATIONS_AT:
            live = self._module_live.get(entry.module, 0) + delta
            self._module_live[entry.module] = live
            if live > self._module_max.get(entry.module, 0):
                self._module_max[entry.module] = live
        else:  # a persistent pile moved: it is not steady in this step (`steady`)
            self._touched |= _BITS[pile]
        if delta > 0:
            if piles[pile] > self.max[pile]:
                self.max[pile] = piles[pile]
                if pile == _ACTIVATIONS_AT:
                    self._act_max_pending = True
            total = sum(piles)
            if total > self.peak_total:
                self.peak_total = total
                self._peak_pending = True
