"""`memtui estimate --from RECORDING --budget B`: the checkpoint plan from a real run's
measured blocks, when the model cannot be built again (or should not be: no job code runs).

The recording's measured steps carry each repeated block's saved and input bytes
(`schema.Step.blocks`, counted by the agent's ledger during the real run, in forward order).
Nothing is trained, so the peak after a plan is not measured: it is a bound, proven for a step
whose peak falls at its activations' high (the end of the forward, the usual case on a loop
that frees its gradients) and whose blocks run one after another, as a layer stack does:

- until backward reaches the first wrapped block, every wrapped block holds its inputs instead
  of what it saved: at most `peak - sum over S of (saved - inputs)`;
- while backward recomputes a wrapped block b, the blocks after b have released what they
  saved, the wrapped ones before b still hold only their inputs, b holds what it saved again
  (and its inputs), and the gradients grew by at most the step's gradient high less the
  gradients at the peak: at most `peak - sum over blocks after b of saved - sum over wrapped
  before b of (saved - inputs) + inputs of b + (gradients' high - gradients at the peak)`;
- after the first wrapped block's backward, nothing differs from the run as recorded, and every
  block from the first wrapped on has released what it saved.

The plan wraps the blocks that free the most first (forward order among equals), the fewest whose
bound fits. Not seen: tensors passed to the blocks by keyword (global module hooks do not get
them; an attention mask shared by every block is one storage), and a step whose peak falls after
its activations' high (in backward, as the gradients grow), where no bound is stated. The
recomputation's FLOPs are not in a recording: "not known".
"""

from __future__ import annotations

from typing import Any

from memtui.model.recording import Recording
from memtui.model.step_rows import known_piles, known_total
from memtui.reports.checkpoint_plan import Block, blocks_in_order
from memtui_protocol import schema
from memtui_protocol.units import format_bytes

NOT_AT_PEAK = (
    "no step at the run's peak has its blocks measured (its activations were carried from an "
    "earlier step or not known): record with --activations every"
)
NO_BLOCKS = (
    "the recording has no measured step with repeated blocks: a model without an "
    "nn.ModuleList/nn.Sequential of blocks, no step whose activations were measured (record "
    "with --activations every), or a recording made by a memtui before 0.1 that kept no blocks"
)


def _highest(steps: list[schema.Step]) -> schema.Step | None:
    """The step with the highest known peak (the earliest of equals); None when none is known."""
    best: schema.Step | None = None
    best_total = -1
    for step in steps:
        total = known_total(step, step.peak)
        if total is not None and total > best_total:
            best, best_total = step, total
    return best


def peak_bound(step: schema.Step, blocks: list[Block], wrapped: set[str]) -> int | None:
    """The most the step's piles can hold with the `wrapped` blocks checkpointed (module
    docstring); None when the step's peak is not at its activations' high (no bound)."""
    peak = known_piles(step, step.peak)
    high = known_piles(step, step.max)
    if peak.total is None or peak.activations is None or peak.activations != high.activations:
        return None
    total: int = peak.total
    frees = sum(block.frees for block in blocks if block.name in wrapped)
    growth = max(0, (high.gradients or 0) - (peak.gradients or 0))
    bound = total - frees
    after = sum(block.saved for block in blocks)
    freed_before = 0
    for block in blocks:  # forward order: `after` is what the blocks after this one saved
        after -= block.saved
        if block.name not in wrapped:
            continue
        bound = max(bound, total - after - freed_before + block.kept + growth)
        freed_before += block.frees
    first = next((index for index, block in enumerate(blocks) if block.name in wrapped), None)
    if first is not None:
        late = total - sum(block.saved for block in blocks[first:]) + growth
        bound = max(bound, late)
    return bound


def recorded_plan(recording: Recording, budget: int) -> dict[str, Any]:
    """The `--json` object: the run's peak, the budget, the blocks the plan read and the plan
    (`checkpoint_plan`, or null with `checkpoint_plan_reason`)."""
    peak_step = _highest(recording.steps)
    result: dict[str, Any] = {
        "recording": str(recording.path),
        "budget": budget,
        "peak": known_total(peak_step, peak_step.peak) if peak_step is not None else None,
        "peak_step": peak_step.step if peak_step is not None else None,
        "blocks_step": None,
        "blocks": [],
        "checkpoint_plan": None,
        "checkpoint_plan_reason": None,
    }
    peak = result["peak"]
    if peak is None:
        result["checkpoint_plan_reason"] = "no step of the recording has a known peak"
        return result
    if peak <= budget:
        result["checkpoint_plan"] = _plan([], peak)
        return result
    # The run's peak with its blocks measured: that step, or a measured one of the same peak.
    step = next(
        (item for item in recording.steps if item.blocks and known_total(item, item.peak) == peak),
        None,
    )
    if step is None:
        result["checkpoint_plan_reason"] = (
            NO_BLOCKS if not any(item.blocks for item in recording.steps) else NOT_AT_PEAK
        )
        return result
    blocks = [
        Block(recording.module_name(item.module), item.saved, item.inputs) for item in step.blocks
    ]
    result["blocks_step"] = step.step
    result["blocks"] = [
        {"module": block.name, "saved": block.saved, "inputs": block.kept} for block in blocks
    ]
    if peak_bound(step, blocks, set()) is None:
        result["checkpoint_plan_reason"] = (
            f"step {step.step}'s peak falls after its activations' high (in backward, as the "
            "gradients grow): checkpointing is not proven to lower it; measure a plan with "
            "memtui estimate --model --batch --budget"
        )
        return result
    ordered = blocks_in_order(blocks)
    bound = peak
    for count in range(1, len(ordered) + 1):
        wrapped = ordered[:count]
        bound = peak_bound(step, blocks, {block.name for block in wrapped}) or peak
        if bound <= budget:
            result["checkpoint_plan"] = _plan(wrapped, bound)
            return result
    result["checkpoint_plan_reason"] = (
        f"with all {len(blocks)} blocks checkpointed the peak can still reach "
        f"{format_bytes(bound)}, {format_bytes(bound - budget)} over the budget"
    )
    return result


def _plan(wrapped: list[Block], peak_after: int) -> dict[str, Any]:
    return {
        "modules": [block.name for block in wrapped],
        "peak_after": peak_after,
        "recompute": None,
        "bound": True,
    }


def recorded_plan_lines(result: dict[str, Any]) -> list[str]:
    """The plan as text, its figures said to be predicted and from which steps."""
    budget = format_bytes(result["budget"])
    peak = result["peak"]
    head = f"{result['recording']}: peak {format_bytes(peak)} at step {result['peak_step']}"
    plan = result["checkpoint_plan"]
    if plan is None:
        return [head, f"budget {budget}: no checkpointing plan: {result['checkpoint_plan_reason']}"]
    if not plan["modules"]:
        return [head, f"budget {budget}: fits without checkpointing"]
    names = ", ".join(plan["modules"])
    return [
        head,
        f"budget {budget}: wrap {len(plan['modules'])} module(s) in "
        "torch.utils.checkpoint.checkpoint(use_reentrant=False):",
        f"  {names}",
        f"  peak after at most {format_bytes(plan['peak_after'])}: a bound from step "
        f"{result['blocks_step']}'s measured blocks, not a measurement (docs/estimate.md); "
        "memtui estimate --model --batch --budget measures it",
        "  forward recomputed in backward: not known (a recording holds no FLOPs)",
    ]
