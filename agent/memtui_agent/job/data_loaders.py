"""The job's DataLoader workers: which child processes they are, and what dataset they read.

**Which children are DataLoader workers.** torch gives its workers no name of their own: a
worker is a `multiprocessing` process (`Process-N` inside the parent only) running
`torch.utils.data._utils.worker._worker_loop`, and what marks it as a worker
(`torch.utils.data.get_worker_info()`) exists only inside the worker. So the rule is where they
are made: `_MultiProcessingDataLoaderIter.__init__` (every DataLoader with `num_workers > 0`
builds one per epoch, or once with `persistent_workers=True`) starts them and keeps them in its
`_workers` list. The agent wraps that `__init__` (`hooks.library_wrappers.DataLoaderWrappers`);
once it returns, `DataLoaders.started` reads the pids of the processes in `_workers` and the
iterator's `_dataset`, and hands the pids to the sampler (`memory.worker_memory`). Any other child
(a compile worker, a process the job starts itself) is not followed. Workers started before the
agent (a persistent DataLoader of a job `memtui attach` joined) are not seen.

**What they read.** A worker copies the pages of the Python objects it reads (their reference
counts are written after fork), so the usual cause of workers growing is a dataset attribute that
is a large Python container: `self.items = [dict(...), ...]`. `large_container` finds it by
reading the dataset's attributes without running any of the job's code (`memory.object_access`:
instance dicts through their C descriptors, lengths through the builtin's C `__len__`), through
nested datasets (`Subset.dataset`, `ConcatDataset.datasets`) a few levels deep, bounded.

Nothing here holds a job object strongly: datasets are held by weak reference (or not at all,
for a dataset that cannot be weakly referenced: then no holder is named).
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from memtui_agent.memory.object_access import (
    TypeFacts,
    attributes,
    container_base,
    container_length,
    derives,
    heap_type,
    type_name,
)
from memtui_agent.memory.worker_memory import WorkerSampler

MIN_ITEMS = 1000
"""A container with fewer items is not what makes workers grow by megabytes."""
MAX_DEPTH = 3
"""Nested datasets looked into (`dataset.dataset.items` is depth 2)."""
MAX_VISITS = 256
"""Objects one search reads at most."""
MAX_NESTED = 8
"""Items of a small list of datasets (`ConcatDataset.datasets`) looked into."""
MAX_LOADERS = 32
"""DataLoader iterators remembered (the newest; each epoch of a non-persistent one is one)."""
DATASET = "dataset"
"""The root of a holder's path: the DataLoader's own attribute name for what it reads."""
_PID: Any = BaseProcess.__dict__["pid"].fget
"""multiprocessing's own `pid` getter (the standard library's, never a subclass's override)."""


@dataclass(frozen=True)
class Container:
    """A large Python container among a dataset's attributes."""

    path: str
    """From the DataLoader's `dataset`: `dataset.items`, `dataset.dataset.samples`."""
    kind: str
    """The builtin it is (`list`, `dict`, `tuple`...)."""
    items: int
    item_type: str | None
    """The class of its first item (`dict`, `str`); None for an empty or unreadable one."""
    owner: str
    """The class of the dataset object that holds it (`DS`)."""


class _Started:
    """One DataLoader iterator's workers and a weak reference to its dataset."""

    __slots__ = ("dataset", "pids")

    def __init__(self, pids: tuple[int, ...], dataset: weakref.ref[Any] | None) -> None:
        self.pids = pids
        self.dataset = dataset


class DataLoaders:
    """The DataLoader iterators that started workers: pids to the sampler, datasets kept
    weakly for the alert."""

    def __init__(self, sampler: WorkerSampler) -> None:
        self.sampler = sampler
        self._started: deque[_Started] = deque(maxlen=MAX_LOADERS)
        self._owner = os.getpid()

    def started(self, iterator: Any) -> None:
        """A `_MultiProcessingDataLoaderIter` finished its `__init__`: its workers run."""
        if os.getpid() != self._owner:
            return  # a worker that builds a DataLoader of its own: not the job's process
        facts = TypeFacts(type(iterator))
        found = dict(attributes(iterator, facts))
        workers = found.get("_workers")
        if type(workers) is not list:
            return
        pids = []
        for process in list.__iter__(workers):
            if derives(type(process), BaseProcess):
                pid = _PID(process)
                if type(pid) is int:
                    pids.append(pid)
        if not pids:
            return
        dataset = found.get("_dataset")
        try:
            reference: weakref.ref[Any] | None = weakref.ref(dataset)
        except TypeError:  # a dataset without weak references (`__slots__`): not named
            reference = None
        self._started.append(_Started(tuple(pids), reference))
        self.sampler.add(pids)

    def dataset_of(self, grown: dict[int, int]) -> Any | None:
        """The dataset read by the workers that grew most (`grown`: growth by pid), if it is
        still alive; the caller drops it once it has read it."""
        best: tuple[int, weakref.ref[Any]] | None = None
        for started in self._started:
            if started.dataset is None:
                continue
            total = sum(grown.get(pid, 0) for pid in started.pids)
            if best is None or total > best[0]:
                best = (total, started.dataset)
        return best[1]() if best is not None else None


def large_container(dataset: Any) -> Container | None:
    """The dataset attribute that is the largest Python container (by items), at least
    `MIN_ITEMS` long; None when there is none (a dataset held in a numpy array or a tensor)."""
    best: Container | None = None
    visits = 0
    queue: deque[tuple[str, Any, int]] = deque([(DATASET, dataset, 0)])
    seen: set[int] = set()
    while queue and visits < MAX_VISITS:
        path, owner, depth = queue.popleft()
        if id(owner) in seen:
            continue
        seen.add(id(owner))
        visits += 1
        cls = type(owner)
        if not heap_type(cls) or container_base(cls) is not None:
            continue
        for name, value in attributes(owner, TypeFacts(cls)):
            visits += 1
            kind = type(value)
            base = container_base(kind)
            where = f"{path}.{name}"
            if base is None:
                if heap_type(kind) and depth + 1 < MAX_DEPTH:
                    queue.append((where, value, depth + 1))
                continue
            items = container_length(value, base)
            if items >= MIN_ITEMS:
                if best is None or items > best.items:
                    best = Container(
                        where, type_name(base), items, _first_type(value, base), type_name(cls)
                    )
            elif base in (list, tuple) and depth + 1 < MAX_DEPTH:
                for index in range(min(items, MAX_NESTED)):
                    item = base.__getitem__(value, index)
                    if heap_type(type(item)) and container_base(type(item)) is None:
                        queue.append((f"{where}[{index}]", item, depth + 1))
    return best


def _first_type(value: Any, base: type) -> str | None:
    """The class of a container's first item, read through the builtin's C methods."""
    try:
        if base is dict:
            for item in dict.values(value):
                return type_name(type(item))
            return None
        if base in (list, tuple):
            if not base.__len__(value):
                return None
            return type_name(type(base.__getitem__(value, 0)))
    except Exception:  # a container changed under the read: no item type
        return None
    return None
