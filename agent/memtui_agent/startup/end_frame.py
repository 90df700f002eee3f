"""The run's `End` frame, built once from the inputs the agent gathered, by a pure function.

The step frame has its pure builder (`steps.frame.build_step`); this is the end frame's. At the
end of a run the agent gathers what the frame says (`Agent.finish`): how the job ended (its exit
code, the exception leaving it, a stop from memtui, a detach), where the agent last saw it (the
open step, the last closed one, the phase, where the exception was first seen), the piles, the
allocator's last failed allocation, the allocator events since the last close, late health
values and the leaks. Those inputs are one frozen `EndInputs`; `build_end` turns them into the
`schema.End` the recording and viewers get. Tests build end frames from hand-made inputs, with
no hooks and no training job (tests/unit/test_end_frame.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from memtui_agent.steps.failures import (
    ErrorContext,
    first_line,
    is_oom,
    requested_bytes,
    reserved_unallocated_bytes,
)
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, ExitStatus, Phase
from memtui_protocol.units import format_bytes

STOPPED_TEXT = "stopped from memtui (SIGTERM)"
"""The `error` of an `End` whose job memtui stopped: nothing went wrong in it."""


@dataclass(frozen=True)
class EndInputs:
    """Everything the end frame is built from; the defaults are an agent that never started
    (no step, phase or piles known) and a job that returned normally."""

    time: float
    exit_code: int | None = 0
    error: BaseException | None = None
    """The exception leaving the job (None when it returned or exited)."""
    stopped: bool = False
    """memtui stopped the job (SIGTERM from `memtui stop`)."""
    detached: bool = False
    """`memtui detach` stopped the agent while the job carries on."""
    step: int | None = None
    """The step open at the end (`StepWindow.number`)."""
    closed: int | None = None
    """The last step closed (`StepWindow.closed`)."""
    phase: Phase | None = None
    """The training phase at the end."""
    context: ErrorContext | None = None
    """Where the exception now propagating was first seen (if it is `error`, it says where)."""
    piles: schema.Piles | None = None
    last_oom: dict[str, int] | None = None
    """The allocator's last failed allocation, as the agent observed it (`GpuEvents`)."""
    alloc_events: schema.AllocEvents | None = None
    """`--alloc-events`: what the allocator did after the last close (up to an OOM)."""
    late: tuple[schema.StepLate, ...] = ()
    leaks: tuple[schema.Leak, ...] = ()


def build_end(inputs: EndInputs) -> schema.End:
    """The `End` frame of a run: how it ended and where, with the late values and leaks.

    A stop from memtui and a detach say where the job was; a job that returned (or exited with
    `SystemExit(0)`) says its exit code; a job that raised says the exception, where it was
    first seen, and, for an out-of-memory error, an alert with what was asked and held.
    """
    if inputs.stopped:
        end = schema.End(
            time=inputs.time,
            status=ExitStatus.STOPPED,
            code=inputs.exit_code,
            error=STOPPED_TEXT,
            step=inputs.step,
            phase=inputs.phase,
            piles=inputs.piles,
        )
    elif inputs.detached:
        end = schema.End(
            time=inputs.time, status=ExitStatus.DETACHED, step=inputs.closed, piles=inputs.piles
        )
    elif _returned(inputs):
        end = _returned_end(inputs)
    else:
        end = _raised_end(inputs)
    return msgspec.structs.replace(end, late=list(inputs.late), leaks=list(inputs.leaks))


def _returned(inputs: EndInputs) -> bool:
    """The job returned or exited (with any code), not raised: `SystemExit(0)` is a return."""
    error = inputs.error
    return error is None or (isinstance(error, SystemExit) and inputs.exit_code == 0)


def _returned_end(inputs: EndInputs) -> schema.End:
    """Exit code 0 is `ok`; any other is an `error` that says the code."""
    ok = not inputs.exit_code
    return schema.End(
        time=inputs.time,
        status=ExitStatus.OK if ok else ExitStatus.ERROR,
        code=inputs.exit_code,
        error=None if ok else f"exit code {inputs.exit_code}",
        step=inputs.closed,
        piles=inputs.piles,
        alloc_events=inputs.alloc_events,
    )


def _raised_end(inputs: EndInputs) -> schema.End:
    """The job raised `error`: its type and first line, where it was first seen, and whether it
    was the allocator running out of memory."""
    error = inputs.error
    assert error is not None  # `_returned` said so
    phase, where = inputs.phase, None
    context = inputs.context
    if context is not None and context.matches(error):
        phase, where = context.phase, context.where
    oom = is_oom(error)
    observed = inputs.last_oom or {}
    requested = observed.get("requested") or (requested_bytes(error) if oom else None)
    alerts = [_oom_alert(inputs, error, phase, where)] if oom else []
    return schema.End(
        time=inputs.time,
        status=ExitStatus.ERROR,
        code=inputs.exit_code,
        requested=requested,
        reserved_unallocated=reserved_unallocated_bytes(error) if oom else None,
        error_type=type(error).__name__,
        error=first_line(error),
        step=inputs.step,
        phase=phase,
        oom=oom,
        piles=inputs.piles,
        alerts=alerts,
        alloc_events=inputs.alloc_events,
    )


def _oom_alert(
    inputs: EndInputs, error: BaseException, phase: Phase | None, where: str | None
) -> schema.Alert:
    """What ran out: the step and phase, the bytes asked for, what the piles held and what the
    device had free (each where known)."""
    observed = inputs.last_oom
    asked = (observed or {}).get("requested") or requested_bytes(error)
    size = f" asking for {format_bytes(asked)}" if asked is not None else ""
    piles = inputs.piles
    held = f"; tracked piles held {format_bytes(piles.total)}" if piles is not None else ""
    if observed is not None:
        held += f"; {format_bytes(observed['free'])} was free on the device"
    during = phase.value if phase is not None else None
    return schema.Alert(
        kind=AlertKind.OOM,
        message=f"out of memory in {during} of step {inputs.step}{size}{held}: {first_line(error)}",
        where=where,
    )
