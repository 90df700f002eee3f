"""The DataLoader workers' side of the agent without a DataLoader: which dataset attribute is
named (`job.data_loaders.large_container`), read without running the job's code; the workers a
`_MultiProcessingDataLoaderIter` started (`DataLoaders.started`); the alert and `Leak` of kind
`workers` (`steps.worker_leaks`); their sampler on this very process (`memory.worker_memory`)."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import time
from types import SimpleNamespace
from typing import Any

import numpy

from memtui_agent.job.data_loaders import MIN_ITEMS, DataLoaders, large_container
from memtui_agent.memory import worker_memory
from memtui_agent.memory.worker_growth import WINDOW
from memtui_agent.memory.worker_memory import (
    SAMPLE_SECONDS,
    SHARE,
    YOUNG_SAMPLES,
    YOUNG_SECONDS,
    YOUNG_SHARE,
    WorkerSampler,
)
from memtui_agent.steps.worker_leaks import FIX, NO_DATASET, WorkerLeaks
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, LeakKind

MiB = 1024 * 1024


class Samples:
    def __init__(self, n: int) -> None:
        self.items = [{"x": [float(i)], "y": i} for i in range(n)]
        self.labels = list(range(10))  # too small to matter


class Wrapper:
    """As torch's `Subset`: the samples one level down."""

    def __init__(self, dataset: object) -> None:
        self.dataset = dataset
        self.indices = list(range(5))


class Concat:
    """As torch's `ConcatDataset`: a short list of datasets."""

    def __init__(self, *datasets: object) -> None:
        self.datasets = list(datasets)


class Arrays:
    def __init__(self, n: int) -> None:
        self.x = numpy.zeros((n, 4), dtype=numpy.float32)


class Booby:
    """Every Python-level access runs the job's code: none may happen."""

    touched = 0

    def __init__(self, n: int) -> None:
        self.records = {index: str(index) for index in range(n)}

    def __getattribute__(self, name: str) -> Any:
        Booby.touched += 1
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str) -> Any:
        Booby.touched += 1
        raise AttributeError(name)


def test_the_largest_python_container_is_named_by_its_path_from_dataset() -> None:
    found = large_container(Samples(MIN_ITEMS + 5))
    assert found is not None
    assert (found.path, found.kind, found.items, found.item_type, found.owner) == (
        "dataset.items",
        "list",
        MIN_ITEMS + 5,
        "dict",
        "Samples",
    )


def test_nested_datasets_are_looked_into() -> None:
    inner = large_container(Wrapper(Samples(MIN_ITEMS)))
    assert inner is not None and inner.path == "dataset.dataset.items"
    mixed = large_container(Concat(Arrays(10), Samples(MIN_ITEMS * 2)))
    assert mixed is not None and mixed.path == "dataset.datasets[1].items"


def test_arrays_and_small_containers_are_not_named() -> None:
    assert large_container(Arrays(100_000)) is None
    assert large_container(Samples(MIN_ITEMS - 1)) is None
    assert large_container(None) is None


def test_the_finder_runs_none_of_the_datasets_code() -> None:
    dataset = Booby(MIN_ITEMS)
    Booby.touched = 0
    found = large_container(dataset)
    assert Booby.touched == 0
    assert found is not None and (found.path, found.kind, found.item_type) == (
        "dataset.records",
        "dict",
        "str",
    )


class FakeSampler(WorkerSampler):
    """A sampler whose samples the test writes (no thread, no psutil)."""

    def __init__(self) -> None:
        super().__init__(lambda exc: None)
        self.added: list[int] = []

    def add(self, pids: Any) -> None:
        self.added.extend(pids)


class Iterator:
    """As `_MultiProcessingDataLoaderIter` once its `__init__` returned."""

    def __init__(self, **attributes: object) -> None:
        self.__dict__.update(attributes)


def _iterator(dataset: object, pids: list[int]) -> Iterator:
    workers = []
    for pid in pids:
        process = multiprocessing.Process()
        process._popen = SimpleNamespace(pid=pid)  # type: ignore[attr-defined]
        workers.append(process)
    return Iterator(_workers=workers, _dataset=dataset)


def _grow(leaks: WorkerLeaks, sampler: FakeSampler, steps: range, per_sample: int) -> list[Any]:
    reports = []
    for index, step in enumerate(steps):
        sampler.samples = index + 1
        growth = index * per_sample
        sampler.latest = schema.Workers(count=2, uss=per_sample + growth, growth=growth)
        sampler.grown = {11: index * per_sample // 2, 12: index * per_sample // 2}
        reports.append(leaks.at_close(step))
    return reports


def test_growing_workers_name_the_dataset_attribute_once_with_the_fix() -> None:
    sampler = FakeSampler()
    loaders = DataLoaders(sampler)
    dataset = Samples(MIN_ITEMS * 3)
    loaders.started(_iterator(dataset, [11, 12]))
    assert sampler.added == [11, 12]
    leaks = WorkerLeaks(loaders)
    reports = _grow(leaks, sampler, range(10, 10 + 10 * (WINDOW + 4), 10), 8 * MiB)
    alerts = [alert for report in reports for alert in report.alerts]
    assert len(alerts) == 1
    alert = alerts[0]
    assert alert.kind == AlertKind.LEAK and alert.where == "dataset.items"
    assert "2 DataLoader workers (pids 11, 12) grew" in alert.message
    assert "a list of 3,000 dict objects in Samples" in alert.message
    assert alert.message.endswith(FIX)
    named = [leak for report in reports for leak in report.leaks]
    assert named[0].kind == LeakKind.WORKERS and named[0].holder == "dataset.items"
    assert named[0].first_step == 10 and named[0].tensors == 0
    assert named[0].bytes == WINDOW * 8 * MiB
    assert all(report.workers is not None for report in reports)
    final = leaks.final()
    assert [(leak.holder, leak.bytes) for leak in final] == [
        ("dataset.items", (WINDOW + 3) * 8 * MiB)
    ]


def test_flat_workers_raise_nothing() -> None:
    sampler = FakeSampler()
    loaders = DataLoaders(sampler)
    loaders.started(_iterator(Arrays(10), [21, 22]))
    leaks = WorkerLeaks(loaders)
    reports = _grow(leaks, sampler, range(1, 200, 10), 100 * 1024)
    assert not any(report.alerts or report.leaks for report in reports)
    assert leaks.final() == []


def test_a_dataset_gone_is_said_so() -> None:
    sampler = FakeSampler()
    loaders = DataLoaders(sampler)
    loaders.started(_iterator(Samples(MIN_ITEMS), [31, 32]))  # dropped at once
    reports = _grow(WorkerLeaks(loaders), sampler, range(1, 200, 10), 8 * MiB)
    alerts = [alert for report in reports for alert in report.alerts]
    assert [alert.where for alert in alerts] == [NO_DATASET]


def test_an_iterator_without_workers_is_ignored() -> None:
    sampler = FakeSampler()
    loaders = DataLoaders(sampler)
    loaders.started(Iterator(_workers=[], _dataset=None))
    loaders.started(Iterator(_dataset=None))
    assert sampler.added == []


def test_the_sampler_reads_a_live_process_and_forgets_a_gone_one() -> None:
    errors: list[BaseException] = []
    sampler = WorkerSampler(errors.append, period=3600)
    try:
        sampler.add([os.getpid(), 2**22 + 7])  # this process; a pid above Linux's limit
        deadline = time.monotonic() + 30
        while sampler.samples == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        sampler.close()
    assert errors == []
    latest = sampler.latest
    assert latest is not None and latest.count == 1 and latest.uss > 0
    assert latest.pss is not None and latest.pss > 0
    assert list(sampler.grown) == [os.getpid()]  # the gone pid is not followed
    assert sampler.grown[os.getpid()] == 0  # no close yet: no baseline, no growth
    sampler.note_close()
    sampler.sample()  # the baseline: the first sample after a close
    assert sampler.grown == {os.getpid(): 0}
    # New pages of this process's own, written: an anonymous mapping, never heap the process
    # freed earlier and still holds (a bytearray could reuse it: no growth, seen in CI).
    held = mmap.mmap(-1, 32 * 1024 * 1024)
    for offset in range(0, len(held), mmap.PAGESIZE):
        held[offset] = 1
    sampler.sample()
    assert sampler.grown[os.getpid()] >= 30 * 1024 * 1024
    held.close()


def test_the_sampler_spaces_its_samples_to_its_share_of_a_core() -> None:
    """A young worker is sampled every 0.25 s, an older one every second, unless a sample's CPU
    time would make that more than 10 % (young) or 2 % of a core."""
    sampler = WorkerSampler(lambda exc: None)
    sampler._workers[1] = worker_memory._Worker(None)
    assert sampler.next_wait() == YOUNG_SECONDS
    sampler.cost = 0.05  # 50 ms of CPU a sample: a few workers of a large job
    assert sampler.next_wait() == 0.05 / YOUNG_SHARE
    sampler._workers[1].samples = YOUNG_SAMPLES
    assert sampler.next_wait() == 0.05 / SHARE
    sampler.cost = 0.001
    assert sampler.next_wait() == SAMPLE_SECONDS
