"""Numerical health and will-it-fit: non-finite origins, GradScaler, forecasts, budgets, OOM."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI

from memtui.model.recording import read_recording
from memtui.reports.report import build_report

pytestmark = pytest.mark.slow  # torch jobs, in the session's shared interpreter (`shared_python`)

NAN_JOB = """
import sys, torch, memtui_agent
mode, inject = sys.argv[1], sys.argv[2]
torch.manual_seed(0)

class Boom(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.step = 0
    def forward(self, x):
        y = self.lin(x)
        if inject == "activation" and self.step == 3:
            y = y * float("inf")
        return y

with memtui_agent.monitor(record="rec.memtui", socket=False, nan_check=mode):
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.ReLU(), Boom(), torch.nn.Linear(8, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 6):
        model[2].step = step
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if inject == "gradient" and step == 3:
            model[3].weight.grad[0, 0] = float("nan")
        opt.step()
"""

SCALER_JOB = """
import torch, memtui_agent
torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(2, 8)).pow(2).mean()).backward()
        if step == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # wrong: before unscale_
        if step == 1:
            model.weight.grad[0, 0] = float("inf")
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
"""

FORECAST_JOB = """
import sys, torch, memtui_agent

name, kwargs = sys.argv[1], eval(sys.argv[2])
torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3, bias=False))
    model[1].weight.requires_grad_(False)  # frozen: no state for it
    opt = getattr(torch.optim, name)(model.parameters(), **kwargs)
    opt.zero_grad()
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    truth = {}
    for state in opt.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                truth[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    print("TRUTH", sum(truth.values()))
"""

OOM_JOB = """
import torch, memtui_agent
class Greedy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0
    def forward(self, x):
        self.calls += 1
        if self.calls == 2:
            torch.empty(1 << 62, dtype=torch.uint8)
        return self.lin(x)
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = torch.nn.Sequential(Greedy())
    opt = torch.optim.Adam(model.parameters())
    for _ in range(3):
        opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
"""

BUDGET_JOB = """
import torch, memtui_agent
with memtui_agent.monitor(record="rec.memtui", socket=False, budget=int(__import__("sys").argv[1])):
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        opt.zero_grad(); model(torch.randn(8, 256)).sum().backward(); opt.step()
"""


def _run(
    shared_python: Any, tmp_path: Path, source: str, *args: str, ok: bool = True
) -> tuple[str, Any]:
    result = shared_python(source, *args)
    if ok:
        assert result.returncode == 0, result.stderr
    return result.stdout, build_report(read_recording(tmp_path / "rec.memtui"))


def _alerts(report: dict[str, Any], step: int) -> list[dict[str, Any]]:
    return [alert for alert in report["alerts"] if alert["step"] == step]


def test_full_mode_names_the_module_whose_output_turned_nonfinite(
    tmp_path: Path, shared_python: Any
) -> None:
    _, report = _run(shared_python, tmp_path, NAN_JOB, "full", "activation")
    assert not any(alert["step"] < 3 for alert in report["alerts"])
    first = _alerts(report, 3)
    kinds = [alert["kind"] for alert in first]
    assert kinds == ["nonfinite_activation", "nonfinite_loss", "nonfinite_gradient"]
    assert first[0]["where"] == "2"  # Sequential index of Boom, the injecting module
    assert "from finite inputs" in first[0]["message"]
    assert all("group" not in alert for alert in first)
    # Later steps are non-finite only because the update made the weights NaN: grouped.
    later = [alert for alert in report["alerts"] if alert["step"] > 3]
    assert later and all(alert.get("group") == 3 for alert in later)


INPLACE_JOB = """
import torch, memtui_agent
torch.manual_seed(0)

class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)
        self.step = 0
    def forward(self, x):
        y = self.a(x)
        if self.step == 2:
            y.mul_(float("inf"))  # written in place between two modules, by no module
        return self.b(y)

with memtui_agent.monitor(record="rec.memtui", socket=False, nan_check="full"):
    model = Pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        model.step = step
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
"""


def test_full_mode_sees_an_input_written_in_place_after_the_previous_module(
    tmp_path: Path, shared_python: Any
) -> None:
    # `b`'s input is `a`'s output, whose flag is reused when unchanged; here it was modified
    # in place after `a` returned, so `b` must be told its input was already non-finite.
    _, report = _run(shared_python, tmp_path, INPLACE_JOB)
    first = _alerts(report, 2)
    assert first[0]["kind"] == "nonfinite_activation"
    assert first[0]["where"] == "b"
    assert "input of b was already non-finite" in first[0]["message"]
    assert not _alerts(report, 1)


HUGE_FINITE_JOB = """
import torch, memtui_agent
torch.manual_seed(0)

class Scale(torch.nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.factor = factor
    def forward(self, x):
        return x * self.factor

with memtui_agent.monitor(record="rec.memtui", socket=False, nan_check="full"):
    model = torch.nn.Sequential(Scale(1.5), Scale(1e-37), torch.nn.Linear(100, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        x = torch.rand(4, 100) * 1e38 + 1e38  # every element finite, their sum past 3.4e38
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
"""


def test_full_mode_never_calls_large_finite_values_non_finite(
    tmp_path: Path, shared_python: Any
) -> None:
    # A float32 sum of the batch overflows; the probe must look at the values, not their sum.
    _, report = _run(shared_python, tmp_path, HUGE_FINITE_JOB)
    assert len(report["steps"]) == 3
    assert not [alert for alert in report["alerts"] if "nonfinite" in alert["kind"]]


def test_default_mode_flags_the_step_and_groups_the_poisoned_steps_after_it(
    tmp_path: Path, shared_python: Any
) -> None:
    _, report = _run(shared_python, tmp_path, NAN_JOB, "default", "activation")
    first = _alerts(report, 3)
    assert [alert["kind"] for alert in first] == ["nonfinite_loss", "nonfinite_gradient"]
    assert "2.lin.weight" in first[1]["where"]
    # Step 4 is armed, but its weights were poisoned by step 3's update: its alerts fold under
    # step 3 and name no module as an origin.
    later = _alerts(report, 4)
    assert later and all(alert["group"] == 3 for alert in later)
    assert "nonfinite_activation" not in [alert["kind"] for alert in later]
    assert all("poisoned by step 3's update" in alert["message"] for alert in later)


def test_nonfinite_gradient_under_finite_loss_names_the_parameter(
    tmp_path: Path, shared_python: Any
) -> None:
    _, report = _run(shared_python, tmp_path, NAN_JOB, "default", "gradient")
    first = _alerts(report, 3)
    assert [alert["kind"] for alert in first] == ["nonfinite_gradient"]
    assert first[0]["where"] == "3.weight"
    assert "under a finite loss" in first[0]["message"]


def test_off_mode_checks_nothing(tmp_path: Path, shared_python: Any) -> None:
    _, report = _run(shared_python, tmp_path, NAN_JOB, "off", "gradient")
    assert not [a for a in report["alerts"] if a["kind"].startswith("nonfinite")]


def test_grad_scaler_skip_with_scales_and_clip_order_warning(
    tmp_path: Path, shared_python: Any
) -> None:
    _, report = _run(shared_python, tmp_path, SCALER_JOB)
    steps = report["steps"]
    assert [step["skipped"] for step in steps] == [False, True, False]
    assert [step["scale"] for step in steps] == [1024.0, 1024.0, 512.0]
    kinds = [alert["kind"] for alert in _alerts(report, 1)]
    assert "clip_before_unscale" in kinds  # clipping scaled gradients: the wrong order
    skipped = _alerts(report, 2)
    assert [alert["kind"] for alert in skipped] == ["skipped_step"]
    assert "1024 -> 512" in skipped[0]["message"]
    assert not _alerts(report, 3)  # the correct order (unscale_, then clip) is not flagged


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("Adam", {}),
        ("AdamW", {"foreach": False}),
        ("Adam", {"amsgrad": True}),
        ("SGD", {"lr": 0.1}),
        ("SGD", {"lr": 0.1, "momentum": 0.9}),
        ("RMSprop", {}),
        ("RMSprop", {"momentum": 0.9, "centered": True}),
        ("Adagrad", {}),
        ("Adafactor", {}),
    ],
)
def test_first_step_forecast_equals_what_the_step_allocates(
    tmp_path: Path, name: str, kwargs: dict[str, Any], shared_python: Any
) -> None:
    stdout, report = _run(shared_python, tmp_path, FORECAST_JOB, name, repr(kwargs))
    truth = int(stdout.split("TRUTH")[1])
    step = report["steps"][0]
    assert step["end"]["optimizer_state"] == truth
    growth = [alert for alert in step["alerts"] if alert["kind"] == "first_step_growth"]
    if truth == 0 or name == "Adagrad":  # Adagrad allocates its state in __init__, not step()
        assert not growth
    else:
        assert "as forecast" in growth[0]["message"]
        assert f"({truth:,} bytes)" in growth[0]["message"]
        # Shown before the step ran, so a user sees it before an OOM in step() could strike.
        early = [a for a in report["alerts"] if a["kind"] == "first_step_forecast"]
        assert len(early) == 1 and f"({truth:,} bytes)" in early[0]["message"]


def test_cpu_out_of_memory_in_forward_is_recorded_with_step_phase_and_size(
    tmp_path: Path, shared_python: Any
) -> None:
    _, report = _run(shared_python, tmp_path, OOM_JOB, ok=False)
    ending = report["exit"]
    assert ending["status"] == "error" and ending["oom"] is True
    assert (ending["step"], ending["phase"]) == (2, "forward")
    assert ending["requested"] == 1 << 62
    assert ending["piles"]["weights"] == (16 + 4) * 4
    oom = [alert for alert in report["alerts"] if alert["kind"] == "oom"]
    assert len(oom) == 1 and oom[0]["step"] == 2
    text = subprocess.run(
        [*MEMTUI, "report", str(tmp_path / "rec.memtui")],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert text.splitlines()[0].startswith("OUT OF MEMORY at step 2")


def test_budget_forecast_warns_before_the_first_step(tmp_path: Path, shared_python: Any) -> None:
    weights = (256 * 256 + 256) * 4
    # Fits weights and gradients, not the AdamW moments the first step will add.
    _, report = _run(shared_python, tmp_path, BUDGET_JOB, str(3 * weights))
    over = [alert for alert in report["alerts"] if alert["kind"] == "over_budget"]
    assert over and over[0]["step"] == 1
    assert over[0]["where"] == "optimizer_state"
    assert "will allocate" in over[0]["message"]


def test_budget_not_exceeded_gives_no_alert(tmp_path: Path, shared_python: Any) -> None:
    _, report = _run(shared_python, tmp_path, BUDGET_JOB, str(10**9))
    assert not [alert for alert in report["alerts"] if alert["kind"] == "over_budget"]


def test_report_json_keeps_group_and_contract_keys(tmp_path: Path, shared_python: Any) -> None:
    _, report = _run(shared_python, tmp_path, NAN_JOB, "full", "gradient")
    json.dumps(report)
    for alert in report["alerts"]:
        assert {"step", "kind", "message", "where"} <= alert.keys()
