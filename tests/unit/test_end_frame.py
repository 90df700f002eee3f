"""The end frame's pure builder (`startup.end_frame.build_end`), one row per way a run ends.

Each row is hand-made inputs and the whole `End` frame expected, written out field by field:
no hooks, no training job, no interpreter. A run that is killed writes no `End` at all (the
reader concludes `killed` from its absence, tests/unit/test_how_it_ended.py): it has no row here.
"""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from memtui_agent.startup.end_frame import STOPPED_TEXT, EndInputs, build_end
from memtui_agent.steps.failures import ErrorContext
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, ExitStatus, Phase

T = 1_700_000_000.5
PILES = schema.Piles(weights=2**30, gradients=2**30, optimizer_state=2**30, activations=0)
"""3 GiB held in the tracked piles."""
ALLOC = schema.AllocEvents(allocations=3, alloc_bytes=4096)
LATE = (schema.StepLate(step=6, loss=0.25),)
LEAKS = (
    schema.Leak(holder="history", kind="graph", bytes=1024, tensors=2, per_step=512, first_step=3),
)


class OutOfMemoryError(RuntimeError):
    """Named as CUDA's (`torch.OutOfMemoryError`): the builder knows it by its name."""


CUDA_OOM = OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)\nmore text")
CPU_OOM = RuntimeError(
    "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 1024 bytes. Error code 12"
)
VALUE_ERROR = ValueError("bad shape\nsecond line")
SEEN = ErrorContext.of(VALUE_ERROR, Phase.BACKWARD, "model.decoder")
"""Where the hooks first saw `VALUE_ERROR`: in the backward of `model.decoder`."""
OTHER_SEEN = ErrorContext.of(KeyError("another"), Phase.OPTIMIZER, "elsewhere")

STARTED = EndInputs(
    time=T, step=8, closed=7, phase=Phase.FORWARD, piles=PILES, late=LATE, leaks=LEAKS
)
"""An agent that ran: step 8 open, 7 closed, in the forward, 3 GiB in its piles."""


def _with(**fields: object) -> EndInputs:
    return replace(STARTED, **fields)  # type: ignore[arg-type]


CASES: list[tuple[str, EndInputs, schema.End]] = [
    (
        "ok: returned, exit code 0",
        _with(alloc_events=ALLOC),
        schema.End(
            time=T,
            status=ExitStatus.OK,
            code=0,
            step=7,
            piles=PILES,
            alloc_events=ALLOC,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "ok: SystemExit(0)",
        _with(error=SystemExit(0)),
        schema.End(
            time=T,
            status=ExitStatus.OK,
            code=0,
            step=7,
            piles=PILES,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "exit code without an exception (api.stop(exit_code=3))",
        _with(exit_code=3),
        schema.End(
            time=T,
            status=ExitStatus.ERROR,
            code=3,
            error="exit code 3",
            step=7,
            piles=PILES,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "SystemExit(2): the exception, at the open step",
        _with(exit_code=2, error=SystemExit(2)),
        schema.End(
            time=T,
            status=ExitStatus.ERROR,
            code=2,
            error_type="SystemExit",
            error="2",
            step=8,
            phase=Phase.FORWARD,
            piles=PILES,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "exception, first seen elsewhere: the phase now, no place",
        _with(exit_code=1, error=VALUE_ERROR, context=OTHER_SEEN, alloc_events=ALLOC),
        schema.End(
            time=T,
            status=ExitStatus.ERROR,
            code=1,
            error_type="ValueError",
            error="bad shape",
            step=8,
            phase=Phase.FORWARD,
            piles=PILES,
            alloc_events=ALLOC,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "exception first seen by the hooks: their phase and place",
        _with(exit_code=1, error=VALUE_ERROR, context=SEEN),
        schema.End(
            time=T,
            status=ExitStatus.ERROR,
            code=1,
            error_type="ValueError",
            error="bad shape",
            step=8,
            phase=Phase.BACKWARD,
            piles=PILES,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "signal: Ctrl-C (KeyboardInterrupt, exit 130)",
        _with(exit_code=130, error=KeyboardInterrupt()),
        schema.End(
            time=T,
            status=ExitStatus.ERROR,
            code=130,
            error_type="KeyboardInterrupt",
            error="KeyboardInterrupt",
            step=8,
            phase=Phase.FORWARD,
            piles=PILES,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "CUDA OOM the allocator reported: its request and free memory, where it was seen",
        _with(
            exit_code=1,
            error=CUDA_OOM,
            context=ErrorContext.of(CUDA_OOM, Phase.BACKWARD, "model.head"),
            last_oom={"device": 0, "requested": 6 * 2**30, "allocated": 1, "free": 512 * 2**20},
            alloc_events=ALLOC,
        ),
        schema.End(
            time=T,
            status=ExitStatus.ERROR,
            code=1,
            error_type="OutOfMemoryError",
            error="CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)",
            step=8,
            phase=Phase.BACKWARD,
            oom=True,
            piles=PILES,
            alerts=[
                schema.Alert(
                    kind=AlertKind.OOM,
                    message="out of memory in backward of step 8 asking for 6.00 GiB; tracked "
                    "piles held 3.00 GiB; 512.00 MiB was free on the device: CUDA out of "
                    "memory. Tried to allocate 2.00 GiB (GPU 0)",
                    where="model.head",
                )
            ],
            requested=6 * 2**30,
            alloc_events=ALLOC,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "CUDA OOM not observed: the request its message names",
        _with(exit_code=1, error=CUDA_OOM),
        schema.End(
            time=T,
            status=ExitStatus.ERROR,
            code=1,
            error_type="OutOfMemoryError",
            error="CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)",
            step=8,
            phase=Phase.FORWARD,
            oom=True,
            piles=PILES,
            alerts=[
                schema.Alert(
                    kind=AlertKind.OOM,
                    message="out of memory in forward of step 8 asking for 2.00 GiB; tracked "
                    "piles held 3.00 GiB: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0)",
                )
            ],
            requested=2 * 2**30,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "CPU allocator OOM: bytes from its message",
        _with(exit_code=1, error=CPU_OOM, phase=Phase.OPTIMIZER),
        schema.End(
            time=T,
            status=ExitStatus.ERROR,
            code=1,
            error_type="RuntimeError",
            error=str(CPU_OOM),
            step=8,
            phase=Phase.OPTIMIZER,
            oom=True,
            piles=PILES,
            alerts=[
                schema.Alert(
                    kind=AlertKind.OOM,
                    message="out of memory in optimizer of step 8 asking for 1.00 KiB; tracked "
                    f"piles held 3.00 GiB: {CPU_OOM}",
                )
            ],
            requested=1024,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "MemoryError with no size, agent never started: nothing known but the error",
        EndInputs(time=T, exit_code=1, error=MemoryError()),
        schema.End(
            time=T,
            status=ExitStatus.ERROR,
            code=1,
            error_type="MemoryError",
            error="MemoryError",
            oom=True,
            alerts=[
                schema.Alert(
                    kind=AlertKind.OOM,
                    message="out of memory in None of step None: MemoryError",
                )
            ],
        ),
    ),
    (
        "agent never started, job returned",
        EndInputs(time=T),
        schema.End(time=T, status=ExitStatus.OK, code=0),
    ),
    (
        "stopped from memtui: where it was (the open step), whatever it raised",
        _with(stopped=True, exit_code=143, error=VALUE_ERROR, detached=True, alloc_events=ALLOC),
        schema.End(
            time=T,
            status=ExitStatus.STOPPED,
            code=143,
            error=STOPPED_TEXT,
            step=8,
            phase=Phase.FORWARD,
            piles=PILES,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
    (
        "detached: the last closed step, no code, whatever else",
        _with(detached=True, exit_code=None, error=VALUE_ERROR, alloc_events=ALLOC),
        schema.End(
            time=T,
            status=ExitStatus.DETACHED,
            step=7,
            piles=PILES,
            late=list(LATE),
            leaks=list(LEAKS),
        ),
    ),
]


@pytest.mark.parametrize(
    ("inputs", "expected"), [(i, e) for _, i, e in CASES], ids=[name for name, _, _ in CASES]
)
def test_build_end_writes_each_way_a_run_ends(inputs: EndInputs, expected: schema.End) -> None:
    assert build_end(inputs) == expected


def test_the_end_frame_encodes_as_the_wire_expects() -> None:
    """Built frames go to the recording as they are: each encodes and decodes to itself."""
    for _name, inputs, _expected in CASES:
        end = build_end(inputs)
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(end), type=schema.End) == end


def test_an_exception_raised_from_the_one_seen_takes_its_place() -> None:
    """The exception leaving the job wraps the one the hooks saw: theirs says where."""
    try:
        try:
            raise VALUE_ERROR
        except ValueError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        end = build_end(_with(exit_code=1, error=outer, context=SEEN))
    assert (end.error_type, end.error, end.phase) == ("RuntimeError", "wrapped", Phase.BACKWARD)


def test_building_reads_nothing_but_its_inputs() -> None:
    """Pure: the same inputs give the same frame, and the inputs are left as they were."""
    inputs = _with(exit_code=1, error=CUDA_OOM, last_oom={"requested": 1, "free": 2})
    assert build_end(inputs) == build_end(inputs)
    assert inputs.last_oom == {"requested": 1, "free": 2}
