"""What the agent asks of its parts, and the parts of an agent that has not started.

`Agent` imports torch only in `start()`, so it cannot name the built parts' type
(`startup.parts.AgentParts`) at import. It names this protocol instead, and holds `NOT_STARTED`
until `start()` builds the parts: one explicit "not started" state, so no caller checks for a
missing tracker. Every question has a name that says what it asks (`final_leaks()`,
`last_oom()`); the answer of an agent that never started is "nothing known".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from memtui_agent.steps.failures import ErrorContext
from memtui_protocol import schema
from memtui_protocol.schema import Phase, StepTrigger

if TYPE_CHECKING:  # the agent imports torch only in `start()`
    from torch import nn
    from torch.optim import Optimizer


@dataclass(frozen=True)
class Position:
    """Where the agent last saw the job: the end frame's inputs that the parts know."""

    step: int | None = None
    """The step open now (`StepWindow.number`)."""
    closed: int | None = None
    """The last step closed (`StepWindow.closed`)."""
    phase: Phase | None = None
    context: ErrorContext | None = None
    """Where the exception now propagating was first seen."""
    piles: schema.Piles | None = None


class Parts(Protocol):
    """The agent's parts, as the agent, `memtui attach` and the joining see them."""

    def install(self) -> None:
        """Register every hook (on the thread that runs the forward)."""
        ...

    def remove(self) -> None:
        """Remove every hook and wrapper."""
        ...

    def stop_sampling(self) -> None:
        """Stop the DataLoader workers' sampler thread (the agent leaves)."""
        ...

    def disable(self) -> None:
        """Every hook off, then removed (a forked child that never trains)."""
        ...

    def tick(self) -> schema.Tick | None:
        """Live piles for the emitter's once-a-second heartbeat."""
        ...

    def watch(self, model: nn.Module | None, optimizer: Optimizer | None) -> None:
        """Register a model tree and an optimizer ahead of their first use."""
        ...

    def own_heap(self, held: Callable[[], int]) -> None:
        """`held`: what the agent's own frame log holds in the job's heap, taken out of what
        the leak watch reads on a CPU (`StepCloser.own_bytes`)."""
        ...

    def arm_alloc_events(
        self, fail: Callable[[str, BaseException], None], note: Callable[[str, str], None]
    ) -> None:
        """`--alloc-events`: drain the allocator's history at every close."""
        ...

    def alloc_events_never_started(self) -> bool:
        """`--alloc-events` was armed but the job never used CUDA."""
        ...

    def unfinished_alloc_events(self) -> schema.AllocEvents | None:
        """What the allocator did after the last close (up to an OOM)."""
        ...

    def readable_at_end(self) -> bool:
        """Whether the job's tensors may be read now: the followed thread is not training
        elsewhere meanwhile (`hooks.training_thread`)."""
        ...

    def settle_at_end(self, readable: bool) -> None:
        """Release a held GradScaler skip; recount the piles from the objects alive now
        (only where `readable`)."""
        ...

    def late_health(self) -> list[schema.StepLate]:
        """Late health values of the last steps, waited for (the end of the job may wait)."""
        ...

    def final_leaks(
        self, namespace: dict[str, Any] | None, error: BaseException | None
    ) -> list[schema.Leak]:
        """The leaks named during the run, as a census finds them now (`namespace`: the
        script's globals, any object of the job's)."""
        ...

    def last_oom(self) -> dict[str, int] | None:
        """The allocator's last failed allocation, as observed."""
        ...

    def position(self) -> Position:
        """Where the job is now: open and closed step, phase, error context, piles."""
        ...

    def owner_thread(self) -> int | None:
        """The thread the hooks follow (None: none)."""
        ...

    def pack_removable(self) -> bool:
        """Whether the agent's saved-tensor pair is on top here and may be popped."""
        ...

    def steps_recorded(self) -> tuple[int, int]:
        """(the last step closed, the steps this agent recorded)."""
        ...

    def adopt_running_optimizer(self, optimizer: Optimizer, steps: int) -> None:
        """An optimizer whose first step is long past (an attach): no forecast, no first-step
        growth for it, its own count going on from `steps`."""
        ...

    def join_steps(self, trigger: StepTrigger, steps_before: int, alert: schema.Alert) -> None:
        """An attach joins a running job: what closes its steps, their numbering, and the
        alert that says so."""
        ...

    def feed_module_pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        """Run the module pre-hook by hand (an attach joining at a forward already begun)."""
        ...


class NotStarted:
    """The parts of an agent that has not started (or failed to): nothing installed, nothing
    known, nothing to remove."""

    def install(self) -> None:
        raise RuntimeError("the agent's parts are not built (Agent.start)")

    def remove(self) -> None:
        pass

    def stop_sampling(self) -> None:
        pass

    def disable(self) -> None:
        pass

    def tick(self) -> schema.Tick | None:
        return None

    def watch(self, model: nn.Module | None, optimizer: Optimizer | None) -> None:
        pass

    def own_heap(self, held: Callable[[], int]) -> None:
        pass

    def arm_alloc_events(
        self, fail: Callable[[str, BaseException], None], note: Callable[[str, str], None]
    ) -> None:
        pass

    def alloc_events_never_started(self) -> bool:
        return False

    def unfinished_alloc_events(self) -> schema.AllocEvents | None:
        return None

    def readable_at_end(self) -> bool:
        return False

    def settle_at_end(self, readable: bool) -> None:
        pass

    def late_health(self) -> list[schema.StepLate]:
        return []

    def final_leaks(
        self, namespace: dict[str, Any] | None, error: BaseException | None
    ) -> list[schema.Leak]:
        return []

    def last_oom(self) -> dict[str, int] | None:
        return None

    def position(self) -> Position:
        return Position()

    def owner_thread(self) -> int | None:
        return None

    def pack_removable(self) -> bool:
        return False

    def steps_recorded(self) -> tuple[int, int]:
        return (0, 0)

    def adopt_running_optimizer(self, optimizer: Optimizer, steps: int) -> None:
        pass

    def join_steps(self, trigger: StepTrigger, steps_before: int, alert: schema.Alert) -> None:
        pass

    def feed_module_pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        pass


NOT_STARTED = NotStarted()
"""The one not-started state (it holds nothing)."""
