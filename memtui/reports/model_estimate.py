"""`memtui estimate --model M:F --batch M:F`: a training step measured on fake tensors.

The viewer never imports torch (docs/design.md#the-shape), so the step runs in a child,
`python -m memtui_agent.estimate.fake_step`, which trains the model two steps on fake tensors
under the agent's own hooks and ledger and prints what the ledger saw. This module turns that
into the answer people ask for: the piles per GPU (sharded as the bytes-per-parameter ledger
shards them, through `memtui.reports.estimate`), the activations' high, the first and the
steady-state peak, the heaviest modules, and given the device's memory a verdict and what would
make it fit.

The verdict keeps a reserve free: the tracked piles are not all a GPU holds (the CUDA context,
cuBLAS/cuDNN workspaces, temporaries between saved tensors, the caching allocator's rounding and
fragmentation). `RESERVE_FRACTION` of the device, at least `RESERVE_MIN`, is a working margin,
not a measurement, and the output says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from memtui.reports.estimate import shard
from memtui.reports.model_count import child_json
from memtui_protocol.estimate import FAKE_STEP_MODULE, FakeStepRequest, Variant
from memtui_protocol.schema import Pile
from memtui_protocol.units import format_bytes

RESERVE_FRACTION = 0.10
RESERVE_MIN = 2**30
TOP_MODULES = 5
PERSISTENT = (Pile.WEIGHTS, Pile.GRADIENTS, Pile.OPTIMIZER_STATE)
"""The piles that outlive a step (what ZeRO shards); activations are the step's own."""


class ModelEstimateError(Exception):
    """The step could not be measured; the message is the child's one line."""


class Verdict(str, Enum):
    """Whether the step's peak fits the device with the reserve kept free; one answer with
    what the largest batch says (a batch called tight has a smaller one that fits)."""

    FITS = "fits"
    """The peak leaves the reserve free: a batch this size or larger fits."""
    TIGHT = "tight"
    """Under the device's memory, but inside the reserve (may run out); a smaller batch fits."""
    DOES_NOT_FIT = "does_not_fit"
    """Over the device's memory, or no batch size at all leaves the reserve free."""


@dataclass(frozen=True)
class Sharding:
    """How the piles are split per GPU: ZeRO stage (FSDP counts as stage 3) on `gpus`."""

    gpus: int = 1
    zero: int = 0
    fsdp: bool = False

    @property
    def stage(self) -> int:
        """The ZeRO stage the split follows."""
        return 3 if self.fsdp else self.zero

    def piles(self, piles: dict[str, int], stage: int | None = None) -> dict[str, int]:
        """One GPU's share: stage 1 shards optimizer state, 2 also gradients, 3 also weights;
        activations belong to the GPU's own micro-batch and are never split."""
        stage = self.stage if stage is None else stage
        return {
            Pile.WEIGHTS: shard(piles[Pile.WEIGHTS], self.gpus, stage >= 3),
            Pile.GRADIENTS: shard(piles[Pile.GRADIENTS], self.gpus, stage >= 2),
            Pile.OPTIMIZER_STATE: shard(piles[Pile.OPTIMIZER_STATE], self.gpus, stage >= 1),
            Pile.ACTIVATIONS: piles[Pile.ACTIVATIONS],
        }

    def peak(self, run: dict[str, Any], stage: int | None = None, step: str = "steady") -> int:
        """One GPU's share of a run's peak, split by the composition at that moment."""
        return sum(self.piles(run[step]["peak"], stage).values())


def measure(request: FakeStepRequest) -> list[dict[str, Any]]:
    """Run the child and return its runs, one per requested variant.

    Raises:
        ModelEstimateError: the child's last stderr line (its one-line reason).
    """
    runs = child_json(
        [FAKE_STEP_MODULE, request.to_json()],
        "estimating",
        "the estimate's child printed no result",
        ModelEstimateError,
    )
    return runs if isinstance(runs, list) else []


def reserve_for(device_memory: int) -> int:
    """The margin the verdict keeps free on a device of this size."""
    return max(RESERVE_MIN, int(device_memory * RESERVE_FRACTION))


def verdict_for(peak: int, device_memory: int, largest: int | None = None) -> Verdict:
    """FITS with the reserve to spare; TIGHT within the reserve; DOES_NOT_FIT over the device,
    or where no batch leaves the reserve free (`largest` == 0: the batch-independent piles
    alone take it)."""
    if peak + reserve_for(device_memory) <= device_memory:
        return Verdict.FITS
    if peak > device_memory or largest == 0:
        return Verdict.DOES_NOT_FIT
    return Verdict.TIGHT


def largest_batch(
    base: dict[str, Any], double: dict[str, Any], sharding: Sharding, device_memory: int
) -> int | None:
    """The largest batch whose peak fits with the reserve, from two measured batch sizes.

    A step's peak is the highest of: its start, when the previous step's gradients and the
    optimizer state are live (no activations: independent of the batch); the moment the
    activations peak, at least weights + optimizer state + the activations' high (gradients
    are freed by `zero_grad` before forward); and, when the measured peak held activations,
    that peak itself. The last two are taken as linear in the batch size, which holds for the
    layers that dominate (linear, attention, convolution, normalisation). None when the batch
    has no batch dimension or the double run failed; 0 when not even the batch-independent
    part fits.
    """
    size = base.get("batch_size")
    if not size or "error" in double:
        return None
    usable = device_memory - reserve_for(device_memory)
    if sum(sharding.piles(base["steady"]["end"]).values()) > usable:
        return 0

    def at_activation_high(run: dict[str, Any]) -> int:
        piles = {**run["steady"]["end"], Pile.GRADIENTS: 0}
        piles[Pile.ACTIVATIONS] = run["steady"]["max"][Pile.ACTIVATIONS]
        return sum(sharding.piles(piles).values())

    lines = [(at_activation_high(base), at_activation_high(double))]
    if base["steady"]["peak"][Pile.ACTIVATIONS] and double["steady"]["peak"][Pile.ACTIVATIONS]:
        lines.append((sharding.peak(base), sharding.peak(double)))
    largest: int | None = None
    for low, high in lines:
        per_sample = (high - low) / size
        if per_sample <= 0:
            continue
        fits = max(0, int((usable - (low - per_sample * size)) // per_sample))
        largest = fits if largest is None else min(largest, fits)
    return largest


def smallest_zero_stage(run: dict[str, Any], sharding: Sharding, device_memory: int) -> int | None:
    """The lowest ZeRO stage at which this many GPUs fit the peak with the reserve."""
    if sharding.gpus < 2:
        return None
    for stage in range(4):
        if verdict_for(sharding.peak(run, stage), device_memory) is Verdict.FITS:
            return stage
    return None


def build_result(
    request: FakeStepRequest,
    runs: list[dict[str, Any]],
    sharding: Sharding,
    device_memory: int | None,
) -> dict[str, Any]:
    """The `memtui estimate --json` object for `--batch` (docs/estimate.md): piles, peaks, inputs,
    verdict and what would make it fit."""
    by_variant = {run["variant"]: run for run in runs}
    base = by_variant[Variant.AS_GIVEN.value]
    steady = sharding.piles(base["steady"]["end"])
    result: dict[str, Any] = {name: steady[name] for name in PERSISTENT}
    result["total"] = sum(result.values())
    result[Pile.ACTIVATIONS] = base["steady"]["max"][Pile.ACTIVATIONS]
    result["first_step_peak"] = sharding.peak(base, step="first")
    result["peak"] = sharding.peak(base)
    result["peak_piles"] = sharding.piles(base["steady"]["peak"])
    result["top_modules"] = [
        {"module": name, "bytes": size} for name, size in base["top_modules"][:TOP_MODULES]
    ]
    result["dtypes"] = base["dtypes"]
    result.update(
        params=base["params"],
        trainable=base["trainable"],
        batch_size=base["batch_size"],
        loss_from=base.get("loss_from"),
        model=request.model,
        batch=request.batch,
        optimizer=request.optimizer.value,
        autocast=request.autocast.value if request.autocast else None,
        checkpointing=request.checkpointing,
        accum=request.accum,
        loss=request.loss,
        gpus=sharding.gpus,
        zero=sharding.stage,
        fsdp=sharding.fsdp,
        device_memory=device_memory,
    )
    if device_memory is None:
        return result
    # The job must live through its first step too (it makes the optimizer state).
    peak = max(result["peak"], result["first_step_peak"])
    checkpointed = by_variant.get(Variant.CHECKPOINTED.value)
    double = by_variant.get(Variant.DOUBLE_BATCH.value, {"error": "not run"})
    largest = largest_batch(base, double, sharding, device_memory)
    reserve = reserve_for(device_memory)
    result["verdict"] = {
        "verdict": verdict_for(peak, device_memory, largest).value,
        "margin": device_memory - peak,
        "reserve": reserve,
        "spare": device_memory - reserve - peak,
        "peak_step": "first" if result["first_step_peak"] > result["peak"] else "steady",
    }
    to_fit: dict[str, Any] = {
        "largest_batch": largest,
        "largest_batch_error": double.get("error"),
        "checkpointing_peak": None,
        "checkpointing_saves": None,
        "checkpointing_activations": None,
        "checkpointing_error": None,
        "zero_stage": smallest_zero_stage(base, sharding, device_memory),
    }
    if checkpointed is not None and "error" in checkpointed:
        to_fit["checkpointing_error"] = checkpointed["error"]
    elif checkpointed is not None:
        to_fit["checkpointing_peak"] = sharding.peak(checkpointed)
        to_fit["checkpointing_saves"] = peak - to_fit["checkpointing_peak"]
        to_fit["checkpointing_activations"] = checkpointed["steady"]["max"][Pile.ACTIVATIONS]
    result["to_fit"] = to_fit
    return result


def variants_for(checkpointing: bool, device_memory: int | None) -> list[Variant]:
    """The runs the answer needs: the suggestions cost a double batch and a checkpointed run."""
    variants = [Variant.AS_GIVEN]
    if device_memory is not None:
        variants.append(Variant.DOUBLE_BATCH)
        if not checkpointing:
            variants.append(Variant.CHECKPOINTED)
    return variants


def _row(name: str, value: int) -> str:
    decimal, binary = format_bytes(value, binary=False), format_bytes(value)
    return f"{name:<17}{value:>18,}{decimal:>12}{binary:>12}"


def render_model_text(result: dict[str, Any]) -> str:
    """The table people read, then the heaviest modules, the verdict and what would fit."""
    extras = [result["optimizer"]]
    if result["autocast"]:
        extras.append(f"autocast {result['autocast']}")
    if result["checkpointing"]:
        extras.append("checkpointing")
    if result.get("accum", 1) > 1:
        extras.append(f"accum {result['accum']}")
    size = result["batch_size"]
    batch = f"batch {result['batch']}" + (f" (batch size {size})" if size else "")
    lines = [
        f"{result['model']}, {batch}, {', '.join(extras)}",
        f"{result['params']:,} parameters, {result['trainable']:,} trainable; measured over two "
        "training steps on fake tensors by the agent's own ledger",
    ]
    if result.get("loss"):
        lines.append(f"loss: {result['loss']}(output, batch) (backpropagated each microbatch)")
    elif result.get("loss_from"):
        lines.append(f"loss: the forward's {result['loss_from']} (backpropagated each step)")
    if result.get("accum", 1) > 1:
        lines.append(
            f"accumulation: {result['accum']} microbatches per optimizer step: activations are "
            "one microbatch's; gradients stay live through the later microbatches' forwards"
        )
    lines += [
        "",
        f"{'per GPU':<17}{'bytes':>18}{'decimal':>12}{'binary':>12}",
    ]
    for name in (*PERSISTENT, Pile.ACTIVATIONS, "first_step_peak", "peak"):
        lines.append(_row(name, result[name]))
    lines.append("")
    lines.append("activations: the step's high of saved tensors; peak: the steady-state step's")
    lines.append("highest total of the four piles (first_step_peak: the step that makes the state)")
    if result["gpus"] > 1 or result["zero"]:
        how = "FSDP (as ZeRO stage 3)" if result["fsdp"] else f"ZeRO stage {result['zero']}"
        lines.append(f"sharding: {how} on {result['gpus']} GPUs, ideal even split")
    if result["top_modules"]:
        lines += ["", "top modules by saved activations:"]
        lines += [
            f"  {row['module']:<40}{format_bytes(row['bytes']):>12}"
            for row in result["top_modules"]
        ]
    if result["device_memory"] is not None:
        lines += ["", *_verdict_lines(result)]
    lines += ["", "not included: temporaries between saved tensors, inputs not saved by autograd,"]
    lines.append("communication buffers, the CUDA context and the allocator's cache.")
    return "\n".join(lines)


def _verdict_lines(result: dict[str, Any]) -> list[str]:
    """The verdict, then what would fit: each figure said once, the reserve never counted as
    spare, and a batch called tight always with a smaller one that fits."""
    device, verdict = result["device_memory"], result["verdict"]
    margin, reserve, spare = verdict["margin"], verdict["reserve"], verdict["spare"]
    to_fit = result["to_fit"]
    largest = to_fit["largest_batch"]
    which = "the first step's peak" if verdict["peak_step"] == "first" else "the peak"
    if verdict["verdict"] == Verdict.FITS.value:
        said = f"fits, {format_bytes(spare)} to spare beyond the reserve"
    elif verdict["verdict"] == Verdict.TIGHT.value:
        said = (
            f"tight: {which} leaves {format_bytes(margin)} free, inside the "
            f"{format_bytes(reserve)} reserve (it may run out)"
        )
    elif margin < 0:
        said = f"does not fit: {which} is {format_bytes(-margin)} over the device's memory"
    else:
        said = (
            f"does not fit: {which} leaves {format_bytes(margin)} free, inside the "
            f"{format_bytes(reserve)} reserve, and no smaller batch makes room"
        )
    lines = [
        f"device {format_bytes(device, binary=False)} ({format_bytes(device)}): {said}",
        f"  (reserve {format_bytes(reserve)} kept free for the CUDA context, workspaces and the "
        "allocator's cache and fragmentation)",
    ]
    if largest:
        lines.append(f"  largest batch that fits: about {largest}")
    elif largest == 0:
        usable = device - reserve
        if result["total"] > usable:
            lines.append(
                f"  no batch size fits: weights, gradients and optimizer state alone take "
                f"{format_bytes(result['total'])}, more than the {format_bytes(max(usable, 0))} "
                "left after the reserve"
            )
        else:
            lines.append("  no batch size fits: not even one sample leaves the reserve free")
    elif to_fit["largest_batch_error"]:
        lines.append(f"  largest batch not estimated: {to_fit['largest_batch_error']}")
    if to_fit["checkpointing_saves"] is not None:
        activations = format_bytes(result[Pile.ACTIVATIONS])
        lines.append(
            f"  with checkpointing: activations {activations} -> "
            f"{format_bytes(to_fit['checkpointing_activations'])}, peak "
            f"{format_bytes(to_fit['checkpointing_peak'])} "
            f"(saves {format_bytes(to_fit['checkpointing_saves'])})"
        )
    elif to_fit["checkpointing_error"]:
        lines.append(f"  checkpointing not estimated: {to_fit['checkpointing_error']}")
    if to_fit["zero_stage"] is not None:
        lines.append(f"  on {result['gpus']} GPUs, ZeRO stage {to_fit['zero_stage']} fits")
    elif result["gpus"] > 1:
        lines.append(f"  on {result['gpus']} GPUs no ZeRO stage fits")
    return lines
