"""Every decision to arm or disarm the activation hooks, and how a closing step's figures stand.

The module, saved-tensor and gradient hooks cost a Python call per module call, saved tensor and
gradient (README, "Overhead"). Whether they run on a step is decided here, and only here:

- `--activations` (`activation_policy`): `every` arms them on every step, `off` never (after the
  first step, where the module hooks find the models), `auto` on the steps whose activations can
  differ from a step already measured (the policy's signatures);
- reasons to measure whatever the signature says, at the step's first root call: NaN/Inf module
  probes armed (`health`), FSDP (its gathered parameters are seen by the module hooks), a peak
  that came near the budget (`budget`);
- events that make the next steps measured: a new optimizer and its first steps, an alert of
  `ALERTS_TO_MEASURE`.

At a close, `verdict` says whether the step's activation figures were measured, are carried from
a measured step it repeats, or are not known. A repeat's key (the same calls on the same shapes)
only makes it a candidate: the carry stands when the step's own counters confirm it
(`step_signature`: the autograd nodes it recorded, exact; the memory it allocated, exact on a
GPU, within a tolerance of glibc's heap on a CPU), when it starts and ends holding the same
activations as its twin, and when no graph it built unarmed is still held at its close
(`held_graphs`). Otherwise it is "not known" and the next step is measured; a cause that keeps
coming back (LayerDrop, graphs crossing steps) makes every step measured. Each cause is said once,
with its numbers (`activations_vary`). When a step opens, `step_opens` arms or disarms the hooks
for it.

The gate installs nothing itself: the hooks side hands it a `HookSwitch`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.memory.tensor_reads import next_sequence_number
from memtui_agent.steps.activation_policy import (
    FIRST_STEPS,
    ActivationPolicy,
    Figures,
    Verdict,
    call_signature,
)
from memtui_agent.steps.budget import Budget
from memtui_agent.steps.frame import CloseReading, StepInputs
from memtui_agent.steps.health import HealthMonitor
from memtui_agent.steps.held_graphs import Held, HeldGraphs
from memtui_agent.steps.step_signature import (
    Difference,
    Mismatch,
    SignatureRecorder,
    compare,
)
from memtui_protocol import schema
from memtui_protocol.schema import ActivationMode, AlertKind, Pile

ALERTS_TO_MEASURE = frozenset(
    {
        AlertKind.NONFINITE_LOSS,
        AlertKind.NONFINITE_ACTIVATION,
        AlertKind.NONFINITE_GRADIENT,
        AlertKind.SKIPPED_STEP,
        AlertKind.OVER_BUDGET,
        AlertKind.FRAGMENTATION,
    }
)
"""Alerts after which the next steps are measured (`auto`): whatever happens next is seen
with every hook on."""
RECENT_CARRIES = 10
UNCONFIRMED_FOR_EVERY = 3
"""Of the last `RECENT_CARRIES` repeats, this many unconfirmed make every step measured: the
job's activations change with what its inputs do not show (LayerDrop), and a fifth of its steps
or more would otherwise say "not known"."""
CROSSINGS_FOR_EVERY = 2
"""Closes finding new graphs built unarmed still held, after which every step is measured (a
GAN whose generator graph is backpropagated a step later): only armed steps count such
graphs."""
MEASURE_WHILE_HELD = 2
"""Steps measured after a close that finds graphs of root calls still held. What a graph saves
is known only from the agent's own pack hook (a census never unpacks a graph), so while the
job keeps graphs across closes the steps that may build more are armed: two, because in a job
of two optimizers (a GAN) the step that builds the graph held at one close is the one after the
next."""


class HookSwitch(Protocol):
    """The costly hooks, as the gate switches them (implemented on the hooks side)."""

    @property
    def armed(self) -> bool:
        """Whether the module, saved-tensor and gradient hooks are installed."""
        ...

    def arm(self, root: Any | None) -> None:
        """Install them; `root` is the root module whose forward is starting (or None)."""
        ...

    def disarm(self) -> None:
        """Remove them (the saved-tensor pair once it is on top of its stack)."""
        ...

    def hook_new_parameters(self) -> None:
        """Gradient hooks on parameters found since they were armed."""
        ...

    def foreign_hooks(self) -> bool:
        """The job's own saved-tensor hooks are on top on this thread, or a backward runs: the
        agent's pair may not be pushed (it would sit above the job's), so a forward now is one
        the agent cannot count."""
        ...

    @property
    def pack_missing(self) -> bool:
        """Armed, without the agent's saved-tensor pair where this thread's forwards pack."""
        ...


class ActivationGate:
    """Arms the activation hooks for the steps that must be measured, and judges each close."""

    def __init__(
        self,
        mode: ActivationMode,
        switch: HookSwitch,
        registry: ModuleRegistry,
        health: HealthMonitor,
        budget: Budget,
        heap: Callable[[], int | None] | None = None,
    ) -> None:
        """`heap` reads glibc's bytes in use (`step_signature.heap_reader`), for the CPU's half
        of a carry's confirmation; None where there is no such counter."""
        self.policy = ActivationPolicy(mode)
        self.signatures = SignatureRecorder(heap)
        self.held = HeldGraphs()
        self._start_activations = 0
        """Activations held as the open step began (graphs kept from earlier steps)."""
        self._recent: deque[bool] = deque(maxlen=RECENT_CARRIES)
        """Whether each recent repeat's carry was confirmed."""
        self._crossings = 0
        self._said: set[str] = set()
        """Causes of `activations_vary` already said (each once)."""
        self._blind = False
        """A forward of the open step ran where the agent's saved-tensor pair could not count
        it (the job's own hooks on top): the step's activations are not known."""
        self._call_first = 0
        """The sequence number of the first node the root call in progress may build."""
        self._moved = False
        """The open step began while the agent followed another thread (the first optimizer
        step came from this one, `hooks.training_thread`): its forwards ran unseen."""
        self._switch = switch
        self._registry = registry
        self._health = health
        self._budget = budget
        self.fsdp = False
        """FSDP wraps a model: every step is measured (its gathered parameters need the module
        hooks); set and cleared by the hooks side as it finds FSDP or turns that part off."""
        self.probing = health.watching_modules(1)
        """Whether the module hooks probe outputs for NaN/Inf in the step now open (`health`):
        decided as the step opens, read by every module call of the step."""

    @property
    def mode(self) -> ActivationMode:
        """The `--activations` mode now (`auto` becomes `every` when activations vary)."""
        return self.policy.mode

    # ----- events ------------------------------------------------------------------------------

    def started(self) -> None:
        """The hooks are installed: the first step is measured whatever the mode says (the
        models are found there); in `off` only the module hooks that find them run."""
        if self.policy.mode is not ActivationMode.OFF:
            self._switch.arm(None)
            self.policy.first_armed()
            self._blind = self._switch.pack_missing

    def optimizer_created(self) -> None:
        """An optimizer was built: its first steps allocate its state and settle the graph."""
        self.policy.measure_next(FIRST_STEPS)

    def first_step_begins(self) -> None:
        """An optimizer's first `step()` began (this step is already under way)."""
        self.policy.measure_next(FIRST_STEPS - 1)

    def parameters_found(self) -> None:
        """New parameters may exist: hook their gradients if this step is measured."""
        if self._switch.armed and self.policy.mode is not ActivationMode.OFF:
            self._switch.hook_new_parameters()

    def root_call(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], step: int
    ) -> None:
        """A top-level call of a root module (its forward pre-hook): arm from here if the step
        must be measured, or if its calls so far repeat no measured step."""
        self._call_first = next_sequence_number()
        # Which optimizers live, and whether each has its state yet: a new optimizer's first
        # step (state allocated) differs from its later ones at equal piles.
        alive = tuple(sorted((id(o), bool(o.state)) for o in self._registry.live_optimizers()))
        # Under the job's own saved-tensor hooks nothing can be counted: such a call repeats
        # none made without them, and arming for it would only cost the job.
        foreign = self._switch.foreign_hooks()
        signature = (call_signature(module, args, kwargs), foreign)
        if foreign:
            self._blind = True
        if self.policy.root_call(signature, step, self._must_measure(), alive) and (
            not foreign or self._must_measure()
        ):
            self._switch.arm(module)
        if self._switch.armed and self._switch.pack_missing:
            self._blind = True

    def forward_unseen(self) -> None:
        """A measured forward began where the agent's saved-tensor pair cannot count it (the job's
        own hooks on top): the open step's activations are not known."""
        self._blind = True

    def thread_moved(self) -> None:
        """The agent moved to the thread that stepped the first optimizer: the open step's
        forwards ran on it unseen, its activations are not known."""
        self._moved = True

    def root_returned(self, output: Any, step: int) -> None:
        """A top-level root call of step `step` returned `output`: its graph is watched until
        freed (whether the agent's pack hook counted what it saved is noted with it)."""
        switch = self._switch
        counted = switch.armed and not switch.pack_missing and not switch.foreign_hooks()
        self.held.mark(output, step, counted, self._call_first)

    def backward_starts(self, retain_graph: bool) -> None:
        """A top-level backward is starting (`retain_graph`: its graph keeps its buffers)."""
        self.signatures.backward()
        self.held.retaining = retain_graph

    def backward_ended(self) -> None:
        """The top-level backward returned or raised."""
        self.held.retaining = False

    def _must_measure(self) -> bool:
        """Reasons to measure the open step whatever its signature (docs/design.md#steps)."""
        # FSDP's gathered parameters and NaN probes need the module hooks.
        return self.fsdp or self.probing or self._budget.near()

    # ----- at the close ------------------------------------------------------------------------

    def verdict(self, reading: CloseReading) -> Verdict:
        """Whether the closing step's activations were measured, are carried from the measured
        step it repeats (with that step's figures), or are not known.

        This is where the measure/carry decision is made, from what the close read.
        """
        ledger = reading.ledger
        figures = Figures(
            step=reading.step,
            end_activations=ledger.end.activations,
            high=ledger.high,
            peak=ledger.peak,
            dtypes=ledger.dtypes.get(Pile.ACTIVATIONS, {}),
            top=tuple(ledger.top),
            signature=self.signatures.close(reading.allocator),
            start_activations=self._start_activations,
        )
        held = self.held.held()
        blind, self._blind = self._blind, False
        moved, self._moved = self._moved, False
        verdict = self.policy.close(reading.step, figures, blind=blind or moved)
        if self.policy.mode is ActivationMode.OFF:
            return verdict
        if held.graphs:
            # Graphs kept across this close: what the next steps build is counted by the pack
            # hook, the only record of what a graph saves.
            self.policy.measure_next(MEASURE_WHILE_HELD)
        if moved:
            return self._moved_verdict(reading.step)
        if blind:
            return self._blind_verdict(reading.step)
        if held.unarmed:
            return self._held_unarmed(reading.step, held, verdict)
        carried = verdict.carried
        if carried is None:
            return verdict
        reason = self._unconfirmed(carried, figures)
        self._recent.append(reason is None)
        if reason is None:
            return verdict
        return self._not_known(reading.step, carried, reason)

    def _unconfirmed(self, carried: Figures, figures: Figures) -> Mismatch | None:
        """Why the repeat does not stand (None: its counters confirm it)."""
        now, twin = figures.signature, carried.signature
        if not self.signatures.available or now is None or twin is None:
            return Mismatch(Difference.COUNTER, (), ())
        mismatch = compare(now, twin, carried.high.activations)
        if mismatch is not None:
            return mismatch
        held_now = (figures.start_activations, figures.end_activations)
        held_then = (carried.start_activations, carried.end_activations)
        if held_now != held_then:
            return Mismatch(Difference.HELD, held_now, held_then)
        return None

    def _not_known(self, step: int, carried: Figures, reason: Mismatch) -> Verdict:
        """A repeat whose counters differ from its twin's: not known, the next step measured;
        every step from now on when it keeps happening."""
        self.policy.measure_next(1)
        unconfirmed = sum(1 for confirmed in self._recent if not confirmed)
        if reason.what is Difference.COUNTER or (
            unconfirmed >= UNCONFIRMED_FOR_EVERY and self.policy.mode is ActivationMode.AUTO
        ):
            self.policy.mode = ActivationMode.EVERY
            repeats = (
                f"{unconfirmed} of the last {len(self._recent)} steps that repeated a measured "
                "step's calls"
            )
            if reason.what is Difference.COUNTER:
                why = "no carry can be confirmed in this job"
            elif reason.what is Difference.HEAP:
                why = (
                    f"{repeats} could not be confirmed by the heap, which also moves with what "
                    "memtui allocates while it measures (by more than the tolerance in this "
                    "job)"
                )
            else:
                why = (
                    f"{repeats} did something else: this job's activations change with what "
                    "its inputs do not show (LayerDrop, sampling, data-dependent branches)"
                )
            message = (
                f"step {step} called the model as step {carried.step} did, but "
                f"{reason.describe(carried.step)}; {why}, so every step is measured from now on"
            )
            return Verdict(measured=False, alert=self._vary("every step", message))
        if reason.what.structural:
            cause = (
                "something its inputs do not show changed (a layer skipped, dropout switched, "
                "a branch taken on the data)"
            )
        elif reason.what is Difference.HELD:
            cause = "graphs kept from earlier steps changed"
        elif reason.what is Difference.HEAP:
            cause = (
                "the same calls made tensors of other sizes, or memtui's own allocations while "
                "it measured moved the heap: the heap cannot tell which"
            )
        else:
            cause = "the same calls made tensors of other sizes"
        message = (
            f"step {step} called the model as step {carried.step} did, but "
            f"{reason.describe(carried.step)}: {cause}; its activations are not known and the "
            "next step is measured"
        )
        return Verdict(measured=False, alert=self._vary(reason.what.value, message))

    def _held_unarmed(self, step: int, held: Held, verdict: Verdict) -> Verdict:
        """Graphs built while the hooks were off are still held: no hook counted their saved
        tensors, and nothing else may (reading a graph's `_saved_*` would unpack: the job's
        hooks, a checkpoint's recomputed forward). So the activations of every close that
        finds them held are not known; steps are measured meanwhile (`MEASURE_WHILE_HELD`,
        every step once it happens again), so graphs built from now on are counted."""
        if held.new_unarmed:
            self._crossings += 1  # new graphs built unarmed, not the same ones held longer
        self.policy.measure_next(FIRST_STEPS)
        if held.unarmed == 1:
            which = "a graph built by the model while memtui's hooks were off still holds its"
        else:
            which = (
                f"{held.unarmed} graphs built by the model while memtui's hooks were off still "
                "hold their"
            )
        message = (
            f"at the close of step {step}, {which} saved tensors (a loss accumulated without "
            "torch.no_grad(), an output kept for a later backward): memtui never saw what they "
            "saved, so activations are not "
            "known while they are held; the steps after a close that holds graphs are measured, "
            "so graphs built from now on are counted"
        )
        cause = "held"
        if self._crossings >= CROSSINGS_FOR_EVERY and self.policy.mode is ActivationMode.AUTO:
            self.policy.mode = ActivationMode.EVERY
            cause = "held, every step"
            message += (
                "; graphs keep crossing steps in this job, so every step is measured from now on"
            )
        alert = self._vary(cause, message)
        if verdict.alert is not None and alert is None:
            alert = verdict.alert
        return Verdict(measured=False, alert=alert)

    def _moved_verdict(self, step: int) -> Verdict:
        """The step began on another thread than the one that closed it: not known, said once."""
        message = (
            f"step {step} began while memtui followed another thread, and this thread stepped "
            "the first optimizer: memtui follows that thread from here (one thread per "
            "recording), so the activations of this step's forward, which it did not see, are "
            "not known"
        )
        return Verdict(measured=False, alert=self._vary("thread moved", message))

    def _blind_verdict(self, step: int) -> Verdict:
        """The job's own saved-tensor hooks held the step's tensors: not known, said once."""
        message = (
            f"in step {step} the job's own saved-tensor hooks (torch.utils.checkpoint over the "
            "model, save_on_cpu, its own pack hooks) were active when the model ran: memtui does "
            "not put its own above them (that would change what the job saves), so the "
            "activations of such steps are not known"
        )
        return Verdict(measured=False, alert=self._vary("job hooks", message))

    def _vary(self, cause: str, message: str) -> schema.Alert | None:
        """An `activations_vary` alert, once per cause."""
        if cause in self._said:
            return None
        self._said.add(cause)
        return schema.Alert(kind=AlertKind.ACTIVATIONS_VARY, message=message)

    def step_opens(self, after: StepInputs) -> None:
        """A step opens after the step `after`: arm or disarm the hooks for it."""
        policy = self.policy
        self._start_activations = after.activations_left
        if after.skipped or any(alert.kind in ALERTS_TO_MEASURE for alert in after.alerts()):
            policy.measure_next(FIRST_STEPS)
        mode = policy.mode
        switch = self._switch
        if mode is ActivationMode.OFF or (mode is ActivationMode.AUTO and policy.saw_calls):
            switch.disarm()  # `auto`: the next root call decides
        elif mode is ActivationMode.EVERY:
            if not switch.armed:
                switch.arm(None)  # `auto` turned into `every` at an unarmed close
        elif mode is ActivationMode.AUTO:
            # No root module was called (a job of plain tensors): nothing to decide on, so the
            # next step is measured from its start.
            switch.arm(None)
        policy.begin(after.start_of_next())
        self._blind = False
        if mode is not ActivationMode.OFF and switch.armed:
            policy.first_armed()
            self._blind = switch.pack_missing
        self.probing = self._health.watching_modules(after.step + 1)
