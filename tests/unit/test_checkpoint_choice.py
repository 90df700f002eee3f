"""The checkpointing plan's choice (`memtui estimate --budget`): order, formula, bisection."""

from __future__ import annotations

from typing import Any

from memtui.reports.checkpoint_plan import (
    Block,
    blocks_in_order,
    blocks_needed,
    budget_for,
    choose_plan,
    fewest_freeing,
    plan_for,
    plan_lines,
    predicted_peak,
    recompute_fraction,
)
from memtui.reports.model_estimate import ModelEstimateError, Sharding, reserve_for
from memtui_protocol.estimate import FakeStepRequest, Variant

MB = 10**6
BLOCKS = [Block(f"layers.{i}", saved=4 * MB, kept=MB, forward_flops=100) for i in range(4)]


def test_blocks_that_free_most_come_first_forward_order_among_equals() -> None:
    blocks = [Block("a", 2 * MB, MB), Block("b", 5 * MB, MB), Block("c", 5 * MB, MB)]
    assert [block.name for block in blocks_in_order(blocks)] == ["b", "c", "a"]


def test_predicted_peak_frees_all_but_inputs_and_recomputes_the_largest() -> None:
    assert predicted_peak(20 * MB, []) == 20 * MB
    # 2 blocks free 3 MB each; backward recomputes one 4 MB block at a time.
    assert predicted_peak(20 * MB, BLOCKS[:2]) == 20 * MB - 6 * MB + 4 * MB


def test_blocks_needed_is_the_fewest_whose_prediction_fits() -> None:
    assert blocks_needed(BLOCKS, 20 * MB, 20 * MB) == 0
    assert blocks_needed(BLOCKS, 20 * MB, 18 * MB) == 2  # 1 block: 21 MB, 2: 18 MB
    assert blocks_needed(BLOCKS, 20 * MB, 12 * MB) == 4  # 4 blocks: 12 MB
    assert blocks_needed(BLOCKS, 20 * MB, 11 * MB) is None


def test_recompute_is_the_wrapped_forwards_share_of_the_step_or_not_known() -> None:
    assert recompute_fraction(BLOCKS[:3], 1200) == 0.25
    assert recompute_fraction(BLOCKS, 0) is None


def _measured(peaks: dict[int, int], probes: list[int]) -> Any:
    def measured_peak(names: list[str]) -> int | None:
        probes.append(len(names))
        return peaks[len(names)]

    return measured_peak


def test_fewest_freeing_is_a_floor_without_recomputation() -> None:
    assert fewest_freeing(BLOCKS, 20 * MB, 14 * MB) == 2
    assert fewest_freeing(BLOCKS, 20 * MB, 5 * MB) is None


def test_choice_is_the_fewest_blocks_whose_measured_peak_fits() -> None:
    """The formula guesses 4 blocks for 12 MB; 3 free enough, and measured they fit: one run."""
    probes: list[int] = []
    peaks = {1: 17 * MB, 2: 14 * MB, 3: 11 * MB, 4: 9 * MB}
    chosen = choose_plan(BLOCKS, 20 * MB, 12 * MB, _measured(peaks, probes))
    assert not isinstance(chosen, str)
    wrapped, peak_after = chosen
    assert [block.name for block in wrapped] == ["layers.0", "layers.1", "layers.2"]
    assert peak_after == 11 * MB
    assert probes == [3]


def test_choice_goes_past_a_guess_that_measures_over() -> None:
    probes: list[int] = []
    peaks = {1: 19 * MB, 2: 18 * MB + 1, 3: 17 * MB, 4: 15 * MB}
    chosen = choose_plan(BLOCKS, 20 * MB, 18 * MB, _measured(peaks, probes))
    assert not isinstance(chosen, str)
    assert len(chosen[0]) == 3 and chosen[1] == 17 * MB
    assert probes == [1, 2, 4, 3]


def test_no_plan_when_every_block_wrapped_is_still_over() -> None:
    peaks = {count: 15 * MB for count in range(1, 5)}
    reason = choose_plan(BLOCKS, 20 * MB, 5 * MB, _measured(peaks, []))
    assert isinstance(reason, str) and "all 4 blocks" in reason and "over the budget" in reason
    assert choose_plan([], 20 * MB, 5 * MB, _measured({}, [])) == (
        "the model has no repeated blocks with parameters to checkpoint"
    )


def _run(peak: int) -> dict[str, Any]:
    piles = {"weights": MB, "gradients": 0, "optimizer_state": 2 * MB, "activations": peak - 3 * MB}
    figures = {"end": piles, "max": piles, "peak": piles}
    return {"variant": Variant.AS_GIVEN.value, "first": figures, "steady": figures}


def test_a_step_that_fits_needs_no_modules_and_measures_nothing_more() -> None:
    request = FakeStepRequest(model="m:f", batch="m:b")
    plan, reason = plan_for(request, [_run(10 * MB)], Sharding(), 10 * MB, lambda r: [])
    assert plan == {"modules": [], "peak_after": 10 * MB, "recompute": 0.0} and reason is None


def test_plan_measures_exactly_the_chosen_modules() -> None:
    asked: list[list[str]] = []

    def measure(request: FakeStepRequest) -> list[dict[str, Any]]:
        asked.append(request.checkpoint_modules)
        return [_run(20 * MB - 3 * MB * len(request.checkpoint_modules))]

    profile = {
        "variant": Variant.BLOCKS.value,
        "container": "layers",
        "blocks": [vars(block) for block in BLOCKS],
        "step_flops": 1200,
    }
    request = FakeStepRequest(model="m:f", batch="m:b")
    plan, reason = plan_for(request, [_run(20 * MB), profile], Sharding(), 14 * MB, measure)
    assert reason is None and plan is not None
    assert plan["modules"] == ["layers.0", "layers.1"]
    assert plan["peak_after"] == 14 * MB and plan["recompute"] == 200 / 1200
    assert ["layers.0", "layers.1"] in asked
    text = "\n".join(plan_lines({"budget": 14 * MB, "checkpoint_plan": plan}))
    assert "layers.0, layers.1" in text and "17% of the step's FLOPs" in text


def test_no_profile_means_no_plan_with_the_reason() -> None:
    request = FakeStepRequest(model="m:f", batch="m:b")
    profile = {"variant": Variant.BLOCKS.value, "error": "the model has no repeated blocks"}
    plan, reason = plan_for(request, [_run(20 * MB), profile], Sharding(), MB, lambda r: [])
    assert plan is None and reason == "the model has no repeated blocks"
    text = plan_lines({"budget": MB, "checkpoint_plan": None, "checkpoint_plan_reason": reason})
    assert text == ["budget 976.56 KiB for the peak: no checkpointing plan fits: " + reason]


def test_budget_defaults_to_the_device_less_its_reserve() -> None:
    assert budget_for(5, 80 * 10**9) == 5
    assert budget_for(None, 80 * 10**9) == 80 * 10**9 - reserve_for(80 * 10**9)
    assert budget_for(None, None) is None


def test_a_wrapped_step_that_fails_gives_no_plan_with_the_childs_line() -> None:
    def measure(request: FakeStepRequest) -> list[dict[str, Any]]:
        raise ModelEstimateError("a training step of m:f raised RuntimeError: boom")

    profile = {
        "variant": Variant.BLOCKS.value,
        "container": "layers",
        "blocks": [vars(block) for block in BLOCKS],
        "step_flops": 1200,
    }
    request = FakeStepRequest(model="m:f", batch="m:b")
    plan, reason = plan_for(request, [_run(20 * MB), profile], Sharding(), 14 * MB, measure)
    assert plan is None
    assert reason == (
        "the step with all 4 blocks checkpointed could not be measured "
        "(a training step of m:f raised RuntimeError: boom)"
    )
