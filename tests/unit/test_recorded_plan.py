"""`memtui estimate --from`: the checkpoint plan from a recording's measured blocks, and the
bound it states (`memtui.reports.recorded_plan`), on constructed steps.

The figures are a 6-block mixer's, as `memtui run --activations every` recorded them: each
block saves 6,307,840 B and takes 393,216 B of input; the steady step's peak is 44,683,052 B at
the end of the forward (its activations' high), gradients 0 there and 2,210,728 B at their high.
Trained for real with blocks 0-2 wrapped the peak was 26,939,180 B, with 0-3 21,024,556 B.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from memtui.model.recording import Recording, apply
from memtui.reports.checkpoint_plan import Block
from memtui.reports.recorded_plan import (
    NO_BLOCKS,
    NOT_AT_PEAK,
    peak_bound,
    recorded_plan,
    recorded_plan_lines,
)
from memtui_protocol import schema

SAVED, INPUTS, WEIGHTS, STATE, GRADS = 6_307_840, 393_216, 2_210_728, 4_421_760, 2_210_728
ACTIVATIONS = 38_050_564
PEAK = schema.Piles(WEIGHTS, 0, STATE, ACTIVATIONS)
HIGH = schema.Piles(WEIGHTS, GRADS, STATE, ACTIVATIONS)
BLOCKS = [Block(f"stages.{index}", SAVED, INPUTS) for index in range(6)]
TOTAL = WEIGHTS + STATE + ACTIVATIONS


def _step(number: int, blocks: bool = True, peak: schema.Piles = PEAK) -> schema.Step:
    return schema.Step(
        step=number,
        t_start=float(number),
        t_end=number + 0.5,
        end=schema.Piles(WEIGHTS, GRADS, STATE, 0),
        max=HIGH,
        peak=peak,
        blocks=[schema.BlockBytes(1 + index, SAVED, INPUTS) for index in range(6)]
        if blocks
        else [],
    )


def _recording(*steps: schema.Step) -> Recording:
    recording = Recording(
        path=Path("run.memtui"),
        hello=schema.Hello(
            format_version=schema.FORMAT_VERSION,
            agent_version="0.1.0",
            pid=7,
            argv=["python", "train.py"],
            started="2026-01-01T00:00:00+00:00",
            started_unix=1.0,
            device="cpu",
        ),
    )
    recording.module_names = {0: "Mixer", **{1 + index: f"stages.{index}" for index in range(6)}}
    for step in steps:
        apply(recording, step)
    return recording


def test_the_bound_is_the_forward_end_where_the_recomputation_comes_after_frees() -> None:
    total = TOTAL
    assert PEAK.total == total == 44_683_052
    three = peak_bound(_step(2), BLOCKS, {"stages.0", "stages.1", "stages.2"})
    assert three == total - 3 * (SAVED - INPUTS) == 26_939_180  # the measured peak
    four = peak_bound(_step(2), BLOCKS, {f"stages.{index}" for index in range(4)})
    assert four == 21_024_556  # the measured peak
    assert peak_bound(_step(2), BLOCKS, set()) == total


def test_the_recomputation_of_the_last_block_bounds_a_plan_that_wraps_them_all() -> None:
    """All 6 wrapped: the last block's recomputation, with the 5 before it holding inputs and
    the gradients grown by their whole high, is above the forward's end."""
    everything = {block.name for block in BLOCKS}
    forward_end = TOTAL - 6 * (SAVED - INPUTS)
    last = TOTAL - 5 * (SAVED - INPUTS) + INPUTS + GRADS
    assert peak_bound(_step(2), BLOCKS, everything) == max(forward_end, last) == last


def test_no_bound_when_the_peak_is_not_at_the_activations_high() -> None:
    late = schema.Piles(WEIGHTS, GRADS, STATE, ACTIVATIONS // 2)
    assert peak_bound(_step(2, peak=late), BLOCKS, {"stages.0"}) is None
    result = recorded_plan(_recording(_step(1, peak=late)), 20_000_000)
    assert result["checkpoint_plan"] is None
    assert "falls after its activations' high" in result["checkpoint_plan_reason"]


def test_the_plan_wraps_the_fewest_blocks_whose_bound_fits() -> None:
    result = recorded_plan(_recording(_step(1), _step(2)), 30_000_000)
    plan = result["checkpoint_plan"]
    assert plan == {
        "modules": ["stages.0", "stages.1", "stages.2"],
        "peak_after": 26_939_180,
        "recompute": None,
        "bound": True,
    }
    assert result["blocks_step"] == 1 and result["peak_step"] == 1
    lines = recorded_plan_lines(result)
    assert (
        "wrap 3 module(s) in torch.utils.checkpoint.checkpoint(use_reentrant=False):" in (lines[1])
    )
    assert "a bound from step 1's measured blocks, not a measurement" in lines[3]
    assert "not known" in lines[4]


def test_a_run_under_the_budget_needs_no_plan_and_one_over_every_bound_gets_why() -> None:
    fits = recorded_plan(_recording(_step(1)), 50_000_000)
    assert fits["checkpoint_plan"]["modules"] == []
    assert fits["checkpoint_plan"]["peak_after"] == TOTAL
    over = recorded_plan(_recording(_step(1)), 10_000_000)
    assert over["checkpoint_plan"] is None
    assert over["checkpoint_plan_reason"].startswith("with all 6 blocks checkpointed the peak")


def test_without_blocks_at_the_peak_no_plan_is_stated() -> None:
    none = recorded_plan(_recording(_step(1, blocks=False)), 30_000_000)
    assert none["checkpoint_plan"] is None and none["checkpoint_plan_reason"] == NO_BLOCKS
    higher = msgspec.structs.replace(PEAK, activations=ACTIVATIONS + 1)
    carried = recorded_plan(_recording(_step(1), _step(2, blocks=False, peak=higher)), 30_000_000)
    assert carried["checkpoint_plan"] is None
    assert carried["checkpoint_plan_reason"] == NOT_AT_PEAK
