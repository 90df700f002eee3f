"""The step's peak: one definition for every view (the TUI, `memtui report`, `memtui cluster`,
the end-of-run summary and the Prometheus metrics), so no two of them state different peaks
for the same step.

The peak is what the job held at the moment its tracked total was highest: the four piles at
that moment (each storage counted once, docs/numbers.md) plus the memory data-parallel wrappers
hold outside the piles, which is real memory of the job: DDP's gradient buckets (the part no
pile counts: with `gradient_as_bucket_view=True` the gradients are the buckets) and FSDP's
gathered parameters (their high in the step). It is never the allocator's figure (GPU only,
`Allocator.peak_allocated`), which also holds what memtui does not track.

Standard library only (with the schema): the agent's exporter and the viewer import it.
"""

from __future__ import annotations

from memtui_protocol.schema import Distributed, Piles

PEAK_WORDS = "piles + DDP/FSDP buffers"
"""What the peak includes, in the few words each view puts beside it."""
PEAK_LABEL = "peak (+DDP/FSDP)"
"""The same, where a narrow column has room for only this (the TUI's piles panel)."""


def peak_total(piles_at_peak: Piles, wrapped: Distributed | None) -> int | None:
    """The step's peak (see the module): None when any pile at the peak is not known (a sum
    without it is not the peak)."""
    tracked = piles_at_peak.total
    if tracked is None:
        return None
    return tracked + (wrapped.untracked() if wrapped is not None else 0)


def other_at_peak(
    piles_at_peak: Piles, wrapped: Distributed | None, peak_allocated: int | None
) -> int | None:
    """What the allocator held at its peak beyond the peak (the piles bar's "other": temporaries,
    workspaces, inputs, caches); GPU only. None where it is not known: no allocator figure (a
    CPU job) or a pile at the peak not known."""
    tracked = piles_at_peak.total
    if peak_allocated is None or tracked is None:
        return None
    untracked = wrapped.untracked() if wrapped is not None else 0
    return max(0, peak_allocated - tracked - untracked)


__all__ = ["PEAK_LABEL", "PEAK_WORDS", "other_at_peak", "peak_total"]
