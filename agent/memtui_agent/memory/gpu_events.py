"""The CUDA out-of-memory observer (and the memory snapshot dumped on an OOM), apart from the
step close that reads it."""

from __future__ import annotations

import os
from typing import Any


class GpuEvents:
    """The CUDA out-of-memory observer, attached once CUDA is in use (attaching earlier would
    create a context the job did not ask for). It keeps the failing request and the free memory
    for the `End` frame; with a snapshot path it also dumps a PyTorch memory snapshot."""

    def __init__(self, snapshot_path: str | None = None) -> None:
        self.snapshot_path = snapshot_path
        self.history_owner: Any = None
        """`--alloc-events`' recorder, which records the history (frees included) itself."""
        self.last_oom: dict[str, int] | None = None
        self._attached = False

    def ensure_attached(self) -> int | None:
        """Attach the observer if not yet done; the current CUDA device index."""
        import torch

        index = torch.cuda.current_device()
        if not self._attached:
            self._attached = True
            attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
            if attach is not None:
                attach(self.observe)
            owner = self.history_owner
            if self.snapshot_path is not None and (owner is None or owner.off):
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        return index

    def observe(self, device: int, requested: int, allocated: int, free: int) -> None:
        """Called by the allocator when an allocation fails (before the exception)."""
        self.last_oom = {
            "device": int(device),
            "requested": int(requested),
            "allocated": int(allocated),
            "free": int(free),
        }
        if self.snapshot_path is not None:
            try:
                self._dump_snapshot(self.snapshot_path)
            except Exception:
                pass

    @staticmethod
    def _dump_snapshot(path: str) -> None:
        """What `torch.cuda.memory._dump_snapshot` writes, created the safe way (its `open()`
        would follow a link planted at the name: memtui_protocol.safe_open)."""
        import pickle

        import torch

        from memtui_protocol.safe_open import Replace, create_private

        snapshot = torch.cuda.memory._snapshot()
        # A snapshot is torch's pickle, with nothing of memtui's in it to prove who wrote it:
        # an earlier run's (a regular file of ours beside the recording) is replaced, as before.
        with os.fdopen(create_private(path, replaces=Replace.OWN_FILE), "wb") as handle:
            pickle.dump(snapshot, handle)
