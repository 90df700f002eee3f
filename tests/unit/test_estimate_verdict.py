"""`memtui estimate --device-memory`: one verdict, read the same way as what would fit (issue 26).

The reserve (10% of the device, at least 1 GiB) is a working margin, never spare; a batch called
tight always has a smaller one that fits; where no batch size leaves the reserve free the batch
does not fit, and the answer says why, never "largest batch that fits: about 0". Pure arithmetic
on measured runs as the estimate's child returns them: no torch.
"""

from __future__ import annotations

from typing import Any

import pytest

from memtui.reports.model_estimate import (
    Sharding,
    Verdict,
    build_result,
    render_model_text,
    reserve_for,
)
from memtui_protocol.estimate import FakeStepRequest, Variant
from memtui_protocol.units import format_bytes

GB = 10**9
REQUEST = FakeStepRequest("m:f", "m:b", variants=[Variant.AS_GIVEN, Variant.DOUBLE_BATCH])


def _run(
    variant: str, size: int, state: dict[str, int], per_sample: int, first_peak: int = 0
) -> dict[str, Any]:
    """A run of `size` samples: `per_sample` bytes of activations each; the steady peak where
    the step's total is highest, at the activations' high (the gradients freed by zero_grad)
    or at its close (the gradients made); the first step's peak `first_peak` (its optimizer
    state made at its end: default, below the steady one)."""
    activations = per_sample * size
    end = dict(state, activations=0)
    peak = dict(state, gradients=0, activations=activations)
    if sum(end.values()) > sum(peak.values()):
        peak = end
    steady = {"end": end, "max": dict(end, activations=activations), "peak": peak}
    first_piles = dict(state, optimizer_state=0, activations=first_peak)
    first = {"end": end, "max": steady["max"], "peak": first_piles}
    return {
        "variant": variant,
        "batch_size": size,
        "first": first,
        "steady": steady,
        "params": 1,
        "trainable": 1,
        "top_modules": [],
        "dtypes": {},
    }


STATE = {"weights": 10 * GB, "gradients": 10 * GB, "optimizer_state": 20 * GB}
"""Weights and gradients 10 GB each, optimizer state 20 GB (a 2.5B model, fp32 + Adam)."""


def _result(device: int, state: dict[str, int] = STATE, **run: int) -> dict[str, Any]:
    size, per_sample = run.get("size", 8), run.get("per_sample", 3 * GB)
    first_peak = run.get("first_peak", 0)
    runs = [
        _run("as_given", size, state, per_sample, first_peak),
        _run("double_batch", 2 * size, state, per_sample, first_peak),
    ]
    return build_result(REQUEST, runs, Sharding(), device)


def test_the_reserve_is_never_spare() -> None:
    result = _result(100 * GB)  # peak 10 + 20 + 24 = 54 GB, reserve 10 GB
    verdict = result["verdict"]
    assert verdict["verdict"] == Verdict.FITS.value
    assert verdict["margin"] == 46 * GB and verdict["reserve"] == 10 * GB
    assert verdict["spare"] == 36 * GB
    text = render_model_text(result)
    assert f"fits, {format_bytes(36 * GB)} to spare beyond the reserve" in text
    assert format_bytes(46 * GB) not in text
    # (100 - 10 - 30) / 3 = 20 samples leave the reserve free.
    assert "largest batch that fits: about 20" in text


def test_where_no_batch_leaves_the_reserve_free_it_does_not_fit() -> None:
    """40 GB of weights, gradients and optimizer state on a 42 GB device: a peak of 40 GB is
    under the device, but no batch at all leaves the 4.2 GB reserve free."""
    state = {"weights": 10 * GB, "gradients": 10 * GB, "optimizer_state": 20 * GB}
    result = _result(42 * GB, state, size=2, per_sample=GB // 4)
    assert result["to_fit"]["largest_batch"] == 0
    assert result["verdict"]["verdict"] == Verdict.DOES_NOT_FIT.value
    text = render_model_text(result)
    assert "tight" not in text and "about 0" not in text
    assert "does not fit: the peak leaves" in text and "no smaller batch makes room" in text
    assert (
        f"no batch size fits: weights, gradients and optimizer state alone take "
        f"{format_bytes(40 * GB)}, more than the {format_bytes(42 * GB - reserve_for(42 * GB))} "
        "left after the reserve"
    ) in text


def test_a_tight_batch_has_a_smaller_one_that_fits() -> None:
    result = _result(58 * GB, size=8)  # peak 54 GB; usable 52.2 GB: tight
    assert result["verdict"]["verdict"] == Verdict.TIGHT.value
    largest = result["to_fit"]["largest_batch"]
    assert 1 <= largest < 8
    text = render_model_text(result)
    assert "tight: the peak leaves" in text and f"largest batch that fits: about {largest}" in text


def test_the_first_steps_peak_counts_when_it_is_higher() -> None:
    """docs/health.md: a model that fits during the forward can fail at the first Adam step."""
    result = _result(100 * GB, first_peak=72 * GB)  # first step: 10 + 10 + 72 = 92 GB
    verdict = result["verdict"]
    assert verdict["peak_step"] == "first"
    assert verdict["verdict"] == Verdict.TIGHT.value and verdict["margin"] == 8 * GB
    assert "tight: the first step's peak leaves" in render_model_text(result)


@pytest.mark.parametrize("device_gb", range(36, 140, 3))
def test_the_verdict_and_the_largest_batch_agree(device_gb: int) -> None:
    device = device_gb * GB
    result = _result(device, size=8)
    verdict, largest = result["verdict"], result["to_fit"]["largest_batch"]
    assert verdict["spare"] == device - reserve_for(device) - result["peak"]
    if verdict["verdict"] == Verdict.FITS.value:
        assert verdict["spare"] >= 0 and largest >= 8
    elif verdict["verdict"] == Verdict.TIGHT.value:
        assert verdict["spare"] < 0 <= verdict["margin"] and 1 <= largest < 8
    else:
        assert largest < 8
    assert "about 0" not in render_model_text(result)
