"""`memtui estimate --budget`: the checkpointing plan, checked by training with it for real.

The fixture (tests/fixtures/checkpoint_blocks.py) is a transformer-like model of 4 repeated
blocks whose activations are most of its peak. With a budget between the fully checkpointed
and the plain peak the estimate names blocks to wrap; the same model then trains for real under
`memtui run --activations every` with exactly those blocks wrapped in
`torch.utils.checkpoint.checkpoint` (non-reentrant, as users are told, and reentrant, whose
recomputation the agent's hooks see), and the measured peak must be at or under the budget and
within 5% of the plan's `peak_after`. A budget under what every block wrapped leaves gives no
plan, with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui
from repo_paths import FIXTURES

pytestmark = pytest.mark.slow  # each test starts several torch children

MODEL = ("--model", "checkpoint_blocks:model", "--batch", "checkpoint_blocks:batch")
BUDGET = 12_000_000
"""Between the plain peak (21.3 MB: AdamW, 8x128 tokens) and all 4 blocks wrapped (7.9 MB)."""


def _estimate(*extra: str) -> dict[str, Any]:
    result = run_memtui("estimate", *MODEL, "--json", *extra, cwd=FIXTURES, timeout=300)
    assert result.returncode == 0, result.stderr
    estimated: dict[str, Any] = json.loads(result.stdout)
    return estimated


def _measured_peak(tmp_path: Path, modules: list[str], *flags: str) -> int:
    """The highest step peak `memtui run` records while the model trains with `modules`
    wrapped (3 steps)."""
    recording = tmp_path / f"run{len(flags)}-{len(modules)}.memtui"
    script = str(FIXTURES / "checkpoint_blocks.py")
    ran = run_memtui(
        "run",
        "--headless",
        "--activations",
        "every",
        "-o",
        str(recording),
        script,
        "--wrap",
        ",".join(modules),
        *flags,
        cwd=FIXTURES,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    report = run_memtui("report", str(recording), "--json", cwd=FIXTURES)
    assert report.returncode == 0, report.stderr
    steps = json.loads(report.stdout)["steps"]
    assert len(steps) == 3
    return max(int(step["peak"]["total"]) for step in steps)


def test_the_plan_from_a_recording_bounds_the_peak_the_job_then_measures(tmp_path: Path) -> None:
    """`memtui estimate --from`: the plain run's recording holds each block's saved and input
    bytes; the plan it gives is the measured plan's blocks, and its bound is at or above the
    peak `memtui run` measures with them wrapped, and at or under the budget."""
    plain = _measured_peak(tmp_path, [])
    recording = tmp_path / "run0-0.memtui"
    result = run_memtui(
        "estimate", "--from", str(recording), "--budget", str(BUDGET), "--json", cwd=FIXTURES
    )
    assert result.returncode == 0, result.stderr
    recorded = json.loads(result.stdout)
    assert recorded["peak"] == plain
    assert [block["module"] for block in recorded["blocks"]] == [f"blocks.{i}" for i in range(4)]
    plan = recorded["checkpoint_plan"]
    assert plan is not None, recorded["checkpoint_plan_reason"]
    assert plan["bound"] is True and plan["recompute"] is None
    measured_plan = _estimate("--budget", str(BUDGET))["checkpoint_plan"]
    assert plan["modules"] == measured_plan["modules"]
    measured = _measured_peak(tmp_path, plan["modules"])
    assert measured <= plan["peak_after"] <= BUDGET


def test_the_plan_fits_when_the_job_trains_with_it(tmp_path: Path) -> None:
    estimated = _estimate("--budget", str(BUDGET))
    assert estimated["peak"] > BUDGET
    plan = estimated["checkpoint_plan"]
    assert plan is not None, estimated["checkpoint_plan_reason"]
    assert 0 < len(plan["modules"]) < 4
    assert all(name.startswith("blocks.") for name in plan["modules"])
    assert plan["peak_after"] <= BUDGET
    # 4 blocks of 100.7 MFLOP forward each in a step of 1,308.6 MFLOP (forward and backward).
    assert plan["recompute"] == pytest.approx(len(plan["modules"]) * 100_663_296 / 1_308_622_848)
    for flags in ((), ("--reentrant",)):
        measured = _measured_peak(tmp_path, plan["modules"], *flags)
        assert measured <= BUDGET
        assert abs(measured - plan["peak_after"]) <= 0.05 * plan["peak_after"]


def test_a_forward_that_returns_logits_gets_the_same_plan_with_its_loss() -> None:
    """The block profile calls the forward as the training steps do: with `--loss` the batch's
    labels go to the loss, not to a forward that does not take them (the profile failed with
    'unexpected keyword argument' and no plan was given)."""
    in_forward = _estimate("--budget", str(BUDGET))["checkpoint_plan"]
    result = run_memtui(
        "estimate",
        "--model",
        "checkpoint_blocks:logits_model",
        "--batch",
        "checkpoint_blocks:batch",
        "--loss",
        "checkpoint_blocks:logits_loss",
        "--budget",
        str(BUDGET),
        "--json",
        cwd=FIXTURES,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    estimated = json.loads(result.stdout)
    plan = estimated["checkpoint_plan"]
    assert plan is not None, estimated["checkpoint_plan_reason"]
    assert plan["modules"] == in_forward["modules"]
    assert plan["peak_after"] <= BUDGET


def test_a_budget_no_plan_reaches_gives_null_and_why() -> None:
    estimated = _estimate("--budget", "4000000")
    assert estimated["checkpoint_plan"] is None
    reason = estimated["checkpoint_plan_reason"]
    assert "with all 4 blocks checkpointed the peak is still" in reason


def test_text_names_the_modules_to_wrap() -> None:
    result = run_memtui("estimate", *MODEL, "--budget", "12MB", cwd=FIXTURES, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "wrap 3 module(s) in torch.utils.checkpoint.checkpoint(use_reentrant=False):" in (
        result.stdout
    )
    assert "blocks.0, blocks.1, blocks.2" in result.stdout


def test_budget_without_a_batch_is_one_line() -> None:
    result = run_memtui("estimate", "--params", "7B", "--budget", "40GB", cwd=FIXTURES)
    assert result.returncode != 0
    assert "--budget needs --model and --batch" in result.stderr
    assert "Traceback" not in result.stderr
