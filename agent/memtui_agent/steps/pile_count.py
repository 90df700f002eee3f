"""The persistent piles (weights, gradients, optimizer state) counted again from the objects.

Hooks see most changes to these piles as they happen, but not all: reassigned buffers,
`p.data = ...`, state loaded from a checkpoint. So each close counts them again from the models
and optimizers themselves, as cheaply as that can be exact: weights and optimizer state only when
something says they may have changed (`pile_watch`), gradients at every close. While the
activation hooks are disarmed (`--activations auto`, between measured steps) no gradient hook
feeds the ledger, and the step's fresh gradients are counted beside it (`gradients`) instead of
joining it: a claim and a free callback per gradient per step would be most of an unmeasured
step's cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import msgspec

from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.memory.gradient_batch import GradientBatch, gather
from memtui_agent.memory.ledger import GRADIENTS, OPTIMIZER_STATE, WEIGHTS, Ledger, storages_of
from memtui_agent.steps.pile_watch import PileWatch
from memtui_protocol import schema

if TYPE_CHECKING:  # for annotations only
    import torch


class Armed(Protocol):
    """Whether the costly hooks (gradient hooks among them) are installed now."""

    @property
    def armed(self) -> bool: ...


class PersistentPiles:
    """Counts the persistent piles at a close and says what they hold between closes."""

    def __init__(self, registry: ModuleRegistry, ledger: Ledger, hooks: Armed) -> None:
        self._registry = registry
        self._ledger = ledger
        self._hooks = hooks
        self.watch = PileWatch(registry, ledger)
        self.walk_always = False
        """Walk weights and optimizer state at every close (FSDP reshards parameters)."""
        self.gradients: tuple[int, dict[str, schema.DtypeStat]] | None = None
        """The gradients pile at the last unarmed close (bytes, dtype inventory), counted
        outside the ledger; None when the ledger holds the gradients."""

    def resync(self, walk_all: bool = False) -> GradientBatch:
        """Recount the persistent piles from the objects themselves (at each step close).

        Weights and optimizer state are walked again only when they may have changed
        (`pile_watch`) or `walk_all` says so; gradients, new tensors at most steps, are read
        at every close. Returns the gradients, which the health check reads next.
        """
        registry = self._registry
        ledger = self._ledger
        watch = self.watch
        walk_all = walk_all or self.walk_always
        parameters = registry.parameters()
        key = watch.weights_key()
        if watch.due(WEIGHTS, key, walk_all):
            changed = ledger.sync(WEIGHTS, registry.weight_tensors(parameters))
            watch.walked(WEIGHTS, key, watch.weights_key(), changed)
        state_key = watch.state_key()
        if watch.due(OPTIMIZER_STATE, state_key, walk_all):
            changed = ledger.sync(OPTIMIZER_STATE, registry.optimizer_state_tensors())
            watch.walked(OPTIMIZER_STATE, state_key, watch.state_key(), changed)
        armed = self._hooks.armed
        if armed:  # the gradient hooks keep the ledger's pile: only the list is needed
            batch = GradientBatch(registry.gradients(parameters))
        else:
            batch = gather(parameters, watch.facts(parameters))
        summary = None
        if not armed:
            # Unarmed (`auto`, between measured steps): the step's fresh gradients are
            # counted without joining the ledger; joining costs a claim and a free callback
            # per gradient per step, most of an unmeasured step's cost.
            summary = batch.summary
            if summary is None or not ledger.pointers_elsewhere(GRADIENTS).isdisjoint(
                batch.pointers
            ):
                summary = ledger.summarize(GRADIENTS, batch.tensors)
        self.gradients = summary
        if summary is None:
            ledger.sync(GRADIENTS, batch.tensors)
        return batch

    def gradient_keys(self) -> frozenset[int]:
        """Storage keys of the gradients counted outside the ledger (between measured steps),
        which a census must leave out as the ledger's piles are; empty while the ledger holds
        them. A walk over the parameters: for a census only."""
        if self.gradients is None or self._hooks.armed:
            return frozenset()
        found = self._registry.gradients(self._registry.parameters())
        return frozenset(key for grad in found for key, _, _, _ in storages_of(grad))

    def gradients_rejoin(self, parameters: list[torch.Tensor]) -> None:
        """The gradient hooks are armed again: the gradients of `parameters` alive now are the
        ledger's again (a job that zeroes them after its forward, Lightning's closure, keeps
        them across the close), so this step's peak holds them as a run measured at every
        step does."""
        self._ledger.sync(GRADIENTS, self._registry.gradients(parameters))
        self._ledger.watching_gradients = True
        self.gradients = None

    def gradients_leave(self) -> None:
        """The gradient hooks are disarmed: gradients are counted at each close from here."""
        self._ledger.sync(GRADIENTS, [])
        self._ledger.watching_gradients = False

    def current(self) -> schema.Piles:
        """The piles now. Between measured steps the gradients are counted at each close
        outside the ledger (`resync`): the last close's count stands for them."""
        piles = self._ledger.current()
        summary = self.gradients
        if summary is not None and not self._hooks.armed:
            piles = msgspec.structs.replace(piles, gradients=summary[0])
        return piles
