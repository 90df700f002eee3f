"""The pytest plugin (memtui_pytest, docs/check.md#in-pytest), run by pytest in a fresh
interpreter (`pytester.runpytest_subprocess`): the agent starts and stops in that process, as it
would in the user's test run, and the plugin reaches it through its `pytest11` entry point.

The inner tests train a tiny MLP for three AdamW steps. Its true peak is known from the job: at
its first step's peak (`optimizer.step()` allocating the state, the activations freed) it holds
the weights and the gradients of `Linear(64, 128)` and `Linear(128, 1)` (8,449 fp32 each), AdamW's
two moments of each and its four fp32 step counters: 135,200 B, far over 64 KiB and far under
64 MiB. One inner session runs every case (an inner run costs seconds of torch imports).
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.slow

PARAMETERS = 64 * 128 + 128 + 128 * 1 + 1
"""The inner MLP's parameters (8,449)."""
PEAK = 4 * PARAMETERS * 4 + 4 * 4
"""Weights, gradients and two AdamW moments in fp32, and AdamW's four fp32 step counters."""

INNER = """
import sys

import pytest
import torch


def train(steps: int = 3) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(torch.randn(32, 64)).pow(2).mean()
        loss.backward()
        optimizer.step()


def test_an_unmarked_test_is_left_alone() -> None:
    train()
    assert "memtui_agent.startup.agent" not in sys.modules


@pytest.mark.memtui(max_peak="64KiB")
def test_too_low() -> None:
    train()


@pytest.mark.memtui(max_peak="64MiB", no_leak=True, no_nan=True, max={"weights": "1MiB"})
def test_generous() -> None:
    train()


@pytest.mark.memtui(max_peak="64MiB")
def test_no_step() -> None:
    with torch.no_grad():
        torch.nn.Linear(8, 8)(torch.randn(2, 8))


@pytest.mark.memtui(max_peak="64KiB")
def test_its_own_failure_stays_its_own() -> None:
    train()
    assert False, "the test's own assertion"


@pytest.mark.memtui(max_peek="64MiB")
def test_a_misspelt_marker() -> None:
    train()
"""


def _section(output: str, test: str) -> str:
    """The failure section pytest printed for one inner test (`_____ test _____` to the next)."""
    match = re.search(rf"_{{3,}} {test} _{{3,}}\n(.*?)(?=\n_{{3,}} |\n={{3,}} )", output, re.S)
    assert match is not None, output
    return match.group(1)


def test_a_marked_test_fails_with_its_piles_and_passes_within_its_limits(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_inner=INNER)
    kept = pytester.path / "recordings"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", "--memtui-keep", kept)
    output = result.stdout.str()
    result.assert_outcomes(passed=2, failed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "PASSED test_inner.py::test_an_unmarked_test_is_left_alone",
            "PASSED test_inner.py::test_generous",
            "ERROR test_inner.py::test_a_misspelt_marker - Failed: memtui*",
            "FAILED test_inner.py::test_too_low",
            "FAILED test_inner.py::test_no_step",
            "FAILED test_inner.py::test_its_own_failure_stays_its_own - AssertionError*",
        ],
        consecutive=False,
    )
    assert "\nmemtui: the memtui marker has no keyword 'max_peek': max_peak, max," in output
    weights = PARAMETERS * 4
    too_low = _section(output, "test_too_low")
    assert too_low.startswith(
        f"peak 132.03 KiB ({PEAK:,} B) at step 1 is over --max-peak 64KiB (65,536 B)"
    ), too_low
    assert re.search(r"weights +33\.00 KiB", too_low), too_low  # 33,796 B
    assert re.search(r"gradients +33\.00 KiB", too_low) and weights == 33_796
    assert re.search(r"optimizer_state +66\.02 KiB", too_low)
    assert re.search(r"peak +132\.03 KiB +limit 64KiB", too_low)
    assert f"recording: {kept / 'test_inner.py_test_too_low.memtui'} (memtui report " in too_low
    assert {path.name for path in kept.iterdir()} == {
        f"test_inner.py_{name}.memtui"
        for name in (
            "test_too_low",
            "test_generous",
            "test_no_step",
            "test_its_own_failure_stays_its_own",
        )
    }  # the unmarked test was not monitored, the misspelt marker's test never ran
    no_step = _section(output, "test_no_step")
    assert no_step.startswith("peak not known: the recording has no step"), no_step
    own = _section(output, "test_its_own_failure_stays_its_own")
    assert "AssertionError: the test's own assertion" in own  # its own failure leads
    assert re.search(r"-+ memtui -+\npeak 132\.03 KiB", own), own  # memtui's said beside it


def test_memtui_lists_every_tests_peak(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_inner=INNER.split('@pytest.mark.memtui(max_peak="64KiB")')[0].replace(
            '    assert "memtui_agent.startup.agent" not in sys.modules\n', ""
        )
    )
    kept = pytester.path / "recordings"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--memtui", "--memtui-keep", kept
    )
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*memtui: peaks (piles + DDP/FSDP buffers)*",
            "  132.03 KiB     3 steps  test_inner.py::test_an_unmarked_test_is_left_alone",
        ]
    )
