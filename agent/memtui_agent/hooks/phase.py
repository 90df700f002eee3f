"""Where the training thread is: forward (module stack, root calls), backward, optimizer, between.

The module hooks push and pop the stack, the backward wrapper counts nested backwards, the
optimizer hooks mark the top-level `step()`, the root hooks count root calls in progress. The
phase is what a tick shows and what an exception is attributed to (`note_error`).
"""

from __future__ import annotations

import sys

from memtui_agent.steps.failures import ErrorContext
from memtui_protocol.schema import Phase


class JobPhase:
    """The training thread's position in the step, kept by the hooks."""

    def __init__(self) -> None:
        self.stack: list[int] = []
        """Module ids of the forwards in progress, innermost last (activations go to the last)."""
        self.in_backward = 0
        self.in_optimizer = False
        self.root_depth = 0
        """Root calls in progress on the training thread (a root called inside another counts
        as nested, not as a new top-level call)."""
        self.error_context: ErrorContext | None = None
        """Where the exception now propagating was first seen (the End frame says it)."""

    def now(self) -> Phase:
        """The training phase right now."""
        if self.in_optimizer:
            return Phase.OPTIMIZER
        if self.in_backward:
            return Phase.BACKWARD
        if self.stack or self.root_depth:
            return Phase.FORWARD
        return Phase.BETWEEN

    def note_error(self, phase: Phase, where: str | None) -> None:
        """Remember where the exception now propagating started (first sighting wins).

        Only the exception's identity is kept, never the object: holding it would pin its
        traceback, and with it every frame's tensors (checkpointing raises through modules).
        """
        error = sys.exc_info()[1]
        noted = self.error_context
        if error is None or (noted is not None and noted.matches(error)):
            return
        self.error_context = ErrorContext.of(error, phase, where)
