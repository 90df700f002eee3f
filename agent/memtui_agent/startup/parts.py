"""One place builds the agent: every part, from the configuration (`build_parts`).

The agent's parts depend on one another in one direction, and this function builds them in that
order: the ledger and the registry, the training phase and the followed thread, the hooks'
switches; the budget, health check and activation gate; the step closer and the step window;
then the hooks that report to them, sharing one `HookContext`, and the tracker that installs
them. The one cycle, the hook arming installing hooks that read the arming, is closed here once
(`HookArming.bind`). Nothing else constructs a part: the agent, the estimate's fake step, the
tests and the benchmarks all call `build_parts`.

`AgentParts` is what the agent holds once started: it answers the agent's questions by name
(`final_leaks()`, `last_oom()`, `position()`), so the agent reaches through no part's
attributes; before `start()` the agent holds `agent_state.NOT_STARTED` instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from memtui_agent.hooks.context import HookContext
from memtui_agent.hooks.counting import CountingHooks
from memtui_agent.hooks.data_parallel import DataParallelHooks
from memtui_agent.hooks.hook_arming import GateSwitch, HookArming
from memtui_agent.hooks.library_wrappers import (
    CheckpointNotes,
    ClipWarning,
    DataLoaderWrappers,
    GradScalerWrappers,
    SavedHooksDisabled,
)
from memtui_agent.hooks.module_scout import ModuleScout
from memtui_agent.hooks.objects import CloseSync, ObjectSync, Watermark
from memtui_agent.hooks.phase import JobPhase
from memtui_agent.hooks.root_calls import RootHooks
from memtui_agent.hooks.saved_tensors import UnhookedSaves, unpack
from memtui_agent.hooks.step_hooks import StepHooks, register_live_optimizers
from memtui_agent.hooks.switches import Fail, HookSwitches
from memtui_agent.hooks.tracker import HookSet, Tracker
from memtui_agent.hooks.training_thread import TrainingThread
from memtui_agent.job.data_loaders import DataLoaders
from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.job.optimizer_book import OptimizerBook
from memtui_agent.memory.allocator import AllocatorReader
from memtui_agent.memory.ledger import NO_MODULE, Ledger
from memtui_agent.memory.worker_memory import WorkerSampler
from memtui_agent.startup.agent_state import Position
from memtui_agent.steps.budget import Budget
from memtui_agent.steps.first_step import FirstSteps
from memtui_agent.steps.frame import ClosedStep
from memtui_agent.steps.gate import ActivationGate
from memtui_agent.steps.health import HealthMonitor
from memtui_agent.steps.hook_share import calibrate
from memtui_agent.steps.pile_count import PersistentPiles
from memtui_agent.steps.step_closer import StepCloser
from memtui_agent.steps.step_signature import heap_reader
from memtui_agent.steps.window import StepWindow
from memtui_agent.steps.worker_leaks import WorkerLeaks
from memtui_protocol import schema
from memtui_protocol.config import AgentConfig
from memtui_protocol.schema import ActivationMode, StepTrigger

if TYPE_CHECKING:  # for annotations only
    from torch import nn
    from torch.optim import Optimizer

Emit = Callable[[schema.Message | ClosedStep], None]
"""Where frames go (the agent's emitter)."""

CENSUS_EFFECT = "stopped that census (its step says so); later censuses run"
WORKERS = "dataloader-workers"
"""The component said in the one report of an error following the DataLoader workers."""
BLOCKS = "checkpoint-blocks"
"""The component said in the one report of an error in the repeated blocks' figures
(`job.blocks`), which `memtui estimate --from` plans with."""


def build_parts(
    config: AgentConfig, emit: Emit, fail: Fail, ledger: Ledger | None = None
) -> AgentParts:
    """Every part of one agent, wired; nothing installed yet (`AgentParts.install`).

    Args:
        config: the agent's configuration, handed whole to the parts that read it.
        emit: where frames go (the emitter's `put`).
        fail: how a part reports its error once (the agent's `report_failure`).
        ledger: the ledger to count into (a fresh one by default).
    """
    ledger = ledger if ledger is not None else Ledger()
    switches = HookSwitches(fail)
    registry = ModuleRegistry(emit)
    phase = JobPhase()
    # The one thread followed (`training_thread`): the installing one until an optimizer
    # steps, then the first to step one.
    thread = TrainingThread()
    arming = HookArming(unpack)
    piles = PersistentPiles(registry, ledger, arming)
    budget = Budget(config.budget)
    health = HealthMonitor(config.nan_check, phase.stack)
    switch = GateSwitch(arming, registry, piles, phase.stack, switches)
    unhooked = UnhookedSaves(ledger, NO_MODULE)
    heap = heap_reader()
    # Calibrated before the job runs, on the thread that starts the agent, with no hooks on.
    costs = calibrate(heap) if config.activations is ActivationMode.AUTO else None
    gate = ActivationGate(
        config.activations,
        switch,
        registry,
        health,
        budget,
        heap,
        costs=costs,
        own=ledger.own_bytes,
        adopt=unhooked,
    )
    data_parallel = DataParallelHooks(switches, partial(_fsdp_found, gate, piles, health))
    watermark = Watermark()
    closer = StepCloser(
        ledger,
        registry,
        piles,
        health,
        budget,
        gate,
        CloseSync(registry, gate, data_parallel, watermark),
        config,
    )
    closer.census_failed = partial(_census_failed, fail)
    loaders = DataLoaders(WorkerSampler(partial(fail, WORKERS)))
    closer.workers = WorkerLeaks(loaders)
    closer.workers_failed = partial(fail, WORKERS)
    closer.blocks_failed = partial(fail, BLOCKS)
    window = StepWindow(closer, gate, ledger, emit, partial(register_live_optimizers, registry))
    context = HookContext(
        phase=phase,
        thread=thread,
        switches=switches,
        registry=registry,
        window=window,
        gate=gate,
        optimizers=OptimizerBook(),
        ledger=ledger,
        piles=piles,
    )
    scout = ModuleScout(context)
    roots = RootHooks(context, arming, scout)
    objects = ObjectSync(context, roots, data_parallel, watermark)
    scout.bind(objects.sync_objects, roots.hooks)
    counting = CountingHooks(context, arming, health, data_parallel, objects)
    arming.bind(counting)
    first_steps = FirstSteps(budget, emit, AllocatorReader.active)
    steps = StepHooks(context, first_steps, closer.allocator, objects.sync_objects)
    hooks = HookSet(
        arming=arming,
        counting=counting,
        roots=roots,
        steps=steps,
        scaler=GradScalerWrappers(context, steps),
        clip=ClipWarning(window, thread),
        checkpoint=CheckpointNotes(window, emit, thread),
        saved_off=SavedHooksDisabled(context, arming),
        loaders=DataLoaderWrappers(loaders, partial(fail, WORKERS)),
    )
    return AgentParts(
        config=config,
        context=context,
        closer=closer,
        objects=objects,
        tracker=Tracker(context, hooks, fail),
    )


def _census_failed(fail: Fail, exc: BaseException) -> None:
    """A census met an error: that census stopped there (its record says so), the next ones
    run; said once."""
    fail("census", exc, CENSUS_EFFECT)


def _fsdp_found(
    gate: ActivationGate, piles: PersistentPiles, health: HealthMonitor, on: bool
) -> None:
    """FSDP found (or its measurements off): every step measured, the piles walked at every
    close (the unpack hook's sampling is `DataParallelHooks`' own), and no global gradient norm
    (each rank holds a shard of the gradients)."""
    gate.fsdp = piles.walk_always = health.sharded = on


@dataclass(frozen=True)
class AgentParts:
    """The built parts of one agent (`agent_state.Parts`), answering its questions by name."""

    config: AgentConfig
    context: HookContext
    closer: StepCloser
    objects: ObjectSync
    tracker: Tracker

    # ----- the parts, for tests and benchmarks ---------------------------------------------------

    @property
    def ledger(self) -> Ledger:
        """The ledger the hooks count into."""
        return self.context.ledger

    @property
    def gate(self) -> ActivationGate:
        """The activation gate."""
        return self.context.gate

    @property
    def window(self) -> StepWindow:
        """The step window."""
        return self.context.window

    # ----- install / remove ----------------------------------------------------------------------

    def install(self) -> None:
        """Register every hook (on the thread that runs the forward)."""
        self.tracker.install()

    def remove(self) -> None:
        """Remove every hook and wrapper (and the op watch's mode, if it is on top here)."""
        self.tracker.remove()
        self.closer.health.ops.take()

    def stop_sampling(self) -> None:
        """Stop the DataLoader workers' sampler thread (the agent leaves)."""
        workers = self.closer.workers
        if workers is not None:
            workers.loaders.sampler.close()

    def disable(self) -> None:
        """Every hook off, then removed (a forked child that never trains)."""
        self.context.switches.all_off()
        try:
            self.tracker.remove()
        except Exception:
            pass  # disabled, which is enough for a worker that never trains

    # ----- during the run ------------------------------------------------------------------------

    def tick(self) -> schema.Tick | None:
        """Live piles for the emitter's once-a-second heartbeat."""
        context = self.context
        return schema.Tick(
            time=time.time(),
            piles=context.piles.current(),
            phase=context.phase.now(),
            step=context.window.closed,
        )

    def watch(self, model: nn.Module | None, optimizer: Optimizer | None) -> None:
        """Register a model tree and an optimizer ahead of their first use."""
        self.objects.watch(model, optimizer)

    def own_heap(self, held: Callable[[], int]) -> None:
        """`held`: what the agent's own frame log holds in the job's heap, taken out of what
        the leak watch reads on a CPU (`StepCloser.own_bytes`)."""
        self.closer.own_bytes = held

    def arm_alloc_events(
        self, fail: Callable[[str, BaseException], None], note: Callable[[str, str], None]
    ) -> None:
        """`--alloc-events`: the recorder drains the allocator's history at every close."""
        from memtui_agent.memory.alloc_events import AllocEventsRecorder

        closer = self.closer
        recorder = AllocEventsRecorder(
            fail=fail, note=note, keep_frees=closer.gpu_events.snapshot_path is not None
        )
        closer.alloc_events = recorder
        recorder.arm()
        # The recorder keeps frees for the OOM snapshot; one owner of the history, not two.
        closer.gpu_events.history_owner = recorder

    # ----- at the end ----------------------------------------------------------------------------

    def alloc_events_never_started(self) -> bool:
        """`--alloc-events` was armed but the job never used CUDA."""
        recorder = self.closer.alloc_events
        return recorder is not None and recorder.never_started()

    def unfinished_alloc_events(self) -> schema.AllocEvents | None:
        """`--alloc-events`: what the allocator did after the last close (up to an OOM)."""
        recorder = self.closer.alloc_events
        return recorder.unfinished() if recorder is not None else None

    def readable_at_end(self) -> bool:
        """The followed thread is not training elsewhere meanwhile (autograd writes gradients
        without the GIL: reading one it is writing crashes the job)."""
        return not self.context.thread.alive_elsewhere()

    def settle_at_end(self, readable: bool) -> None:
        """A skipped step whose `update()` never came is released; the exit piles are counted
        from the objects alive now (only where `readable`)."""
        self.context.window.release_held_skip()
        if readable:
            self.context.piles.resync(walk_all=True)

    def late_health(self) -> list[schema.StepLate]:
        """Late health values of the last steps, waited for (the end of the job may wait)."""
        return self.closer.late_health(wait=True)

    def final_leaks(
        self, namespace: dict[str, Any] | None, error: BaseException | None
    ) -> list[schema.Leak]:
        """The leaks named during the run, as a census finds them now (`namespace`: the
        script's globals, any object of the job's)."""
        return self.closer.final_leaks(self.context.window.closed, namespace, error)

    def last_oom(self) -> dict[str, int] | None:
        """The allocator's last failed allocation, as observed (None: none seen)."""
        return self.closer.gpu_events.last_oom

    def position(self) -> Position:
        """Where the job is now: open and closed step, phase, error context, piles."""
        context = self.context
        return Position(
            step=context.window.number,
            closed=context.window.closed,
            phase=self.tracker.phase(),
            context=self.tracker.error_context(),
            piles=context.piles.current(),
        )

    # ----- attach and detach ---------------------------------------------------------------------

    def owner_thread(self) -> int | None:
        """The thread the hooks follow."""
        return self.tracker.owner_thread

    def pack_removable(self) -> bool:
        """Whether the agent's saved-tensor pair is on top here and may be popped."""
        return self.tracker.pack_removable()

    def steps_recorded(self) -> tuple[int, int]:
        """(the last step closed, the steps this agent recorded)."""
        window = self.context.window
        return window.closed, window.recorded

    def adopt_running_optimizer(self, optimizer: Optimizer, steps: int) -> None:
        """An optimizer whose first step is long past: no forecast, no first-step growth for
        it, and its own step count goes on from where the job is."""
        record = self.context.optimizers.record(optimizer)
        record.forecasted = record.first_step_done = True
        record.steps = steps

    def join_steps(self, trigger: StepTrigger, steps_before: int, alert: schema.Alert) -> None:
        """An attach joins a running job: what closes its steps (the attach's scan replaces
        the window's own search), the job's own step numbers, and the alert that says so."""
        window = self.context.window
        window.trigger = trigger
        if steps_before:
            window.closed = steps_before  # frames carry the job's own step numbers
        window.note(alert)

    def feed_module_pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        """Run the module pre-hook by hand (an attach joining at a forward already begun)."""
        self.tracker.feed_module_pre(module, args)
