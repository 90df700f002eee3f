"""Out of memory explained (issue 37, item 3), from constructed frames: a CUDA out-of-memory
end with the failed request, the allocator's reserved-but-unallocated bytes and
`expandable_segments` on, off or not known; torch's message read into the `End` frame; and an
older recording without the new fields."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from memtui.model.out_of_memory import explain, shortfall_lines
from memtui.model.recording import Recording, apply
from memtui.reports.report import build_report, render_text
from memtui_agent.memory.allocator import expandable_at_start
from memtui_agent.startup.end_frame import EndInputs, build_end
from memtui_protocol import schema, wire
from memtui_protocol.schema import AlertKind, ExitStatus, Phase

MIB = 2**20
GIB = 2**30
PEAK = schema.Piles(weights=GIB, gradients=GIB, optimizer_state=2 * GIB, activations=4 * GIB)
"""Step 2's peak: 8 GiB, 4 GiB of it activations."""
AT_END = schema.Piles(weights=GIB, gradients=0, optimizer_state=2 * GIB, activations=3 * GIB)
CUDA_MESSAGE = (
    "CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity of 79.19 GiB of "
    "which 310.00 MiB is free. Including non-PyTorch memory, this process has 78.87 GiB memory "
    "in use. Of the allocated memory 71.20 GiB is allocated by PyTorch, and 6.25 GiB is reserved "
    "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)


class OutOfMemoryError(RuntimeError):
    """Named as CUDA's (`torch.OutOfMemoryError`): the end frame knows it by its name."""


def _hello(
    device: str = "cuda", expandable: bool | None = False, budget: int | None = None
) -> schema.Hello:
    return schema.Hello(
        format_version=schema.FORMAT_VERSION,
        agent_version="0.1.0",
        pid=7,
        argv=["python", "train.py"],
        started="2026-01-01T00:00:00+00:00",
        started_unix=1.0,
        device=device,
        budget=budget,
        expandable_segments=expandable,
    )


def _step(number: int) -> schema.Step:
    return schema.Step(
        step=number,
        t_start=float(number),
        t_end=number + 0.5,
        end=schema.Piles(GIB, GIB, 2 * GIB, 0),
        max=PEAK,
        peak=PEAK,
        top_activations=[schema.ModuleBytes(0, 3 * GIB), schema.ModuleBytes(1, GIB)],
    )


def _oom_end() -> schema.End:
    """What the agent writes for a CUDA OOM in step 3's forward (`--alloc-events` on)."""
    end = build_end(
        EndInputs(
            time=9.0,
            exit_code=1,
            error=OutOfMemoryError(CUDA_MESSAGE),
            step=3,
            phase=Phase.FORWARD,
            piles=AT_END,
            alloc_events=schema.AllocEvents(
                oom=schema.AllocEvent(size=1536 * MIB, count=1, where="train.py:41 forward"),
                oom_free=310 * MIB,
            ),
        )
    )
    return _through_the_wire(end)


def _through_the_wire(end: schema.End) -> schema.End:
    """The frame as a reader gets it from a recording."""
    (decoded,) = wire.FrameDecoder().feed(wire.preamble() + wire.encode(end))
    assert isinstance(decoded, schema.End)
    return decoded


def _recording(hello: schema.Hello, end: schema.End | None, alert: bool = False) -> Recording:
    """Two closed steps (step 2 with an over-budget alert if `alert`), then `end`, folded as a
    reader folds a recording's frames."""
    recording = Recording(path=Path("run.memtui"), hello=hello)
    recording.module_names = {0: "encoder.attn", 1: "encoder.mlp"}
    over = schema.Alert(kind=AlertKind.OVER_BUDGET, message="over", where="activations")
    second = msgspec.structs.replace(_step(2), alerts=[over] if alert else [])
    for message in (_step(1), second, end):
        if message is not None:
            apply(recording, message)
    return recording


def test_the_end_frame_keeps_torchs_reserved_unallocated_and_free_figures() -> None:
    end = _oom_end()
    assert end.oom and end.status == ExitStatus.ERROR
    assert end.requested == 1536 * MIB
    assert end.reserved_unallocated == int(6.25 * GIB)
    cpu = build_end(EndInputs(time=1.0, exit_code=1, error=MemoryError("out of memory")))
    assert cpu.reserved_unallocated is None


@pytest.mark.parametrize(
    ("expandable", "words"),
    [
        (
            False,
            "expandable_segments was off at start (PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True lets segments grow in place)",
        ),
        (True, "expandable_segments was on at start"),
        (None, "expandable_segments: not known"),
    ],
)
def test_a_cuda_oom_says_the_request_the_piles_the_reserve_and_what_fits(
    expandable: bool | None, words: str
) -> None:
    recording = _recording(_hello(expandable=expandable), _oom_end())
    shortfall = explain(recording)
    assert shortfall is not None and shortfall.cause is AlertKind.OOM
    assert shortfall_lines(shortfall) == [
        "out of memory at step 3 in forward: the failed request was 1.50 GiB at "
        "train.py:41 forward",
        "  piles as the job ended: weights 1.00 GiB, gradients 0 B, optimizer_state 2.00 GiB, "
        "activations 3.00 GiB",
        "  top modules by saved activations (step 2): encoder.attn 3.00 GiB, encoder.mlp 1.00 GiB",
        "  on the GPU: 6.25 GiB reserved but unallocated (fragmentation: free to the allocator, "
        f"unusable for this request); {words}",
        "  largest batch that fits: not known (no --budget: the device's limit in pile terms is "
        "not known); memtui estimate --budget plans activation checkpoints",
    ]
    text = render_text(recording).splitlines()
    assert text[2:7] == shortfall_lines(shortfall)  # after the OOM alert and the headline
    entry = build_report(recording)["out_of_memory"]
    assert entry["cause"] == "oom" and entry["requested"] == 1536 * MIB
    assert entry["requested_where"] == "train.py:41 forward"
    assert entry["reserved_unallocated"] == int(6.25 * GIB)
    assert entry["expandable_segments"] is expandable
    assert entry["batch_fraction"] is None


def test_with_a_budget_the_oom_names_the_batch_that_fits() -> None:
    # Step 2's peak: 4 GiB of weights, gradients and state stay; 4 GiB of activations scale.
    recording = _recording(_hello(budget=6 * GIB), _oom_end())
    shortfall = explain(recording)
    assert shortfall is not None and shortfall.batch_fraction == 0.5
    # Steps 1 and 2 peak alike: the earliest that limits the batch is named.
    assert shortfall_lines(shortfall)[-1].startswith(
        "  largest batch that fits the budget of 6.00 GiB: 0.50x step 1's batch"
    )
    roomy = explain(_recording(_hello(budget=12 * GIB), _oom_end()))
    assert roomy is not None and roomy.batch_fraction == 2.0
    assert "2.00x step 1's batch (its peak was within the budget)" in shortfall_lines(roomy)[-1]
    tight = explain(_recording(_hello(budget=3 * GIB), _oom_end()))
    assert tight is not None and tight.batch_fraction == 0.0
    assert (
        "largest batch that fits: none: weights, gradients and optimizer state alone"
        in (shortfall_lines(tight)[-1])
    )


def test_a_cpu_run_over_budget_has_no_gpu_line() -> None:
    recording = _recording(_hello(device="cpu", expandable=None, budget=7 * GIB), None, True)
    shortfall = explain(recording)
    assert shortfall is not None and shortfall.cause is AlertKind.OVER_BUDGET
    lines = shortfall_lines(shortfall)
    assert lines[0] == (
        "over budget at step 2: tracked peak 8.00 GiB, budget 7.00 GiB, over by 1.00 GiB"
    )
    assert not any("GPU" in line for line in lines)
    assert lines[-1].startswith("  largest batch that fits the budget of 7.00 GiB: 0.75x")


def test_the_hello_says_expandable_segments_for_a_cuda_job_only() -> None:
    on = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:True"}
    assert expandable_at_start("cuda", on) is True
    assert expandable_at_start("cuda", {"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert (
        expandable_at_start("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) is False
    )
    assert expandable_at_start("cuda", {}) is False
    assert expandable_at_start("cpu", on) is None


def test_the_request_size_and_line_come_from_the_alloc_events_when_the_end_lacks_one() -> None:
    end = msgspec.structs.replace(_oom_end(), requested=None)
    shortfall = explain(_recording(_hello(), end))
    assert shortfall is not None and shortfall.requested == 1536 * MIB
    assert shortfall.requested_where == "train.py:41 forward"


def test_a_run_with_neither_says_nothing_and_old_frames_read() -> None:
    assert explain(_recording(_hello(), None)) is None
    assert build_report(_recording(_hello(), None))["out_of_memory"] is None
    old_end = schema.End(time=1.0, status=ExitStatus.ERROR, oom=True, requested=MIB)
    decoded = _through_the_wire(old_end)
    assert decoded.reserved_unallocated is None
    shortfall = explain(_recording(_hello(expandable=None), decoded))
    assert shortfall is not None
    assert "on the GPU: not known reserved but unallocated" in "\n".join(shortfall_lines(shortfall))


def test_the_batch_that_fits_fits_every_step_not_only_the_first_over_the_budget() -> None:
    """A batch that fits the first step's peak (no optimizer state yet) passes the budget from
    the second step on, which holds the state the first `step()` made: the fraction is the
    lowest over the closed steps, and names the step that limits it."""
    first = schema.Piles(weights=GIB, gradients=0, optimizer_state=0, activations=4 * GIB)
    steady = schema.Piles(weights=GIB, gradients=0, optimizer_state=2 * GIB, activations=4 * GIB)
    over = schema.Alert(kind=AlertKind.OVER_BUDGET, message="over", where="activations")
    hello = _hello(device="cpu", expandable=None, budget=4 * GIB)
    recording = Recording(path=Path("run.memtui"), hello=hello)
    for message in (
        msgspec.structs.replace(_step(1), max=first, peak=first, alerts=[over]),
        msgspec.structs.replace(_step(2), max=steady, peak=steady),
        msgspec.structs.replace(_step(3), max=steady, peak=steady),
    ):
        apply(recording, message)
    shortfall = explain(recording)
    assert shortfall is not None and shortfall.step == 1
    # Step 1 alone: (4 - 1) / 4 = 0.75; steps 2 and 3 hold 2 GiB of state: (4 - 3) / 4 = 0.25.
    assert shortfall.batch_fraction == 0.25 and shortfall.batch_step == 2
    assert "0.25x step 2's batch" in shortfall_lines(shortfall)[-1]


def test_after_an_oom_the_next_step_holds_what_the_last_one_left() -> None:
    """Only step 1 closed before the out-of-memory, its peak without optimizer state; the
    step that never closed held the state step 1's `step()` made, so the batch that fits is
    counted with it."""
    first = schema.Piles(weights=GIB, gradients=0, optimizer_state=0, activations=4 * GIB)
    recording = Recording(path=Path("run.memtui"), hello=_hello(budget=4 * GIB))
    apply(recording, msgspec.structs.replace(_step(1), max=first, peak=first))
    apply(recording, _oom_end())
    shortfall = explain(recording)
    assert shortfall is not None and shortfall.cause is AlertKind.OOM
    # Step 1's end holds 1 GiB of weights and 2 GiB of state: (4 - 3) / 4.
    assert shortfall.batch_fraction == 0.25 and shortfall.batch_step == 1
