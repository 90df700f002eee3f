"""Closing a step: every measurement its frame needs, gathered once into `frame.StepInputs`.

Runs on the training thread when the step window closes a step (a top-level `optimizer.step()`
returned, GradScaler skipped it, or in a job with no optimizer a top-level backward returned).
It keeps to what is cheap there: counters the hooks already maintain, the persistent piles
counted again where they may have changed, the health module's single fused check, the
allocator's counters, NVML (GPU jobs), the process's RSS. Nothing here waits for the device: a
loss or check result still on the GPU is read later (`late_values`, `health`).

The activation gate's verdict is taken here, from what was read (`ActivationGate.verdict`), and
the budget judges the step's final peak (a repeat's carried one). The frame itself is built from
the inputs by `frame.build_step`, when the emitter writes it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.job.names import census_roots, final_roots
from memtui_agent.job.optimizer_book import OptimizerRecord
from memtui_agent.memory.alloc_events import AllocEventsRecorder
from memtui_agent.memory.allocator import (
    AllocatorReader,
    expandable_segments_enabled,
    fragmentation_message,
)
from memtui_agent.memory.census import Census, Root, take_census
from memtui_agent.memory.gpu_events import GpuEvents
from memtui_agent.memory.kept import KeptSchedule, kept_of
from memtui_agent.memory.leak_watch import LeakReport, LeakWatch, census_cost
from memtui_agent.memory.ledger import Ledger
from memtui_agent.memory.memory_readers import host_now, with_nvml
from memtui_agent.steps.budget import Budget
from memtui_agent.steps.frame import CloseReading, LedgerReading, StepInputs
from memtui_agent.steps.gate import ActivationGate
from memtui_agent.steps.health import HealthMonitor
from memtui_agent.steps.pile_count import PersistentPiles
from memtui_agent.steps.window import OpenStep
from memtui_agent.steps.worker_leaks import WorkerLeaks, WorkerReport
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig
from memtui_protocol.schema import AlertKind, CensusStop, Phase, StepTrigger

TOP_MODULES = 10


def _ignore(exc: BaseException) -> None:
    """No one to tell (a closer built without an agent, as in tests)."""


def _nothing() -> int:
    """No frame log (a closer built without an agent, as in tests)."""
    return 0


class CloseHooks(Protocol):
    """What the hooks side does and knows at a close (`hooks.tracker.Tracker`)."""

    def before_close(self, step: int) -> None:
        """Hook what appeared since the last close, before the piles are counted."""
        ...

    def distributed_at_close(self) -> schema.Distributed | None:
        """The data-parallel wrappers' memory now (None without DDP or FSDP)."""
        ...


class StepCloser:
    """Gathers each closing step's inputs; owns the readers a close uses."""

    def __init__(
        self,
        ledger: Ledger,
        registry: ModuleRegistry,
        piles: PersistentPiles,
        health: HealthMonitor,
        budget: Budget,
        gate: ActivationGate,
        hooks: CloseHooks,
        config: AgentConfig,
    ) -> None:
        self.ledger = ledger
        self.registry = registry
        self.piles = piles
        self.health = health
        self.budget = budget
        self._gate = gate
        self._hooks = hooks
        self.allocator = AllocatorReader(config.reset_peaks)
        self.gpu_events = GpuEvents(config.oom_snapshot_path())
        self.alloc_events: AllocEventsRecorder | None = None
        """Set by the agent with `--alloc-events`: drains the allocator's history each close."""
        self.leaks = LeakWatch(self._census)
        self.kept = KeptSchedule()
        self._taken: Census | None = None
        """The census this close took (the leak watch's or the kept schedule's), if any."""
        self.own_bytes: Callable[[], int] = _nothing
        """What the agent's own frame log holds in the job's heap now (the emitter's): taken
        out of the CPU heap the leak watch reads, where it grows with every frame."""
        self.census_failed: Callable[[BaseException], None] = _ignore
        """Told once per error a census met (the agent says it on stderr and in the
        recording); the census itself ends there, the next one runs as usual."""
        self.workers: WorkerLeaks | None = None
        """The DataLoader workers' memory and growth (set by `parts.build_parts`)."""
        self.workers_failed: Callable[[BaseException], None] = _ignore
        """Told of an error in the workers' figures (said once; that close goes without)."""
        self.blocks_failed: Callable[[BaseException], None] = _ignore
        """Told of an error in the repeated blocks' figures (said once; closes go without)."""

    def close(
        self, opened: OpenStep, step: int, skipped: bool, record: OptimizerRecord | None
    ) -> StepInputs:
        """The inputs of the closing step `step`, whose window is `opened`.

        `record` is the optimizer whose top-level `step()` (or GradScaler skip) closes it; None
        when a backward closes it (a job with no optimizer).
        """
        self._hooks.before_close(step)
        gradients = self.piles.resync(walk_all=self.piles.watch.begin_close())
        late = self.late_health()
        end, high, peak, dtypes = self.ledger.at_close()
        self.allocator.phase_ended(Phase.OPTIMIZER)
        allocator = self.allocator.read()
        device_index = None
        drained = None
        fragmentation = None
        if allocator.allocated is not None:
            device_index = self.gpu_events.ensure_attached()
            if self.alloc_events is not None:
                drained = self.alloc_events.drain(allocator.allocations)
            fragmented = fragmentation_message(
                allocator, expandable_segments_enabled(dict(os.environ))
            )
            if fragmented is not None:
                fragmentation = schema.Alert(kind=AlertKind.FRAGMENTATION, message=fragmented)
        alarms = self.health.close(
            step,
            gradients.tensors,
            opened.losses,
            self.named_parameters,  # names are needed only on an alarm
            skipped,
            self.registry.name,
            gradients.groups,
            record.name if record is not None else None,
        )
        t_end = time.time()
        ledger = LedgerReading(
            end,
            high,
            peak,
            dtypes,
            self.ledger.top_modules(TOP_MODULES),
            steady=self.ledger.steady(),
            gradients_watched=self.ledger.gradients_watched(),
        )
        reading = CloseReading(step, ledger, with_nvml(allocator, device_index))
        verdict = self._gate.verdict(reading)
        blocks = self._blocks_at_close(verdict.measured and verdict.carried is None)
        final_peak = verdict.peak(peak)
        over_budget = self.budget.judge_peak(final_peak)
        self._taken = None
        try:
            leak = self.leaks.at_close(
                step,
                self._kept(reading, end),
                headroom=self._headroom(reading.allocator, final_peak),
                exact=reading.allocator.allocated is not None,
            )
        except Exception as exc:  # the leak watch's own error: this close has no leak figures
            self.census_failed(exc)
            leak = LeakReport()
        kept, census_cost = self._kept_tensors(step, leak.census)
        workers = self._workers_at_close(step)
        distributed = self._hooks.distributed_at_close()
        return StepInputs(
            step=step,
            t_start=opened.started,
            t_end=t_end,
            skipped=skipped,
            microbatches=opened.microbatches,
            closed_by=StepTrigger.BACKWARD if record is None else StepTrigger.OPTIMIZER,
            optimizer=record.name if record is not None else None,
            optimizer_step=record.steps if record is not None else None,
            reading=reading,
            gradients=self.piles.gradients,
            verdict=verdict,
            host=host_now(),
            raised=tuple(opened.raised),
            fragmentation=fragmentation,
            health=tuple(alarms),
            grad_norm=self.health.judged_norm,
            over_budget=over_budget,
            late=tuple(late),
            distributed=distributed,
            alloc_events=drained,
            activations_left=self.ledger.current().counted()[3],
            leaks=(*leak.leaks, *workers.leaks),
            leak_alerts=(*leak.alerts, *workers.alerts),
            census=census_cost,
            kept=kept,
            workers=workers.workers,
            blocks=tuple(blocks),
        )

    def _blocks_at_close(self, measured: bool) -> list[schema.BlockBytes]:
        """The repeated blocks' saved and input bytes on a measured step ([] otherwise: what
        the hooks saw of an unmeasured step is part of it at most); the watch starts afresh
        for the next step either way. Never raises: an error is said once (`blocks_failed`)."""
        watch = self.registry.blocks
        try:
            if watch.error is not None:
                error, watch.error = watch.error, None
                self.blocks_failed(error)
            taken = watch.take(self.ledger.module_maxima())
        except Exception as exc:
            self.blocks_failed(exc)
            return []
        return taken if measured else []

    def _workers_at_close(self, step: int) -> WorkerReport:
        """The DataLoader workers' last sample and what their growth calls for; never raises
        (an error leaves this close without them, said once)."""
        if self.workers is None:
            return WorkerReport()
        try:
            return self.workers.at_close(step)
        except Exception as exc:
            self.workers_failed(exc)
            return WorkerReport()

    def _kept_tensors(
        self, step: int, cost: schema.CensusCost | None
    ) -> tuple[schema.Kept | None, schema.CensusCost | None]:
        """The tensors the job keeps outside every pile, where this close counts them (a census
        the leak watch took, or one the kept schedule asks for), and the cost of the census
        this close took. Never raises: an error leaves this close without the figure."""
        try:
            generation = self.registry.generation
            if self._taken is None and self.kept.due(step, generation):
                self._taken = self._census()
                cost = census_cost(self._taken)
                self.leaks.seen(step, self._taken)  # the leak watch compares its next with it
            taken = self._taken
            if taken is None:
                return None, cost
            self.kept.counted(step, generation, taken.complete)
            if taken.stopped is CensusStop.ERROR:
                return None, cost
            return kept_of(taken, self.ledger.activation_keys()), cost
        except Exception as exc:
            self.census_failed(exc)
            return None, cost
        finally:
            self._taken = None  # the census and the objects it names are not kept past the close

    def _census(self) -> Census:
        """A census of the job's live tensors from the names it wrote (this thread's frames
        are the training loop's)."""
        frame = sys._getframe(1)
        self._taken = self._take(lambda: census_roots(self.registry, frame))
        return self._taken

    def final_leaks(
        self, step: int, namespace: dict[str, Any] | None, error: BaseException | None
    ) -> list[schema.Leak]:
        """The leaks named during the run, counted again as the job ends (the workers' as
        last sampled)."""
        found = self.leaks.final(
            step, lambda: self._take(lambda: final_roots(self.registry, namespace, error))
        )
        return found + (self.workers.final() if self.workers is not None else [])

    def _take(self, roots: Callable[[], list[Root]]) -> Census:
        """One census from `roots()`, with what the pack hook recorded of retained graphs.
        Never raises: an error ends this census only, and is said once."""
        started = time.perf_counter()
        try:
            census = take_census(
                roots(),
                excluded=self.ledger.persistent_keys() | self.piles.gradient_keys(),
                saved=self.ledger.saved_by_node(),
                calls=self._gate.held.calls(),
                activations=self.ledger.activation_keys(),
                follow=self.leaks.following(),
            )
        except Exception as exc:  # finding the roots failed: this census only
            exc.__traceback__ = None  # its frames would hold the roots
            census = Census({}, 0, time.perf_counter() - started, False, CensusStop.ERROR, exc)
        if census.error is not None:
            self.census_failed(census.error)
            census.error = None
        return census

    def _kept(self, reading: CloseReading, end: schema.Piles) -> int | None:
        """Memory held at the close beyond weights, gradients and optimizer state: the
        allocator's `allocated` on a GPU, glibc's bytes in use on a CPU less the agent's own
        frame log (None off glibc)."""
        used = reading.allocator.allocated
        if used is None:
            used = self._gate.signatures.heap_at_close
            if used is None:
                return None
            used -= self.own_bytes()
        weights, gradients, state, _ = end.counted()
        if self.piles.gradients is not None:
            gradients = self.piles.gradients[0]
        return used - weights - gradients - state

    def _headroom(self, allocator: schema.Allocator, peak: schema.Piles) -> int | None:
        """What is left before the budget, or else before the device is full, for a leak's
        out-of-memory forecast."""
        if self.budget.limit is not None:
            return max(0, self.budget.limit - sum(peak.counted()))
        if allocator.device_total is not None and allocator.device_used is not None:
            cached = (allocator.reserved or 0) - (allocator.allocated or 0)
            return max(0, allocator.device_total - allocator.device_used + cached)
        return None

    def late_health(self, wait: bool = False) -> list[schema.StepLate]:
        """Alerts of earlier steps whose GPU checks reached the host since (none on CPU)."""
        found = self.health.collect(self.named_parameters, self.registry.name, wait)
        return [
            schema.StepLate(step=step, alerts=alerts[: schema.MAX_LATE_ALERTS], grad_norm=norm)
            for step, alerts, norm in found
        ]

    def named_parameters(self) -> list[tuple[str, Any]]:
        """Every watched parameter once, with its qualified name (for alarms)."""
        names = self.registry.param_names
        seen: set[int] = set()
        named = []
        for index, parameter in enumerate(self.registry.parameters()):
            if id(parameter) in seen:
                continue
            seen.add(id(parameter))
            named.append((names.get(id(parameter), f"param[{index}]"), parameter))
        return named
