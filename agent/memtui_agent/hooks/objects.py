"""New model trees and optimizers: registered, hooked and counted once each appears.

The module registry's generation moves whenever a root or an optimizer is registered; the
agent keeps the generation it last synced with (`Watermark`), shared by the two places that
catch up: a forward or an optimizer step of the followed thread (`ObjectSync.new_objects`: root
hooks, gradient hooks, data-parallel wrappers, the persistent piles) and a step's close
(`CloseSync.before_close`: gradient hooks only, and every `HOOK_NEW_PARAMETERS_EVERY` closes
for parameters unfrozen since).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memtui_agent.hooks.context import HookContext
from memtui_agent.hooks.data_parallel import DataParallelHooks
from memtui_agent.hooks.root_calls import RootHooks
from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.steps.gate import ActivationGate
from memtui_protocol import schema

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer

HOOK_NEW_PARAMETERS_EVERY = 64
"""Closes between looks for parameters unfrozen since (their gradients are counted at each
close meanwhile; a gradient hook only makes the timing exact)."""


@dataclass
class Watermark:
    """The registry generation the hooks last caught up with."""

    generation: int = 0


class CloseSync:
    """What the hooks side does and knows at a close (`steps.step_closer.CloseHooks`)."""

    def __init__(
        self,
        registry: ModuleRegistry,
        gate: ActivationGate,
        data_parallel: DataParallelHooks,
        watermark: Watermark,
    ) -> None:
        self._registry = registry
        self._gate = gate
        self._data_parallel = data_parallel
        self._watermark = watermark

    def before_close(self, step: int) -> None:
        """Hook parameters found since, before the piles are counted."""
        if (
            self._registry.generation != self._watermark.generation
            or (step - 1) % HOOK_NEW_PARAMETERS_EVERY == 0
        ):
            self._watermark.generation = self._registry.generation
            self._gate.parameters_found()

    def distributed_at_close(self) -> schema.Distributed | None:
        """The wrappers' memory at a close."""
        return self._data_parallel.at_close()


class ObjectSync:
    """Registers and hooks what appeared since the last look (new roots, optimizers)."""

    def __init__(
        self,
        context: HookContext,
        roots: RootHooks,
        data_parallel: DataParallelHooks,
        watermark: Watermark,
    ) -> None:
        self._context = context
        self._roots = roots
        self._data_parallel = data_parallel
        self.watermark = watermark
        """Read by the hottest hook (`counting.CountingHooks.module_pre`) directly."""

    def sync_objects(self) -> None:
        """Register and hook what appeared since the last look, if anything did."""
        if self._context.registry.generation != self.watermark.generation:
            self.new_objects()

    def new_objects(self) -> None:
        """A new model tree or optimizer appeared: count its weights and hook its parameters.

        Only on the followed thread (`Agent.watch` may be called on any): another thread would
        read the followed thread's gradients while its backward writes them. The followed
        thread does it at its next forward or close instead."""
        context = self._context
        with context.thread.following() as followed:
            if not followed:
                return
            self.watermark.generation = context.registry.generation
            self._roots.hook_roots()
            context.gate.parameters_found()
            self._data_parallel.discover(context.registry.live_roots())
            context.piles.resync()

    def watch(self, model: nn.Module | None, optimizer: Optimizer | None) -> None:
        """Register a model tree and an optimizer ahead of their first use (`Agent.watch`),
        only from the followed thread: another thread's model is that thread's."""
        context = self._context
        with context.thread.following() as followed:
            if not followed:
                return
            if model is not None:
                context.registry.lookup(model)
            if optimizer is not None:
                context.registry.add_optimizer(optimizer)
            self.new_objects()
