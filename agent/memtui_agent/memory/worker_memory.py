"""The private memory of the job's DataLoader workers, sampled by a thread of its own.

A DataLoader with `num_workers > 0` forks worker processes that share the parent's pages until
one of them writes to a page: then that page is copied into the worker (copy on write). Reading
a Python object writes its reference count, so a worker that reads a dataset held as Python
objects (a list of dicts of floats) copies the pages it reads, one by one, as the epoch goes on.
None of it is in the job's process: its piles and its RSS stay flat while the workers grow.

`WorkerSampler` follows the workers it is given (`add`, by pid: `job.data_loaders` finds them as
a DataLoader starts them) with psutil's `memory_full_info()`: USS (the pages only that worker
holds, what its exit would free) and PSS (shared pages split among their sharers) from
`/proc/PID/smaps_rollup`, a walk of the worker's page tables in the kernel (9 ms of CPU for a
worker of a 430 MB job). That read happens on this module's thread, once a second (four times
a second for a worker's first 20 samples), spaced further where it would take more than 2 % of
a core (10 % while young), never on the training thread: a close only takes the last
sample (`latest`, one attribute read). The thread starts with the first worker (a job without
workers has none) and holds pids and psutil handles only, never a job object.

Bounded: at most `MAX_WORKERS` workers followed at once; a worker that exited is forgotten.
An error ends the sampling and is reported once (`on_error`); the job goes on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import psutil

from memtui_protocol import schema

SAMPLE_SECONDS = 1.0
"""How often the workers are sampled: their memory moves with the pages they read, over
seconds; a faster rate would only cost more reads of smaps_rollup."""
YOUNG_SECONDS = 0.25
YOUNG_SAMPLES = 20
"""A worker's first samples come this often: a shuffled epoch copies most of a dataset's pages
in its first seconds (two workers of tests/fixtures/workers/dataset_workers.py: +120 MiB in 4 s,
which one sample a second sees as 4 points, too few to tell a sustained growth)."""
SHARE = 0.02
YOUNG_SHARE = 0.1
"""The most of one core the sampler's thread may use, once its workers are past their first
samples and while they are young: the next sample waits at least its last sample's CPU time
divided by this. Reading smaps_rollup walks the worker's page tables in the kernel: 9 ms of CPU
a read for a worker of a 430 MB job (the fixture's, measured with `time.thread_time()`), more for
a larger one, where the samples space out instead of the thread taking a core."""
MAX_WORKERS = 256
"""The most worker processes followed at once (a job runs a few per DataLoader)."""


class _Worker:
    """One followed worker: its psutil handle (which checks the pid was not reused), the close
    count when it was added, and its private memory at its baseline sample, from which its
    growth is counted."""

    __slots__ = ("added", "first", "process", "samples")

    def __init__(self, process: Any, added: int = 0) -> None:
        self.process = process
        self.added = added
        self.first: int | None = None
        self.samples = 0


class WorkerSampler:
    """Samples the followed workers' memory about once a second, on its own thread."""

    def __init__(
        self, on_error: Callable[[BaseException], None], period: float = SAMPLE_SECONDS
    ) -> None:
        self._on_error = on_error
        self._period = period
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._pending: list[tuple[int, int]] = []
        self._workers: dict[int, _Worker] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.latest: schema.Workers | None = None
        """The last sample (None before the first, and once no worker is left)."""
        self.samples = 0
        """Samples taken so far: a close tells a new sample from the one it already saw."""
        self.cost = 0.0
        """CPU seconds the last sample took on this thread (`SHARE` spaces the next one)."""
        self.closes = 0
        """Step closes so far (`note_close`): a worker's baseline is its first sample after the
        first close that followed its start."""
        self.grown: dict[int, int] = {}
        """Each worker's growth since its baseline sample, by pid, as of the last sample (0
        before its baseline)."""

    def add(self, pids: Iterable[int]) -> None:
        """Follow these workers from now (called as a DataLoader starts them; cheap: the
        thread reads them, at once). Ignored in any process but the one that made this
        sampler (a forked worker that builds a DataLoader of its own has no thread)."""
        if os.getpid() != self._owner or self._stopping:
            return
        with self._lock:
            room = MAX_WORKERS - len(self._workers) - len(self._pending)
            closes = self.closes
            self._pending.extend((pid, closes) for pid in list(pids)[: max(0, room)])
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="memtui-workers", daemon=True)
            self._thread.start()
        self._wake.set()

    def note_close(self) -> None:
        """A step closed (on the training thread; one increment). Workers started before it
        have delivered a batch, so they are past their start: a worker started by spawn or a
        forkserver imports torch and the job's modules first (tens to hundreds of MiB that are
        no copy of the job's pages), which its baseline must not count as growth."""
        self.closes += 1

    def close(self, timeout: float = 1.0) -> None:
        """Stop sampling (the agent leaves)."""
        self._stopping = True
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    # ----- the sampler's thread -------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                started = time.thread_time()
                self.sample()
                self.cost = time.thread_time() - started
            except Exception as exc:  # never a traceback into the job: said once, then off
                self._stopping = True
                self.latest = None
                self._on_error(exc)
                return
            self._wake.wait(self.next_wait())
            self._wake.clear()

    def next_wait(self) -> float:
        """Seconds to the next sample: sooner while a followed worker is young, never so soon
        that sampling takes more than its share of a core."""
        young = any(worker.samples < YOUNG_SAMPLES for worker in self._workers.values())
        if young:
            return max(min(self._period, YOUNG_SECONDS), self.cost / YOUNG_SHARE)
        return max(self._period, self.cost / SHARE)

    def sample(self) -> None:
        """One sample of every followed worker (the thread's loop; tests call it directly)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for pid, added in pending:
            if pid in self._workers:
                continue
            try:
                self._workers[pid] = _Worker(psutil.Process(pid), added)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue  # it exited before its first sample
        count = uss = growth = pss = 0
        pss_known = True
        grown = {}
        for pid, worker in list(self._workers.items()):
            try:
                memory = worker.process.memory_full_info()
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                del self._workers[pid]  # exited (an epoch's workers end with it)
                continue
            private = int(memory.uss)
            if worker.first is None and self.closes > worker.added:
                worker.first = private
            worker.samples += 1
            count += 1
            uss += private
            grown[pid] = private - worker.first if worker.first is not None else 0
            growth += grown[pid]
            shared = getattr(memory, "pss", None)
            if shared is None:
                pss_known = False
            else:
                pss += int(shared)
        self.grown = grown
        self.samples += 1
        self.latest = (
            schema.Workers(
                count=count,
                uss=uss,
                growth=growth,
                pss=pss if pss_known else None,
                sampled=round(time.time(), 3),
            )
            if count
            else None
        )
