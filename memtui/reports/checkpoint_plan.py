"""`memtui estimate --budget`: which blocks to wrap in activation checkpointing so the peak fits.

A checkpointed block keeps only its inputs and frees what its forward saved; during backward
its forward runs again, one block at a time, and holds that block's activations while its
backward runs. So wrapping a set S of blocks gives about

    peak_after = peak - sum over S of (saved - kept) + max over S of saved

(`predicted_peak`). The plan wraps whole repeated blocks, as users do, the ones that free the
most first (`blocks_in_order`): the smallest number of blocks by that order whose peak fits
(`blocks_needed`). The formula only ranks and gives a first guess; every figure the plan states
is measured: each candidate set is trained two steps on fake tensors with exactly those blocks
wrapped, by the agent's own ledger, and the plan is the fewest blocks whose measured peak is at
or under the budget (a bisection on the count, a few child runs). The recomputation's cost is
the wrapped blocks' forward FLOPs over the step's forward and backward FLOPs, both counted by
torch's `FlopCounterMode` (matrix products, convolutions, attention), not the time they take;
None ("not known") when the step has no FLOPs it counts.

The viewer never imports torch: the profile and the measured runs come from the estimate's
child (`memtui_agent.estimate.block_profile`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from memtui.reports.model_estimate import ModelEstimateError, Sharding, reserve_for
from memtui_protocol.estimate import FakeStepRequest, Variant
from memtui_protocol.units import format_bytes

MAX_MEASURED = 6
"""Child runs the plan may take beyond the profile (a bisection over up to 64 blocks)."""


@dataclass(frozen=True)
class Block:
    """One repeated block as the profile saw it (bytes and FLOPs of its forward)."""

    name: str
    saved: int
    kept: int
    forward_flops: int = 0

    @property
    def frees(self) -> int:
        """What wrapping it frees while the forward's activations are live."""
        return max(0, self.saved - self.kept)


def blocks_in_order(blocks: list[Block]) -> list[Block]:
    """The order the plan wraps blocks: most bytes freed first, forward order among equals."""
    return sorted(blocks, key=lambda block: -block.frees)


def predicted_peak(peak: int, wrapped: list[Block]) -> int:
    """The peak after wrapping `wrapped` (module docstring's formula): a guess to start from."""
    if not wrapped:
        return peak
    return peak - sum(block.frees for block in wrapped) + max(block.saved for block in wrapped)


def blocks_needed(blocks: list[Block], peak: int, budget: int) -> int | None:
    """The fewest blocks, in `blocks_in_order`, whose predicted peak fits; None if not all."""
    ordered = blocks_in_order(blocks)
    for count in range(len(ordered) + 1):
        if predicted_peak(peak, ordered[:count]) <= budget:
            return count
    return None


def fewest_freeing(blocks: list[Block], peak: int, budget: int) -> int | None:
    """The fewest blocks, in `blocks_in_order`, whose freed bytes alone bring the peak to the
    budget (no recomputation counted): fewer cannot fit. None if not all of them."""
    ordered = blocks_in_order(blocks)
    freed = 0
    for count, block in enumerate(ordered, start=1):
        freed += block.frees
        if peak - freed <= budget:
            return count
    return None


def recompute_fraction(wrapped: list[Block], step_flops: int) -> float | None:
    """The recomputed forwards' FLOPs over the step's; None when the step counted none."""
    if step_flops <= 0:
        return None
    return sum(block.forward_flops for block in wrapped) / step_flops


def step_peak(run: dict[str, Any], sharding: Sharding) -> int:
    """The higher of the first and the steady step's peak: the job must live through both."""
    return max(sharding.peak(run, step="first"), sharding.peak(run))


def choose_plan(
    blocks: list[Block], peak: int, budget: int, measured_peak: Callable[[list[str]], int | None]
) -> tuple[list[Block], int] | str:
    """The fewest blocks (in `blocks_in_order`) whose measured peak fits, and that peak; or why
    there is none. Measures first the fewest that could fit (`fewest_freeing`), then bisects on
    the count up to the formula's guess (`blocks_needed`) or all blocks."""
    ordered = blocks_in_order(blocks)
    if not ordered:
        return "the model has no repeated blocks with parameters to checkpoint"
    runs = 0
    fits: dict[int, int] = {}
    over: dict[int, int] = {}

    def probe(count: int) -> bool:
        nonlocal runs
        runs += 1
        got = measured_peak([block.name for block in ordered[:count]])
        if got is None:
            over[count] = -1
            return False
        (fits if got <= budget else over)[count] = got
        return got <= budget

    count = len(ordered)

    def over_reason() -> str:
        got = over.get(count, -1)
        if got < 0:
            return f"the step with all {count} blocks checkpointed could not be measured"
        return (
            f"with all {count} blocks checkpointed the peak is still {format_bytes(got)}, "
            f"{format_bytes(got - budget)} over the budget"
        )

    # Fewer blocks than `fewest_freeing` cannot fit: what they free, taken whole, is too little.
    first = fewest_freeing(blocks, peak, budget) or count
    if probe(first):
        return ordered[:first], fits[first]
    if first == count:
        return over_reason()
    low = first + 1
    guess = blocks_needed(blocks, peak, budget)
    high = count if guess is None else min(max(guess, low), count)
    if not probe(high):
        if high == count or not probe(count):
            return over_reason()
        low = high + 1
        high = count
    # `high` fits (measured); the fewest that fit is in [low, high].
    while low < high and runs < MAX_MEASURED:
        middle = (low + high) // 2
        if probe(middle):
            high = middle
        else:
            low = middle + 1
    return ordered[:high], fits[high]


def plan_for(
    request: FakeStepRequest,
    runs: list[dict[str, Any]],
    sharding: Sharding,
    budget: int,
    measure: Callable[[FakeStepRequest], list[dict[str, Any]]],
) -> tuple[dict[str, Any] | None, str | None]:
    """`checkpoint_plan` and, when it is None, why: `runs` are the estimate's runs (the
    as-given one and the block profile), `measure` runs the child for one more request."""
    by_variant = {run["variant"]: run for run in runs}
    base = by_variant[Variant.AS_GIVEN.value]
    peak = step_peak(base, sharding)
    if peak <= budget:
        return {"modules": [], "peak_after": peak, "recompute": 0.0}, None
    if request.checkpointing:
        return None, "--checkpointing already wraps every block"
    profile = by_variant.get(Variant.BLOCKS.value, {"error": "no block profile"})
    if "error" in profile:
        return None, str(profile["error"])
    blocks = [Block(**row) for row in profile["blocks"]]

    failures: list[str] = []

    def measured_peak(names: list[str]) -> int | None:
        wrapped = replace(
            request, variants=[Variant.AS_GIVEN], what_ifs=[], checkpoint_modules=names
        )
        try:
            run = measure(wrapped)[0]
        except ModelEstimateError as exc:  # the wrapped step failed: no figure, said once
            failures.append(str(exc))
            return None
        return step_peak(run, sharding)

    chosen = choose_plan(blocks, peak, budget, measured_peak)
    if isinstance(chosen, str):
        return None, f"{chosen} ({failures[0]})" if failures else chosen
    wrapped, peak_after = chosen
    return {
        "modules": [block.name for block in wrapped],
        "peak_after": peak_after,
        "recompute": recompute_fraction(wrapped, int(profile["step_flops"])),
    }, None


def budget_for(budget: int | None, device_memory: int | None) -> int | None:
    """`--budget`, else the device's memory less the verdict's reserve; None: no plan asked."""
    if budget is not None:
        return budget
    if device_memory is None:
        return None
    return device_memory - reserve_for(device_memory)


def add_plan(
    result: dict[str, Any],
    request: FakeStepRequest,
    runs: list[dict[str, Any]],
    sharding: Sharding,
    budget: int,
    measure: Callable[[FakeStepRequest], list[dict[str, Any]]],
) -> None:
    """`budget`, `checkpoint_plan` and `checkpoint_plan_reason` in the estimate's result."""
    plan, reason = plan_for(request, runs, sharding, budget, measure)
    result.update(budget=budget, checkpoint_plan=plan, checkpoint_plan_reason=reason)


def plan_lines(result: dict[str, Any]) -> list[str]:
    """The plan as text: what to wrap, the measured peak after and the recomputation's cost."""
    budget = result["budget"]
    plan = result["checkpoint_plan"]
    head = f"budget {format_bytes(budget)} for the peak"
    if plan is None:
        return [f"{head}: no checkpointing plan fits: {result['checkpoint_plan_reason']}"]
    if not plan["modules"]:
        return [f"{head}: fits without checkpointing"]
    recompute = plan["recompute"]
    cost = "not known" if recompute is None else f"{recompute:.0%} of the step's FLOPs"
    names = ", ".join(plan["modules"])
    return [
        f"{head}: wrap {len(plan['modules'])} module(s) in "
        "torch.utils.checkpoint.checkpoint(use_reentrant=False):",
        f"  {names}",
        f"  peak after {format_bytes(plan['peak_after'])} (measured with exactly these wrapped); "
        f"forward recomputed in backward: {cost}",
    ]
