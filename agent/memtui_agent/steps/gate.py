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
  `ALERTS_TO_MEASURE`;
- a job that has run `torch.compile`d code (`job.compiled`): `auto` becomes `every` and the
  hooks stay, since dynamo's guards read torch's global module hooks.

At a close, `verdict` gathers what the close read (the ledger's figures, the step's counters,
the graphs still held, whether a forward ran unseen), asks `decision.decide` whether the step's
activation figures were measured, are carried from a measured step it repeats, or are not known,
and applies the decision (`_apply`): the mode changes there and only there, with the steps
measured next (which the events above also raise), and the alert is worded by cause and said
once (`activation_wording`). When a step opens, `step_opens` arms or disarms the hooks for it.

The gate installs nothing itself: the hooks side hands it a `HookSwitch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from memtui_agent.job.compiled import has_compiled
from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.memory.tensor_reads import next_sequence_number
from memtui_agent.steps.activation_cause import Cause
from memtui_agent.steps.activation_policy import (
    FIRST_STEPS,
    ActivationPolicy,
    Figures,
    Verdict,
    call_signature,
)
from memtui_agent.steps.activation_wording import COMPILED_NOTE, SaidOnce
from memtui_agent.steps.budget import Budget
from memtui_agent.steps.decision import (
    MEASURE_WHILE_HELD,
    ActivationReading,
    Decision,
    DecisionState,
    decide,
)
from memtui_agent.steps.frame import CloseReading, StepInputs
from memtui_agent.steps.health import HealthMonitor
from memtui_agent.steps.held_graphs import Adopter, HeldGraphs
from memtui_agent.steps.hook_share import Costs
from memtui_agent.steps.step_signature import SignatureRecorder
from memtui_protocol.schema import ActivationMode, Alert, AlertKind, Pile

if TYPE_CHECKING:  # for annotations only
    from torch import nn

__all__ = ["ALERTS_TO_MEASURE", "MEASURE_WHILE_HELD", "ActivationGate", "HookSwitch"]
"""`MEASURE_WHILE_HELD` is the decision's, named here too where the gate's users find it."""

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


class HookSwitch(Protocol):
    """The costly hooks, as the gate switches them (implemented on the hooks side)."""

    @property
    def armed(self) -> bool:
        """Whether the module, saved-tensor and gradient hooks are installed."""
        ...

    def arm(self, root: nn.Module | None) -> None:
        """Install them; `root` is the root module whose forward is starting (or None)."""
        ...

    def disarm(self) -> None:
        """Remove them (the saved-tensor pair once it is on top of its stack)."""
        ...

    @property
    def installed(self) -> bool:
        """Whether any of them is still installed (armed, or a pair or gradient hook that a
        disarm left): else a disarm has nothing to remove."""
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

    @property
    def saved_hooks_disabled(self) -> bool:
        """torch has disabled saved-tensor hooks on this thread now (a torch.func transform runs):
        no pair can be pushed, the job's or the agent's."""
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
        costs: Costs | None = None,
        own: Callable[[], int] | None = None,
        adopt: Adopter | None = None,
    ) -> None:
        """`heap` reads glibc's bytes in use (`step_signature.heap_reader`), for the CPU's half
        of a carry's confirmation; None where there is no such counter. `costs`: the agent's
        own heap bytes per saved tensor (`hook_share.calibrate`), and `own` those of its tables
        (`Ledger.own_bytes`), taken off a measured step's reading. `adopt` takes into the
        activations pile a value a counted graph saved without any hook (a Python number
        wrapped as a tensor: `hooks.saved_tensors.UnhookedSaves`)."""
        self._adopt = adopt
        self.policy = ActivationPolicy(mode)
        self.signatures = SignatureRecorder(heap, costs, own)
        self.held = HeldGraphs()
        self._start_activations = 0
        """Activations held as the open step began (graphs kept from earlier steps)."""
        self._state = DecisionState(mode)
        """The mode and the history the next close's decision weighs."""
        self._said = SaidOnce()
        self._blind = False
        """A forward of the open step ran where the agent's saved-tensor pair could not count
        it (the job's own hooks on top): the step's activations are not known."""
        self._disabled = False
        """Part of the open step ran where torch disables saved-tensor hooks (torch.func's
        transforms): the step's activations are not known."""
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
        self._compiled = False
        """The job has run `torch.compile`d code (kept: dynamo's counters can be reset)."""

    @property
    def mode(self) -> ActivationMode:
        """The `--activations` mode now (`auto` becomes `every` when activations vary)."""
        return self._state.mode

    # ----- events ------------------------------------------------------------------------------

    def started(self) -> None:
        """The hooks are installed: the first step is measured whatever the mode says (the
        models are found there); in `off` only the module hooks that find them run."""
        if self.policy.mode is not ActivationMode.OFF:
            self.signatures.aside(lambda: self._switch.arm(None))
            self.policy.first_armed()
            self._blind = self._switch.pack_missing

    def optimizer_created(self) -> None:
        """An optimizer was built: its first steps allocate its state and settle the graph."""
        self.policy.measure_next(FIRST_STEPS, Cause.FIRST_STEPS)

    def first_step_begins(self) -> None:
        """An optimizer's first `step()` began (this step is already under way)."""
        self.policy.measure_next(FIRST_STEPS - 1, Cause.FIRST_STEPS)

    def parameters_found(self) -> None:
        """New parameters may exist: hook their gradients if this step is measured."""
        if self._switch.armed and self.policy.mode is not ActivationMode.OFF:
            self.signatures.aside(self._switch.hook_new_parameters)

    def root_call(
        self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object], step: int
    ) -> None:
        """A top-level call of a root module (its forward pre-hook): arm from here if the step
        must be measured, or if its calls so far repeat no measured step."""
        self.signatures.root_call()
        self._call_first = next_sequence_number()
        # Which optimizers live, and whether each has its state yet: a new optimizer's first
        # step (state allocated) differs from its later ones at equal piles.
        alive = tuple(sorted((id(o), bool(o.state)) for o in self._registry.live_optimizers()))
        # Under the job's own saved-tensor hooks nothing can be counted: such a call repeats
        # none made without them, and arming for it would only cost the job.
        foreign = self._switch.foreign_hooks()
        signature = (call_signature(module, args, kwargs), foreign)
        if foreign:
            self._unseen()
        if self.policy.root_call(signature, step, self._must_measure(), alive) and (
            not foreign or self._must_measure()
        ):
            self.signatures.aside(lambda: self._switch.arm(module))
        if self._switch.armed and self._switch.pack_missing:
            self._unseen()
        if self.probing:
            self._health.forward_starts()  # which call makes a NaN (`nan_origin`)

    def forward_unseen(self) -> None:
        """A measured forward began where the agent's saved-tensor pair cannot count it (the job's
        own hooks on top): the open step's activations are not known."""
        self._unseen()

    def _unseen(self) -> None:
        """What the open step runs now reaches no hook of the agent's: because torch disabled
        saved-tensor hooks (a torch.func transform runs the model), or because the job's own
        hooks are on top. Either way its activations are not known, each said with its cause."""
        if self._switch.saved_hooks_disabled:
            self._disabled = True
        else:
            self._blind = True

    def hooks_disabled(self) -> None:
        """The job entered a region where torch disables saved-tensor hooks (torch.func's
        grad, vjp, jacrev, hessian): the agent's pair left for it, and what it saves there is
        not counted: the open step's activations are not known."""
        self._disabled = True

    def thread_moved(self) -> None:
        """The agent moved to the thread that stepped the first optimizer: the open step's
        forwards ran on it unseen, its activations are not known."""
        self._moved = True

    def root_returned(self, output: object, step: int) -> None:
        """A top-level root call of step `step` returned `output` (whatever the job's model
        returns: `held_graphs` finds its tensors): its graph is watched until freed (whether
        the agent's pack hook counted what it saved is noted with it)."""
        switch = self._switch
        counted = switch.armed and not switch.pack_missing and not switch.foreign_hooks()
        self.held.mark(output, step, counted, self._call_first, self._adopt)

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
        step it repeats (with that step's figures), or are not known: gathers what the close
        read, asks `decide`, applies its decision."""
        ledger = reading.ledger
        figures = Figures(
            step=reading.step,
            end_activations=ledger.end.counted()[3],
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
        disabled, self._disabled = self._disabled, False
        match = self.policy.close(reading.step, figures, blind=blind or moved or disabled)
        close = ActivationReading(
            step=reading.step,
            figures=figures,
            match=match,
            graphs_held=held.graphs,
            unarmed_held=held.unarmed,
            new_unarmed=held.new_unarmed,
            blind=blind,
            disabled=disabled,
            moved=moved,
            counter=self.signatures.available,
            compiled=self._compiled_now(),
        )
        return self._apply(decide(self._state, close))

    def _compiled_now(self) -> bool:
        """Whether the job has compiled by this close (`job.compiled`)."""
        if not self._compiled and self._state.mode is ActivationMode.AUTO:
            self._compiled = has_compiled()
        return self._compiled

    def _apply(self, decision: Decision) -> Verdict:
        """The one place a decision takes effect: the mode, the steps measured next, the
        history, and the alert (each cause said once)."""
        self._state = decision.next_state
        self.policy.mode = decision.next_mode
        self.policy.measure_next(decision.measure_next, decision.measure_why)
        if decision.mismatch is not None:
            # A repeat its counters did not confirm: its twin stands for it no more, so the
            # next step with the same calls is measured and becomes the twin.
            self.policy.forget_closed()
        said = self._said
        alert = said.alert(decision)
        note = Alert(kind=AlertKind.COMPILED, message=COMPILED_NOTE) if decision.compiled else None
        return replace(decision.verdict, alert=alert, note=note, why_at=said.said_at(decision))

    def step_opens(self, after: StepInputs) -> None:
        """A step opens after the step `after`: arm or disarm the hooks for it."""
        policy = self.policy
        self._start_activations = after.activations_left
        if after.skipped or any(alert.kind in ALERTS_TO_MEASURE for alert in after.alerts()):
            policy.measure_next(FIRST_STEPS, Cause.AFTER_ALERT)
        mode = policy.mode
        switch = self._switch
        if mode is ActivationMode.OFF or (mode is ActivationMode.AUTO and policy.saw_calls):
            # `auto`: the next root call decides. A carried step after a carried one has nothing
            # installed: its disarm moves no heap, and two heap readings (60-80 us each on
            # benchmarks' `stack`) would be a tenth of what such a step costs the job.
            if switch.installed:
                self.signatures.aside(switch.disarm)
            else:
                switch.disarm()
        elif mode is ActivationMode.EVERY:
            if not switch.armed:
                # `auto` turned into `every` at an unarmed close.
                self.signatures.aside(lambda: switch.arm(None))
        elif mode is ActivationMode.AUTO:
            # No root module was called (a job of plain tensors): nothing to decide on, so the
            # next step is measured from its start.
            self.signatures.aside(lambda: switch.arm(None))
        policy.begin(after.start_of_next())
        self._blind = False
        self._disabled = False
        if mode is not ActivationMode.OFF and switch.armed:
            policy.first_armed()
            self._blind = switch.pack_missing
        self.probing = self._health.watching_modules(after.step + 1)
