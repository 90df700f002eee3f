"""The CUDA caching allocator's own counters, per step, from `torch.cuda.memory_stats()`.

`memory_stats()` returns `{}` on a CPU build without raising, so everything is guarded by
`torch.cuda.is_available()` and `is_initialized()` (the agent never creates a CUDA context itself);
on CPU every counter is None, shown as "not applicable", never as zero. Reading the counters is
host-side bookkeeping in the allocator: no device sync.

Peaks: by default the allocator's peak counters are never reset, so a job that reads
`torch.cuda.max_memory_allocated()` itself keeps its meaning. The step's peak is then exact when
the step set a new high (`peak_exact`), and otherwise only bounded by the running peak. With
`reset_peaks` the counters are reset at every step and phase boundary, which gives exact per-step
and per-phase peaks and takes the job's own peak readings away: opt-in.
"""

from __future__ import annotations

from typing import Any

from memtui_protocol.schema import Allocator, Phase

CUMULATIVE = {
    "allocations": "allocation.all.allocated",
    "frees": "allocation.all.freed",
    "alloc_bytes": "allocated_bytes.all.allocated",
    "freed_bytes": "allocated_bytes.all.freed",
    "segment_allocs": "segment.all.allocated",
    "segment_frees": "segment.all.freed",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}
"""Counters that only grow: a step reports the difference since the previous close."""


def allocator_from_stats(
    stats: dict[str, Any],
    previous: dict[str, Any] | None = None,
    phase_peaks: dict[str, int] | None = None,
    peaks_reset: bool = False,
) -> Allocator:
    """Build a step's counters from a `torch.cuda.memory_stats()` dictionary.

    Args:
        stats: the dictionary at step close (flat keys such as "allocated_bytes.all.current").
        previous: the dictionary at the previous close, for per-step deltas and peak exactness.
        phase_peaks: peak allocated bytes per phase, when peaks are reset at phase boundaries.
        peaks_reset: whether the peak counters were reset at the start of this step.
    """
    if not stats:
        return Allocator()
    peak = stats.get("allocated_bytes.all.peak")
    previous_peak = previous.get("allocated_bytes.all.peak") if previous else None
    exact = (
        peaks_reset
        or previous is None
        or (peak is not None and previous_peak is not None and peak > previous_peak)
    )
    deltas = {}
    for field, key in CUMULATIVE.items():
        now = stats.get(key)
        before = previous.get(key, 0) if previous else 0
        deltas[field] = now - before if now is not None else None
    return Allocator(
        allocated=stats.get("allocated_bytes.all.current"),
        reserved=stats.get("reserved_bytes.all.current"),
        peak_allocated=peak,
        active=stats.get("active_bytes.all.current"),
        peak_reserved=stats.get("reserved_bytes.all.peak"),
        inactive_split=stats.get("inactive_split_bytes.all.current"),
        peak_exact=bool(exact),
        phase_peaks=dict(phase_peaks) if phase_peaks else None,
        **deltas,
    )


class AllocatorReader:
    """Reads the counters at step close and keeps what the next step's deltas need."""

    def __init__(self, reset_peaks: bool = False) -> None:
        self.reset_peaks = reset_peaks
        self._previous: dict[str, Any] | None = None
        self._phase_peaks: dict[str, int] = {}
        """Peak allocated bytes per `Phase` of the step (with `reset_peaks`)."""

    @staticmethod
    def active() -> bool:
        """Whether a CUDA allocator is in use in this process (never initialises CUDA)."""
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_initialized())

    def phase_ended(self, phase: Phase) -> None:
        """With `reset_peaks`: note the peak of the phase that just ended, reset for the next."""
        if not self.reset_peaks or not self.active():
            return
        import torch

        self._phase_peaks[phase] = max(
            self._phase_peaks.get(phase, 0), int(torch.cuda.max_memory_allocated())
        )
        torch.cuda.reset_peak_memory_stats()

    def read(self) -> Allocator:
        """Counters for the step that is closing."""
        if not self.active():
            return Allocator()
        import torch

        stats = dict(torch.cuda.memory_stats())
        allocator = allocator_from_stats(
            stats, self._previous, self._phase_peaks or None, self.reset_peaks
        )
        self._previous = stats
        self._phase_peaks = {}
        if self.reset_peaks:
            torch.cuda.reset_peak_memory_stats()
        return allocator


def expandable_segments_enabled(environ: dict[str, str]) -> bool:
    """Whether the allocator was configured with `expandable_segments:True`."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for option in environ.get(name, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


def expandable_at_start(device: str, environ: dict[str, str]) -> bool | None:
    """The hello's `expandable_segments`: whether the allocator's configuration in the
    environment turned it on, for a job that can use CUDA; None (not known, and meaningless)
    where torch sees no CUDA device."""
    return expandable_segments_enabled(environ) if device == "cuda" else None


def fragmentation_message(
    allocator: Allocator, expandable: bool, min_bytes: int = 1 << 30, min_share: float = 0.2
) -> str | None:
    """An alert when the cache holds a lot of memory it cannot hand out while allocations retry.

    Large reserved-minus-allocated alone is not a problem (it is the cache); together with
    allocation retries in the step it means requests failed to fit into the cached blocks.
    """
    if allocator.allocated is None or allocator.reserved is None:
        return None
    cached = allocator.reserved - allocator.allocated
    if not allocator.alloc_retries or cached < min_bytes or cached < min_share * allocator.reserved:
        return None
    from memtui_protocol.units import format_bytes

    message = (
        f"{format_bytes(cached)} reserved but not allocated "
        f"({cached / allocator.reserved:.0%} of reserved) while {allocator.alloc_retries} "
        "allocation(s) had to free the cache and retry: fragmentation"
    )
    if expandable:
        return message + "; expandable_segments is already on: reduce peak or batch size"
    return message + (
        "; try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so segments can grow in place"
    )
