"""Every optimizer the job steps, held weakly, with its name, step count and first-step facts.

docs/design.md#steps: each top-level `step()` of any optimizer closes a frame that names it
(`AdamW#1`: class, index in order of first top-level step). A `step()` that runs inside another
optimizer's `step()` (ZeroRedundancyOptimizer's inner optimizer, wrappers) belongs to the outer
one. Nothing here keeps an optimizer alive: records are keyed weakly by identity, and the outer
step in progress is remembered by a weakref and the id of torch's step wrapper frame.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import TYPE_CHECKING

from torch.utils.weak import WeakIdKeyDictionary

from memtui_agent.job.forecast import Forecast

if TYPE_CHECKING:
    import torch


@dataclass
class OptimizerRecord:
    """What the agent remembers of one optimizer (never the optimizer itself)."""

    kind: str
    """Its class name."""
    name: str | None = None
    """`AdamW#1`, given at its first top-level step; None while it has only stepped nested."""
    steps: int = 0
    """Top-level steps it closed, skipped ones included."""
    forecasted: bool = False
    """Its first `step()` began: state measured and forecast (once, even if that step raised)."""
    first_step_done: bool = False
    forecast: Forecast | None = None
    state_before: int = 0
    """Bytes of its state just before its first `step()` (Adagrad creates state up front)."""


@dataclass
class _OuterStep:
    """The top-level `step()` now running: whose, and which wrapper frame runs it."""

    optimizer: weakref.ref[torch.optim.Optimizer]
    frame_id: int
    code: CodeType


class OptimizerBook:
    """Names, counts and the nesting of `step()` calls, for every optimizer seen stepping."""

    def __init__(self) -> None:
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._named = 0
        self._outer: _OuterStep | None = None

    def record(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        """The record of `optimizer`, made on first sight."""
        found: OptimizerRecord | None = self._records.get(optimizer)
        if found is None:
            found = self._records[optimizer] = OptimizerRecord(kind=type(optimizer).__name__)
        return found

    def get(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord | None:
        """The record of `optimizer` if it was seen."""
        found: OptimizerRecord | None = self._records.get(optimizer)
        return found

    def enter(self, optimizer: torch.optim.Optimizer, wrapper: FrameType) -> bool:
        """A `step()` starts (its pre hook, `wrapper` being torch's step wrapper frame).

        Returns whether it is a top-level step. An outer step that raised never ran its post
        hook; it is recognised as over when its wrapper frame is no longer on the stack.
        """
        if self._outer is not None and self._outer_running(wrapper):
            return False
        self._outer = _OuterStep(weakref.ref(optimizer), id(wrapper), wrapper.f_code)
        self._named_record(optimizer)
        return True

    def leave(self, optimizer: torch.optim.Optimizer, wrapper: FrameType) -> OptimizerRecord | None:
        """A `step()` returned (its post hook). The record when it was the top-level one, whose
        step count then grows; None for a nested step."""
        outer = self._outer
        if outer is None or outer.optimizer() is not optimizer or outer.frame_id != id(wrapper):
            return None
        self._outer = None
        return self.count_step(optimizer)

    def count_step(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        """One more top-level step of `optimizer` (a GradScaler skip counts as one)."""
        record = self._named_record(optimizer)
        record.steps += 1
        return record

    def _named_record(self, optimizer: torch.optim.Optimizer) -> OptimizerRecord:
        """Its record, named at its first top-level step (index in order of first step)."""
        record = self.record(optimizer)
        if record.name is None:
            self._named += 1
            record.name = f"{record.kind}#{self._named}"
        return record

    def _outer_running(self, inner_wrapper: FrameType) -> bool:
        outer = self._outer
        assert outer is not None
        if outer.optimizer() is None:
            return False
        frame: FrameType | None = inner_wrapper.f_back
        while frame is not None:
            if id(frame) == outer.frame_id and frame.f_code is outer.code:
                return True
            frame = frame.f_back
        return False

    def counts(self) -> dict[str, int]:
        """Top-level steps per named optimizer still alive."""
        return {r.name: r.steps for r in self._records.values() if r.name is not None}


def live_optimizers() -> list[torch.optim.Optimizer]:
    """Every torch.optim optimizer alive in the process: one walk of the garbage collector's
    objects, done once (the first backward of a job whose optimizers have not stepped yet)."""
    import gc

    from torch.optim import Optimizer

    # By exact type, never `isinstance`: that reads `__class__`, which some objects compute in
    # Python (torch.distributed's deprecated `reduce_op` prints a FutureWarning into the job).
    return [obj for obj in gc.get_objects() if issubclass(type(obj), Optimizer)]


def caller_frame(depth: int) -> FrameType:
    """The frame `depth` levels above the caller (torch's step wrapper, seen from a hook)."""
    return sys._getframe(depth + 1)
