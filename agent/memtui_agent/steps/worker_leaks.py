"""DataLoader workers whose private memory grows: the alert, the `Leak` entry, the frame's figure.

At each close the last sample of the workers (`memory.worker_memory`) goes into the frame as it
is (`Step.workers`) and to the growth rule (`memory.worker_growth`). The first time the rule finds
the growth sustained, the close names what the workers read: the dataset attribute that is a
large Python container (`job.data_loaders.large_container`, read without running the job's
code), and says it once, as a `leak` alert, with a `Leak` of kind `workers` (`holder`: that
attribute; `bytes`: the workers' growth, psutil's USS). The entry is sent again when the growth
has risen by a tenth since it was last sent (so the frames follow it in a few entries), and
once more as the job ends (`End.leaks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from memtui_agent.job.data_loaders import Container, DataLoaders, large_container
from memtui_agent.memory.worker_growth import Sustained, WorkerGrowth
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, LeakKind
from memtui_protocol.units import format_bytes

FIX = (
    "keep the samples in one numpy array or tensor (or Arrow; strings packed as bytes in one "
    "array) instead of Python objects: each worker copies the pages of the objects it reads, "
    "their reference counts written after fork"
)
"""The fix the alert and the `Leak` carry."""
NO_DATASET = "DataLoader workers"
"""The holder named when the workers' dataset is gone or cannot be referred to weakly."""
PIDS_SHOWN = 8
"""Worker pids the alert names (their count says how many there are)."""
RESEND = 1.1
"""The entry is sent again once the growth reached this many times what was last sent."""


@dataclass
class WorkerReport:
    """What a close adds to its frame about the workers."""

    workers: schema.Workers | None = None
    alerts: list[schema.Alert] = field(default_factory=list)
    leaks: list[schema.Leak] = field(default_factory=list)


class WorkerLeaks:
    """Follows the workers' growth close after close and names it once."""

    def __init__(self, loaders: DataLoaders) -> None:
        self.loaders = loaders
        self._growth = WorkerGrowth()
        self._named: schema.Leak | None = None

    def at_close(self, step: int) -> WorkerReport:
        """One close: the workers' last sample, and the alert and entry their growth calls
        for. Cheap: attribute reads, and one bounded read of the dataset when first named."""
        sampler = self.loaders.sampler
        sampler.note_close()
        samples, reading = sampler.samples, sampler.latest
        report = WorkerReport(workers=reading)
        found = self._growth.at_close(step, samples, reading)
        if found is None or reading is None:
            return report
        named = self._named
        if named is None:
            grown = sampler.grown
            leak, container = self._name(found, grown)
            report.alerts.append(worker_alert(leak, sorted(grown), container))
        elif self._growth.highest >= named.bytes * RESEND:
            leak = msgspec.structs.replace(
                named, bytes=self._growth.highest, per_step=found.per_step
            )
        else:
            return report
        self._named = leak
        report.leaks.append(leak)
        return report

    def final(self) -> list[schema.Leak]:
        """The named growth as the job ends: the highest the workers reached."""
        named = self._named
        if named is None:
            return []
        return [msgspec.structs.replace(named, bytes=max(named.bytes, self._growth.highest))]

    def _name(
        self, found: Sustained, grown: dict[int, int]
    ) -> tuple[schema.Leak, Container | None]:
        dataset = self.loaders.dataset_of(grown)
        container = large_container(dataset) if dataset is not None else None
        del dataset  # not kept past this read
        holder = container.path if container is not None else NO_DATASET
        leak = schema.Leak(
            holder=holder,
            kind=LeakKind.WORKERS.value,
            bytes=max(found.growth, self._growth.highest),
            tensors=0,
            per_step=found.per_step,
            first_step=found.since,
            fix=FIX,
        )
        return leak, container


def worker_alert(leak: schema.Leak, pids: list[int], container: Container | None) -> schema.Alert:
    """The alert: which workers (their pids), how much they grew and since when, what they
    read, the fix."""
    plural = "s" if len(pids) != 1 else ""
    shown = ", ".join(str(pid) for pid in pids[:PIDS_SHOWN])
    shown += ", ..." if len(pids) > PIDS_SHOWN else ""
    message = (
        f"{len(pids)} DataLoader worker{plural} (pid{plural} {shown}) grew "
        f"{format_bytes(leak.bytes)} of private memory (USS) since step {leak.first_step}, "
        f"{format_bytes(leak.per_step)} per step"
    )
    if container is not None:
        items = f"{container.items:,} {container.item_type} objects" if container.item_type else ""
        message += (
            f", reading {container.path} (a {container.kind} of {items or 'items'} in "
            f"{container.owner})"
        )
    else:
        message += ", and no attribute of their dataset is a large Python container memtui can see"
    message += f": {leak.fix}"
    return schema.Alert(kind=AlertKind.LEAK, message=message, where=leak.holder)
