"""`--alloc-events`: the CUDA allocator's history ring, turned into a small summary per step.

With the flag, recording starts the moment the job itself initialises CUDA (a callback queued
with `torch.cuda._lazy_call`, so the agent never creates a context; where that hook is missing,
at the first step close that finds CUDA in use): `torch.cuda.memory._record_memory_history`
with Python stacks, stacks for allocations only (`context="alloc"`), free events skipped where
the build can skip them (`skip_actions`), and a bounded ring of `MAX_ENTRIES` entries.

At each step close the ring is read with `torch.cuda.memory._snapshot()` and only the entries
newer than the previous read are kept (by `time_us`, with the count of entries sharing the last
microsecond; formats without `time_us` use the "snapshot" entry each read leaves in the ring).
Entries that fell off the bounded ring are counted from the allocator's own allocation counter
(`lost`), and a ring that wrapped past the previous read is flagged (`overflowed`). The summary
(`schema.AllocEvents`, built by `alloc_trace.py`, which needs no torch) keeps the largest
allocations and the segment growth with the innermost source line outside torch and the agent,
folded by size and line, plus the out-of-memory event.

Cost, and why it is read this way (decided by reading torch's source; the GPU cost itself is
measured by `benchmarks/gpu_check.sh`, never on the CPU machines this was written on):
- There is no traces-only API. `_snapshot()` copies every segment (with the stack of every live
  block) and the whole ring, symbolising each entry's frames; `memory_snapshot(include_traces=)`
  only drops the traces. So a read costs O(live blocks + ring entries).
- To keep the ring part proportional to the step rather than to `MAX_ENTRIES`, the ring is
  cleared after each read (`clear_history=True`, re-issuing the same settings) where the build
  supports it. The cursor above still applies, so a build without `clear_history` gives the same
  answers at the full-ring cost. Not cleared with `--snapshot-on-oom`: that snapshot needs the
  history (then frees are recorded too, as the snapshot viewer needs them). An allocation another
  thread makes between the read and the clear is lost (the allocator holds its lock for each).
- The read must happen on the training thread at the close: the ring has no step markers, so the
  boundary is wherever the read happens. Only the slicing happens there; walking frames and
  folding run on the emitter thread when the frame is finalised.
Everything is guarded: a build without these functions, the cudaMallocAsync backend (which has no
snapshot) or any exception disables the feature with one agent error; the job goes on.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from memtui_agent.memory.alloc_trace import Cursor, Drained, device_traces, new_entries
from memtui_protocol import schema

MAX_ENTRIES = 20_000
"""Ring size with free events skipped: room for the allocations of a large step."""
SNAPSHOT_MAX_ENTRIES = 100_000
"""Ring size with `--snapshot-on-oom` too (frees recorded): what that snapshot always kept."""
FREE_ACTIONS = ("free_requested", "free_completed")
COMPONENT = "alloc-events"


# ----- torch ------------------------------------------------------------------------------------


class TorchCudaMemory:
    """The torch calls the recorder makes, in one place (tests hand the recorder a stand-in)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def is_available(self) -> bool:
        """Whether this process could use CUDA at all (creates no context)."""
        return bool(self._torch.cuda.is_available())

    def lazy_call(self, callback: Callable[[], None]) -> bool:
        """Run `callback` when the job initialises CUDA (at once if it has); False if unknown."""
        lazy = getattr(self._torch.cuda, "_lazy_call", None)
        if lazy is None:
            return False
        lazy(callback)
        return True

    def parameters(self) -> set[str]:
        """Keyword arguments `_record_memory_history` accepts in this build."""
        record = self._torch.cuda.memory._record_memory_history
        try:
            return set(inspect.signature(record).parameters)
        except (TypeError, ValueError):
            return set()

    def record_history(self, **kwargs: Any) -> None:
        """`torch.cuda.memory._record_memory_history("all", **kwargs)`."""
        self._torch.cuda.memory._record_memory_history("all", **kwargs)

    def stop_history(self) -> None:
        """Stop recording (the ring is freed)."""
        self._torch.cuda.memory._record_memory_history(None)

    def snapshot(self) -> Any:
        """`torch.cuda.memory._snapshot()`: segments and the ring of every device."""
        return self._torch.cuda.memory._snapshot()

    def skip_prefixes(self) -> tuple[str, ...]:
        """torch's and the agent's folders: frames there are not the user's source line."""
        import memtui_protocol

        agent_package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        folders = (
            os.path.dirname(os.path.abspath(self._torch.__file__)),
            agent_package,
            os.path.dirname(os.path.abspath(memtui_protocol.__file__)),
        )
        return tuple(folder + os.sep for folder in folders)


class AllocEventsRecorder:
    """Owns the allocator's history ring for `--alloc-events`.

    Args:
        fail: reports an exception once (the agent's `report_failure`).
        note: says once that the flag does nothing here (`component`, message).
        keep_frees: `--snapshot-on-oom` is on too: record frees and never clear the history.
        api: the torch calls (None: torch itself, resolved when armed).
    """

    def __init__(
        self,
        fail: Callable[[str, BaseException], None],
        note: Callable[[str, str], None],
        keep_frees: bool = False,
        api: Any = None,
    ) -> None:
        self.fail = fail
        self.note = note
        self.keep_frees = keep_frees
        self.api = api
        self.max_entries = 0
        self.started = False
        self.off = False
        self._clears = False
        self._whole_window = False
        """Recording began with CUDA itself, so the counters' step deltas match the ring."""
        self._kwargs: dict[str, Any] = {}
        self._cursors: dict[int, Cursor] = {}
        self._skip: tuple[str, ...] = ()
        self._cwd: str | None = None
        self._pid = 0

    def arm(self) -> bool:
        """At agent start: note a CPU-only job, else start when the job initialises CUDA.

        Returns whether the history will be recorded.
        """
        self._pid = os.getpid()
        self._cwd = os.getcwd()
        try:
            if self.api is None:
                self.api = TorchCudaMemory()
            if not self.api.is_available():
                self.off = True
                self.note(
                    COMPONENT,
                    "--alloc-events has no effect: torch sees no CUDA device, and the CPU "
                    "allocator keeps no history",
                )
                return False
            self._skip = tuple(self.api.skip_prefixes())
            if not self.api.lazy_call(self._start_at_cuda_init):
                return True  # started by the first close that finds CUDA in use
        except Exception as exc:
            self._disable(exc)
            return False
        return not self.off

    def _start_at_cuda_init(self) -> None:
        """Queued with `_lazy_call`: runs inside torch's CUDA initialisation, so never raises."""
        if os.getpid() != self._pid:
            return  # a forked child (DataLoader worker) records nothing
        try:
            self._start(whole_window=True)
        except Exception as exc:
            self._disable(exc)

    def _start(self, whole_window: bool) -> None:
        if self.started or self.off:
            return
        api = self.api
        accepted = api.parameters()
        self.max_entries = SNAPSHOT_MAX_ENTRIES if self.keep_frees else MAX_ENTRIES
        kwargs: dict[str, Any] = {
            "context": "all" if self.keep_frees else "alloc",
            "stacks": "python",
            "max_entries": self.max_entries,
        }
        if not self.keep_frees and "skip_actions" in accepted:
            kwargs["skip_actions"] = list(FREE_ACTIONS)
        api.record_history(**kwargs)
        self._kwargs = kwargs
        self._clears = not self.keep_frees and "clear_history" in accepted
        self._whole_window = whole_window
        self.started = True

    def drain(self, expected_allocations: int | None) -> Drained | None:
        """At a step close with CUDA in use (training thread): the step's new ring entries.

        Args:
            expected_allocations: the step's allocation count from `memory_stats()`.
        """
        if self.off:
            return None
        try:
            if not self.started:
                # CUDA came up without the lazy hook: record from now on, next step on.
                self._start(whole_window=False)
                return None
            entries, overflowed = self._read()
            whole, self._whole_window = self._whole_window, True
            return Drained(
                entries=entries,
                overflowed=overflowed,
                expected_allocations=expected_allocations if whole else None,
                skip_prefixes=self._skip,
                cwd=self._cwd,
            )
        except Exception as exc:
            self._disable(exc)
            return None

    def _read(self) -> tuple[list[Any], bool]:
        traces = device_traces(self.api.snapshot())
        entries: list[Any] = []
        overflowed = False
        for device, trace in enumerate(traces):
            cursor = self._cursors.get(device, Cursor())
            new, wrapped, self._cursors[device] = new_entries(trace, cursor, self.max_entries)
            entries.extend(new)
            overflowed = overflowed or wrapped
        if self._clears:
            # Same settings, empty ring: the next read copies only the next step's entries.
            self.api.record_history(**self._kwargs, clear_history=True)
        return entries, overflowed

    def unfinished(self) -> schema.AllocEvents | None:
        """At the end of the job: the events since the last close (up to an OOM), if any."""
        if self.off or not self.started:
            return None
        try:
            entries, overflowed = self._read()
        except Exception:
            return None
        if not entries:
            return None
        drained = Drained(entries, overflowed, None, self._skip, self._cwd)
        return drained.summary()

    def never_started(self) -> bool:
        """Armed on a CUDA machine, but the job never used CUDA."""
        return not self.off and not self.started

    def _disable(self, exc: BaseException) -> None:
        self.off = True
        self.fail(COMPONENT, exc)
        if self.started and not self.keep_frees:
            try:
                self.api.stop_history()  # stop paying for a ring nobody reads
            except Exception:
                pass
