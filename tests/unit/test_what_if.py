"""The what-if table's arithmetic against the seeds' bytes-per-parameter ledger.

A run here is the fake-step child's answer written by hand for a 1B-parameter model under
mixed-precision Adam (2 + 2 bytes of weights and gradients, 12 of state: 16 GB), so the sharded
rows can be compared with the ZeRO paper's figures on 8 GPUs (stage 1: 5.5 GB, stage 2:
3.75 GB, stage 3: 2 GB before activations).
"""

from __future__ import annotations

from typing import Any

from memtui.reports.what_if import EIGHT_BIT_STATE, eight_bit, fits, render_what_if, what_if_table

GB = 10**9
ACTIVATIONS = 3 * GB


def _piles(weights: int, gradients: int, state: int, activations: int) -> dict[str, int]:
    return {
        "weights": weights,
        "gradients": gradients,
        "optimizer_state": state,
        "activations": activations,
    }


def _run(state: int = 12 * GB, what_if: str | None = None, **extra: Any) -> dict[str, Any]:
    end = _piles(2 * GB, 2 * GB, state, 0)
    step = {
        "end": end,
        "max": _piles(2 * GB, 2 * GB, state, ACTIVATIONS),
        # the peak: the activations' high with the gradients freed by zero_grad
        "peak": _piles(2 * GB, 0, state, ACTIVATIONS),
    }
    first = {**step, "peak": _piles(2 * GB, 2 * GB, state, 0)}
    run = {"variant": "as_given", "params": GB, "trainable": GB, "batch_size": 8}
    run.update(first=first, steady=step, what_if=what_if, **extra)
    return run


def _result(optimizer: str = "adamw", gpus: int = 1) -> dict[str, Any]:
    return {"gpus": gpus, "zero": 0, "fsdp": False, "optimizer": optimizer, "autocast": None}


def _rows(runs: list[dict[str, Any]], **options: Any) -> dict[str, dict[str, Any]]:
    table = what_if_table(runs, _result(**options), device_memory=None)
    return {row["row"]: row for row in table["rows"]}


def test_sharded_rows_are_the_seeds_zero_figures_on_eight_gpus() -> None:
    rows = _rows([_run()])
    persistent = {
        name: rows[name]["weights"] + rows[name]["gradients"] + rows[name]["optimizer_state"]
        for name in ("as given", "ZeRO-1 x8", "ZeRO-2 x8", "ZeRO-3 x8", "FSDP x8")
    }
    assert persistent == {
        "as given": 16 * GB,
        "ZeRO-1 x8": 5_500_000_000,
        "ZeRO-2 x8": 3_750_000_000,
        "ZeRO-3 x8": 2 * GB,
        "FSDP x8": 2 * GB,  # FSDP full sharding: stage 3's split
    }
    for name in ("ZeRO-1 x8", "ZeRO-2 x8", "ZeRO-3 x8"):
        assert rows[name]["activations"] == ACTIVATIONS  # each rank's own microbatch
        assert rows[name]["source"] == "arithmetic"
    # Peak: the activations' moment (no gradients) with the state and weights split.
    assert rows["ZeRO-1 x8"]["peak"] == 2 * GB + 12 * GB // 8 + ACTIVATIONS
    assert rows["ZeRO-3 x8"]["peak"] == 2 * GB // 8 + 12 * GB // 8 + ACTIVATIONS


def test_ranks_follow_gpus_and_round_up() -> None:
    rows = _rows([_run(state=12 * GB + 1)], gpus=3)
    assert rows["ZeRO-1 x3"]["optimizer_state"] == (12 * GB + 1 + 2) // 3


def test_eight_bit_state_is_two_bytes_a_parameter_in_every_composition() -> None:
    run = _run(state=8 * GB + 4 * 100)  # fp32 AdamW: two moments and 100 step tensors
    scaled = eight_bit(run)
    assert scaled["steady"]["end"]["optimizer_state"] == EIGHT_BIT_STATE * GB
    assert scaled["steady"]["peak"]["optimizer_state"] == EIGHT_BIT_STATE * GB
    rows = _rows([run])
    assert rows["8-bit AdamW"]["optimizer_state"] == 2 * GB
    assert rows["8-bit AdamW"]["peak"] == 2 * GB + 2 * GB + ACTIVATIONS


def test_measured_rows_come_from_their_own_runs_and_same_rows_are_left_out() -> None:
    momentum = _run(state=4 * GB, what_if="momentum")
    adamw = _run(state=8 * GB, what_if="adamw")
    rows = _rows([_run(), momentum, adamw], optimizer="adam")
    assert rows["SGD momentum"]["optimizer_state"] == 4 * GB
    assert rows["AdamW"]["source"] == "measured"
    assert rows["8-bit AdamW"]["optimizer_state"] == 2 * GB  # from the AdamW row
    assert "AdamW" not in _rows([_run(), adamw], optimizer="adamw")


def test_a_row_that_failed_says_why() -> None:
    failed = {"variant": "as_given", "error": "bf16 says no", "what_if": "weights_bf16"}
    row = _rows([_run(), failed])["bf16 weights"]
    assert row["error"] == "bf16 says no" and row["peak"] is None and row["fits"] is None
    table = what_if_table([_run(), failed], _result(), None)
    assert any("not measured: bf16 says no" in line for line in render_what_if(table))


def test_fits_under_a_budget_or_the_device_with_its_reserve() -> None:
    assert fits(10 * GB, None) is None
    assert fits(10 * GB, None, budget=10 * GB) is True
    assert fits(10 * GB, None, budget=10 * GB - 1) is False
    assert fits(10 * GB, 11 * GB) is False  # 1.1 GB reserve leaves 9.9 GB
    assert fits(10 * GB, 12 * GB) is True
    table = what_if_table([_run()], _result(), device_memory=80 * GB)
    marks = {row["row"]: row["fits"] for row in table["rows"]}
    assert marks["as given"] is True  # 16 GB + 3 GB of activations fit 80 GB
