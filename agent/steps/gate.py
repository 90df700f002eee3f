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
a measured step it repeats, or are not known. It takes the close's whole reading (`CloseReading`)
so that an exact confirmation of a carry (the CUDA allocator's allocated-at-close and peak against
the measured step's; exact CPU counters) goes inside it: a carry that fails it is "not known",
and the next step is measured. When a step opens, `step_opens` arms or disarms the hooks for it.

The gate installs nothing itself: the hooks side hands it a `HookSwitch`.
"""

from __future__ import annotations

from typing import Any, Protocol

from memtui_agent.job.modules import ModuleRegistry
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


class ActivationGate:
    """Arms the activation hooks for the steps that must be measured, and judges each close."""

    def __init__(
        self,
        mode: ActivationMode,
        switch: HookSwitch,
        registry: ModuleRegistry,
        health: HealthMonitor,
        budget: Budget,
    ) -> None:
        self.policy = ActivationPolicy(mode)
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
        # Which optimizers live, and whether each has its state yet: a new optimizer's first
        # step (state allocated) differs from its later ones at equal piles.
        alive = tuple(sorted((id(o), bool(o.state)) for o in self._registry.live_optimizers()))
        signature = call_signature(module, args, kwargs)
        if self.policy.root_call(signature, step, self._must_measure(), alive):
            self._switch.arm(module)

    def _must_measure(self) -> bool:
        """Reasons to measure the open step whatever its signature (DESIGN.md, issue 15)."""
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
        )
        return self.policy.close(reading.step, figures)

    def step_opens(self, after: StepInputs) -> None:
        """A step opens after the step `after`: arm or disarm the hooks for it."""
        policy = self.policy
        if any(alert.kind in ALERTS_TO_MEASURE for alert in after.alerts()):
            policy.measure_next(FIRST_STEPS)
        mode = policy.mode
        switch = self._switch
        if mode is ActivationMode.OFF or (mode is ActivationMode.AUTO and policy.saw_calls):
            switch.disarm()  # `auto`: the next root call decides
        elif mode is ActivationMode.AUTO:
            # No root module was called (a job of plain tensors): nothing to decide on, so the
            # next step is measured from its start.
            switch.arm(None)
        policy.begin(after.start_of_next())
        if mode is not ActivationMode.OFF and switch.armed:
            policy.first_armed()
        self.probing = self._health.watching_modules(after.step + 1)
