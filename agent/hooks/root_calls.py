"""Root calls: the input signature of each step, and arming a step that must be measured.

A forward pre/post hook on each root module stays installed whatever `--activations` says: one
call per top-level forward, which gives the step's input signature (`activation_policy`) and
arms the costly hooks (`hook_arming`) for a step that must be measured. At the close, the step's
activation figures are labelled measured, carried (a repeat's, copied from the step it repeats)
or not known, and the hooks are disarmed for the next step (`auto`). Mixed into `Tracker`, whose
state (registry, ledger, policy, arming, module stack) it uses.
"""

from __future__ import annotations

import sys
from threading import get_ident
from typing import Any

import msgspec
from torch.compiler import is_compiling

from memtui_agent.hooks.hook_arming import forget_when_freed
from memtui_agent.memory.ledger import GRADIENTS
from memtui_agent.steps.activation_policy import FIRST_STEPS, Figures, call_signature
from memtui_agent.steps.pending import PendingStep
from memtui_protocol import schema

ALERTS_TO_MEASURE = frozenset(
    {
        schema.AlertKind.NONFINITE_LOSS,
        schema.AlertKind.NONFINITE_ACTIVATION,
        schema.AlertKind.NONFINITE_GRADIENT,
        schema.AlertKind.SKIPPED_STEP,
        schema.AlertKind.OVER_BUDGET,
        schema.AlertKind.FRAGMENTATION,
    }
)
"""Alerts after which the next steps are measured (`auto`): whatever happens next is seen
with every hook on."""


class RootCalls:
    """The per-root hooks and the close-time labelling of activations.

    The attributes below are the Tracker state they share (declared here for readers); the
    methods they call back (`_note_error`, `_disable`) are Tracker's.
    """

    registry: Any
    ledger: Any
    closer: Any
    policy: Any
    arming: Any
    enabled: dict[str, bool]
    owner_thread: int
    closed_steps: int
    _root_hooked: dict[int, tuple[Any, list[Any]]]
    _root_depth: int
    _stack: list[int]
    _in_optimizer: bool
    _fsdp: bool
    gradient_summary: Any

    def _hook_roots(self) -> None:
        """A forward pre/post hook on each root module: one call per top-level forward, which
        stays installed when the costly hooks are off (their signature decides arming)."""
        hooked = self._root_hooked
        for root in self.registry.live_roots():
            known = hooked.get(id(root))
            if known is not None and known[0]() is root:
                continue
            handles = [
                root.register_forward_pre_hook(self._root_pre, with_kwargs=True),
                root.register_forward_hook(self._root_post, always_call=True),
            ]
            hooked[id(root)] = (forget_when_freed(root, hooked), handles)

    def _root_pre(self, module: Any, args: Any, kwargs: Any = None) -> None:
        # `kwargs` may be missing: when the agent is removed (detach) from a global pre-hook of
        # the same call, torch still calls this hook from its copied list, but without the
        # keyword arguments (its with-kwargs mark left with the handle). Never an error then.
        if is_compiling() or get_ident() != self.owner_thread or not self._root_hooked:
            return
        self._root_depth += 1
        if self._root_depth > 1:
            return  # a root called inside another root's forward
        try:
            self._in_optimizer = False
            step = self.closed_steps + 1
            must = self._must_measure(step)
            # Which optimizers live, and whether each has its state yet: a new optimizer's
            # first step (state allocated) differs from its later ones at equal piles.
            alive = tuple(sorted((id(o), bool(o.state)) for o in self.registry.live_optimizers()))
            signature = call_signature(module, args, kwargs or {})
            if self.policy.root_call(signature, step, must, alive):
                self._arm_now(module)
        except Exception as exc:
            self._disable("activations", exc)

    def _root_post(self, module: Any, args: Any, output: Any) -> None:
        if is_compiling() or get_ident() != self.owner_thread:
            return
        self._root_depth = max(0, self._root_depth - 1)
        if self._root_depth:
            return
        try:
            if sys.exc_info()[1] is not None and not self.arming.modules_armed:
                # Unarmed, the module hooks that say where a forward failed are off.
                where = self.registry.name(self.registry.lookup(module))
                self._note_error(schema.Phase.FORWARD.value, where)
            self.arming.pop_pack(scoped_only=True)
        except Exception as exc:
            self._disable("activations", exc)

    def _must_measure(self, step: int) -> bool:
        """Reasons to measure a step whatever its signature (DESIGN.md, issue 15)."""
        closer = self.closer
        if self._fsdp or closer.health.watching_modules(step):
            return True  # FSDP's gathered parameters and NaN probes need the module hooks
        budget = closer.budget
        peak = closer.previous_peak
        return budget is not None and peak is not None and peak.total * 10 >= budget * 9

    def _arm_now(self, root: Any) -> None:
        """Arm the costly hooks from inside a root's pre-hook: the root's own global pre-hook
        has already been skipped, so it goes on the module stack here."""
        parameters = self.registry.parameters()
        self.arming.arm(parameters)
        # Gradients still alive from the last step (a job that zeroes them after its forward,
        # Lightning's closure) left the ledger when it disarmed: they are back in the piles from
        # here, so this step's peak composition holds them as a measured-every-step run's does.
        self.ledger.sync(GRADIENTS, self.registry.gradients(parameters))
        self.gradient_summary = None
        if self.enabled["modules"]:
            self._stack.append(self.registry.lookup(root))

    def _close_activations(self, pending: PendingStep) -> None:
        """Label the closing step's activations (measured, carried or unknown), carry a repeat's
        figures into its frame, and disarm for the next step (`auto`)."""
        figures = Figures(
            step=pending.step,
            end_activations=pending.end.activations,
            high=pending.high,
            peak=pending.peak,
            dtypes=pending.dtypes.get("activations", {}),
            top=tuple(pending.top),
        )
        verdict = self.policy.close(pending.step, figures)
        pending.activations_measured = verdict.measured
        carried = verdict.carried
        if carried is not None:
            pending.activations_from = carried.step
            pending.end = msgspec.structs.replace(pending.end, activations=carried.end_activations)
            pending.high = carried.high
            pending.peak = carried.peak
            pending.dtypes = {**pending.dtypes, "activations": carried.dtypes}
            pending.top = list(carried.top)
        if verdict.alert is not None:
            pending.alerts.append(verdict.alert)
        over_budget = self.closer.judge_peak(pending.peak)
        if over_budget is not None:
            pending.alerts.append(over_budget)
        if any(alert.kind in ALERTS_TO_MEASURE for alert in pending.alerts):
            self.policy.measure_next(FIRST_STEPS)
        mode = self.policy.mode
        if mode is schema.ActivationMode.OFF or (
            mode is schema.ActivationMode.AUTO and self.policy.saw_calls
        ):
            self.arming.disarm()
            self._stack.clear()
            self.ledger.sync(GRADIENTS, [])  # counted by `summarize` until the next arming
        elif mode is schema.ActivationMode.AUTO:
            # No root module was called (a job of plain tensors): nothing to decide on, so the
            # next step is measured from its start.
            self.arming.arm(self.registry.parameters())
        self.policy.begin(pending.end)
        if mode is not schema.ActivationMode.OFF and self.arming.armed:
            self.policy.first_armed()
