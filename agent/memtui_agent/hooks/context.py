"""What the hooks share: one frozen context, built once (`startup.parts.build_parts`).

Every hook class reads a few of the same parts of the agent: the training phase and module
stack, the followed thread, the on/off switches, the module registry, the step window, the
activation gate, the optimizers' book, the ledger and the persistent piles. They get them as one
`HookContext` instead of a long list of constructor parameters; what only one hook class needs
is its own parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

from memtui_agent.hooks.phase import JobPhase
from memtui_agent.hooks.switches import HookSwitches
from memtui_agent.hooks.training_thread import TrainingThread
from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.job.optimizer_book import OptimizerBook
from memtui_agent.memory.ledger import Ledger
from memtui_agent.steps.gate import ActivationGate
from memtui_agent.steps.pile_count import PersistentPiles
from memtui_agent.steps.window import StepWindow


@dataclass(frozen=True)
class HookContext:
    """The parts of the agent the hooks report to and read."""

    phase: JobPhase
    thread: TrainingThread
    """The one thread followed (`training_thread`): every other thread's calls pass through."""
    switches: HookSwitches
    registry: ModuleRegistry
    window: StepWindow
    gate: ActivationGate
    optimizers: OptimizerBook
    ledger: Ledger
    piles: PersistentPiles
