"""`memtui estimate --what-if`: the same model under other choices, in one table.

Which change makes a job fit is the question after "does it fit?", and the answer differs by
pile: a smaller batch or accumulation shrinks activations, bf16 autocast the saved activations,
bf16 weights the weights and gradients (and AdamW's moments, kept in the parameters' dtype), a
lighter optimizer its state, sharding the persistent piles. So every row shows the four piles and
the peak per GPU, and, given `--device-memory` (or a budget), whether it fits.

Rows a training step can show are measured: the fake-step child trains each change as its own
run (`WhatIf`, memtui_protocol.estimate). The rest are arithmetic over a measured row, by the
bytes-per-parameter ledger (docs/numbers.md): an 8-bit optimizer state (two 1-byte moments per
trainable parameter), ZeRO stages 1-3 and FSDP over R ranks (`Sharding`, as ZeRO stage 3).
Standard library only: the viewer never imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from memtui.reports.model_estimate import PERSISTENT, Sharding, Verdict, verdict_for
from memtui_protocol.estimate import WhatIf
from memtui_protocol.schema import Pile
from memtui_protocol.units import format_bytes

EIGHT_BIT_STATE = 2
"""Bytes per trainable parameter of an 8-bit Adam state: two moments of 1 byte each. The
quantization's block scales and the step counters are not counted (they depend on the
library's block size)."""
DEFAULT_RANKS = 8
"""The ranks the sharded rows assume when `--gpus` gives one."""
PILES = (*PERSISTENT, Pile.ACTIVATIONS)


@dataclass(frozen=True)
class WhatIfRow:
    """One row: what changed, the piles and peak per GPU, and whether it fits."""

    row: str
    change: str
    source: str
    """`measured` (a training step on fake tensors) or `arithmetic` (over a measured row)."""
    weights: int | None = None
    gradients: int | None = None
    optimizer_state: int | None = None
    activations: int | None = None
    peak: int | None = None
    """The higher of the first step's peak and the steady one's."""
    fits: bool | None = None
    """None: no memory to fit given, or the row could not be measured."""
    error: str | None = None


def _peak(run: dict[str, Any], sharding: Sharding, stage: int | None = None) -> int:
    return max(sharding.peak(run, stage, "first"), sharding.peak(run, stage, "steady"))


def _piles(run: dict[str, Any], sharding: Sharding, stage: int | None = None) -> dict[str, int]:
    piles = {**run["steady"]["end"], Pile.ACTIVATIONS: run["steady"]["max"][Pile.ACTIVATIONS]}
    return sharding.piles(piles, stage)


def fits(peak: int, device_memory: int | None, budget: int | None = None) -> bool | None:
    """Under the budget (the peak itself) or on the device with the reserve kept free."""
    if budget is not None:
        return peak <= budget
    if device_memory is not None:
        return verdict_for(peak, device_memory) is Verdict.FITS
    return None


def measured_row(
    row: str,
    change: str,
    run: dict[str, Any],
    *,
    device_memory: int | None,
    budget: int | None,
    sharding: Sharding,
    stage: int | None = None,
    source: str = "measured",
) -> WhatIfRow:
    """A row from a run's piles, split as `sharding` (at `stage`) splits them."""
    if "error" in run:
        return WhatIfRow(row, change, source, error=run["error"])
    peak = _peak(run, sharding, stage)
    piles = _piles(run, sharding, stage)
    return WhatIfRow(
        row,
        change,
        source,
        weights=piles[Pile.WEIGHTS],
        gradients=piles[Pile.GRADIENTS],
        optimizer_state=piles[Pile.OPTIMIZER_STATE],
        activations=piles[Pile.ACTIVATIONS],
        peak=peak,
        fits=fits(peak, device_memory, budget),
    )


def eight_bit(run: dict[str, Any]) -> dict[str, Any]:
    """An AdamW run with its state as two 1-byte moments per trainable parameter.

    The state in every composition (each step's end, high and peak) is scaled by the same
    ratio, 8-bit state / measured state, so the peak keeps its moment: arithmetic, not a step.
    """
    if "error" in run:
        return run
    measured = run["steady"]["end"][Pile.OPTIMIZER_STATE]
    state = EIGHT_BIT_STATE * run["trainable"]

    def scaled(piles: dict[str, int]) -> dict[str, int]:
        old = piles[Pile.OPTIMIZER_STATE]
        return {**piles, Pile.OPTIMIZER_STATE: old * state // measured if measured else 0}

    return {
        **run,
        **{
            step: {when: scaled(run[step][when]) for when in ("end", "max", "peak")}
            for step in ("first", "steady")
        },
    }


def what_if_table(
    runs: list[dict[str, Any]],
    result: dict[str, Any],
    device_memory: int | None,
    budget: int | None = None,
) -> dict[str, Any]:
    """The `what_if` object of `memtui estimate --json`: the rows, as given first.

    `runs` are the child's runs (the request's own, then one per `WhatIf`); `result` is
    `build_result`'s object for the request (its optimizer, autocast, accumulation, sharding).
    """
    own = next(run for run in runs if run["variant"] == "as_given" and not run.get("what_if"))
    by_what_if = {run["what_if"]: run for run in runs if run.get("what_if")}
    sharding = Sharding(result["gpus"], result["zero"], result["fsdp"])
    ranks = result["gpus"] if result["gpus"] > 1 else DEFAULT_RANKS
    size = own.get("batch_size")
    accum = result.get("accum", 1)
    measure: dict[str, Any] = {"device_memory": device_memory, "budget": budget}
    rows = [measured_row("as given", _as_given(result), own, sharding=sharding, **measure)]
    changes: list[tuple[WhatIf, str, str]] = [
        (WhatIf.BATCH_X2, "batch x2", f"batch {size * 2}" if size else "dim 0 doubled"),
        (WhatIf.ACCUM_X2, f"accum {accum * 2}", f"{accum * 2} microbatches per step"),
        (WhatIf.AUTOCAST_BF16, "bf16 autocast", "forward under torch.autocast(bfloat16)"),
        (WhatIf.WEIGHTS_BF16, "bf16 weights", "model.to(torch.bfloat16)"),
        (WhatIf.ADAMW, "AdamW", "torch.optim.AdamW"),
        (WhatIf.MOMENTUM, "SGD momentum", "torch.optim.SGD(momentum=0.9)"),
        (WhatIf.ADAFACTOR, "Adafactor", "torch.optim.Adafactor"),
    ]
    for what_if, row, change in changes:
        if what_if.value in by_what_if and not _same(what_if, result):
            run = by_what_if[what_if.value]
            rows.append(measured_row(row, change, run, sharding=sharding, **measure))
    adamw = own if result["optimizer"] == "adamw" else by_what_if.get(WhatIf.ADAMW.value)
    if adamw is not None:
        rows.append(
            measured_row(
                "8-bit AdamW",
                "two 1-byte moments per parameter (scales not counted)",
                eight_bit(adamw),
                sharding=sharding,
                source="arithmetic",
                **measure,
            )
        )
    for stage, row in ((1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3"), (3, "FSDP")):
        how = "as ZeRO-3, gathered layers not counted" if row == "FSDP" else f"stage {stage}"
        rows.append(
            measured_row(
                f"{row} x{ranks}",
                f"{how} on {ranks} ranks",
                own,
                sharding=Sharding(ranks, stage),
                stage=stage,
                source="arithmetic",
                **measure,
            )
        )
    return {"ranks": ranks, "rows": [asdict(row) for row in rows]}


def _as_given(result: dict[str, Any]) -> str:
    extras = [result["optimizer"]]
    if result.get("autocast"):
        extras.append(f"autocast {result['autocast']}")
    if result.get("accum", 1) > 1:
        extras.append(f"accum {result['accum']}")
    return ", ".join(extras)


def _same(what_if: WhatIf, result: dict[str, Any]) -> bool:
    """A row that changes nothing (the request already has it) is left out."""
    if what_if in (WhatIf.ADAMW, WhatIf.MOMENTUM, WhatIf.ADAFACTOR):
        return bool(result["optimizer"] == what_if.value)
    return what_if is WhatIf.AUTOCAST_BF16 and result.get("autocast") == "bf16"


def render_what_if(table: dict[str, Any]) -> list[str]:
    """The table people read: one line a row, the piles and the peak per GPU, and the fit."""
    head = f"{'what if':<16}{'weights':>11}{'gradients':>11}{'opt state':>11}"
    head += f"{'activations':>13}{'peak':>11}  fits"
    lines = ["what if (per GPU; arithmetic rows marked *):", head]
    for row in table["rows"]:
        name = row["row"] + ("*" if row["source"] == "arithmetic" else "")
        if row["error"]:
            lines.append(f"{name:<16}not measured: {row['error']}")
            continue
        figures = "".join(
            f"{format_bytes(row[pile]):>{13 if pile == Pile.ACTIVATIONS else 11}}" for pile in PILES
        )
        fit = {True: "yes", False: "no", None: "-"}[row["fits"]]
        lines.append(f"{name:<16}{figures}{format_bytes(row['peak']):>11}  {fit}")
    lines.append(
        "* 8-bit: the measured AdamW row with two 1-byte moments a parameter (block scales and "
        "step counters not counted); ZeRO/FSDP: the as-given row's piles split as the "
        "bytes-per-parameter ledger splits them (gathers and communication buffers not counted)"
    )
    return lines
