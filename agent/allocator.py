"""Device allocator counters read at step close.

`torch.cuda.memory_stats()` returns `{}` on a CPU build without raising, so everything is guarded
by `torch.cuda.is_available()`; on CPU every counter is None (shown as "not applicable", never as
zero). Reading these counters is host-side bookkeeping in the caching allocator: no device sync.
"""

from __future__ import annotations

from typing import Any

from memtui_agent.schema import Allocator


def allocator_from_stats(stats: dict[str, Any]) -> Allocator:
    """Build the frame's counters from a `torch.cuda.memory_stats()` dictionary."""
    if not stats:
        return Allocator()
    return Allocator(
        allocated=stats.get("allocated_bytes.all.current"),
        reserved=stats.get("reserved_bytes.all.current"),
        peak_allocated=stats.get("allocated_bytes.all.peak"),
    )


def read_allocator(device: int | None = None) -> Allocator:
    """Counters of the current CUDA device, or an all-None record where there is no GPU."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return Allocator()
    return allocator_from_stats(torch.cuda.memory_stats(device))
