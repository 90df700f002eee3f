"""Which call made the first NaN/Inf, as a user sees it: `memtui run --headless` on the jobs of
tests/fixtures/nan/, then `memtui report --json`.

The expected line is found in each job's source (the line marked `# ORIGIN`), never written
here; the step is the job's own constant.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui

pytestmark = pytest.mark.slow  # torch jobs under the CLI

JOBS = Path(__file__).parent.parent / "fixtures" / "nan"


def _marked(job: str) -> tuple[int, dict[str, Any]]:
    """The job's `# ORIGIN` line number and its upper-case constants."""
    source = (JOBS / job).read_text()
    lines = source.splitlines()
    line = next(number for number, text in enumerate(lines, 1) if text.endswith("# ORIGIN"))
    constants = {
        name: eval(value)  # the fixture's literals: ints and tuples of ints
        for name, value in re.findall(r"^([A-Z_]+) = (.+)$", source, re.MULTILINE)
    }
    return line, constants


def _alerts(tmp_path: Path, job: str, *options: str) -> list[dict[str, Any]]:
    """The run's alerts, from `memtui report --json` of `memtui run --headless OPTIONS job`."""
    recording = tmp_path / "x.memtui"
    run = run_memtui(
        "run", "--headless", *options, "-o", str(recording), str(JOBS / job), cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr
    report = run_memtui("report", "--json", str(recording), cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    alerts: list[dict[str, Any]] = json.loads(report.stdout)["alerts"]
    return alerts


def _nonfinite(alerts: list[dict[str, Any]], step: int) -> dict[str, dict[str, Any]]:
    return {a["kind"]: a for a in alerts if a["step"] == step and a["kind"].startswith("nonfinite")}


def test_full_mode_names_the_log_in_the_loss_and_groups_the_poisoned_steps(
    tmp_path: Path,
) -> None:
    line, constants = _marked("log_loss.py")
    bad, steps = constants["BAD_STEP"], constants["STEPS"]
    alerts = _alerts(tmp_path, "log_loss.py", "--nan-check", "full")
    assert not any(a["kind"].startswith("nonfinite") for a in alerts if a["step"] < bad)
    first = _nonfinite(alerts, bad)
    loss = first["nonfinite_loss"]
    assert loss["origin"] == {
        "op": "torch.log",
        "file": str(JOBS / "log_loss.py"),
        "line": line,
    }  # no module: computed outside any (the loss); made there, not read from the batch
    assert f"torch.log at log_loss.py:{line}" in loss["message"]
    assert "outside any module" in loss["message"]
    assert "nonfinite_activation" not in first  # no module's output made it
    _assert_poisoned_after(alerts, bad, steps)


def test_default_mode_groups_the_poisoned_steps_under_the_first_alarm(tmp_path: Path) -> None:
    """The steps after the update that poisoned the weights are armed, but name no module (the
    embedding's output is the first non-finite one there, a consequence)."""
    _, constants = _marked("log_loss.py")
    bad, steps = constants["BAD_STEP"], constants["STEPS"]
    alerts = _alerts(tmp_path, "log_loss.py")
    assert "nonfinite_loss" in _nonfinite(alerts, bad)
    _assert_poisoned_after(alerts, bad, steps)


def _assert_poisoned_after(alerts: list[dict[str, Any]], bad: int, steps: int) -> None:
    later = [a for a in alerts if a["step"] > bad and a["kind"].startswith("nonfinite")]
    assert {a["step"] for a in later} == set(range(bad + 1, steps + 1))
    assert all(a.get("group") == bad for a in later)
    assert all(f"poisoned by step {bad}'s update" in a["message"] for a in later)
    assert not [a for a in later if a["kind"] == "nonfinite_activation" or "origin" in a]


@pytest.mark.parametrize("mode", ["full", "default"])
def test_a_nan_made_inside_a_module_names_the_call_and_the_module(
    tmp_path: Path, mode: str
) -> None:
    """`torch.sqrt` of a negative in a custom layer; the job zeroes its non-finite gradients, so
    the weights stay finite: full mode names it the first time, the default mode when it
    recurs while armed."""
    line, constants = _marked("sqrt_layer.py")
    first, again = constants["BAD_STEPS"]
    options = ("--nan-check", "full") if mode == "full" else ()
    alerts = _alerts(tmp_path, "sqrt_layer.py", *options)
    named = [first, again] if mode == "full" else [again]
    for step in named:
        found = _nonfinite(alerts, step)
        origin = {"op": "torch.sqrt", "file": str(JOBS / "sqrt_layer.py"), "line": line}
        assert found["nonfinite_loss"]["origin"] == {**origin, "module": "norm"}
        activation = found["nonfinite_activation"]
        assert activation["where"] == "norm"
        assert f"torch.sqrt at sqrt_layer.py:{line}" in activation["message"]
    if mode == "default":  # the first alarm: nothing was watched yet
        assert "origin" not in _nonfinite(alerts, first)["nonfinite_loss"]


def test_a_nan_in_the_batch_is_said_to_be_in_the_input(tmp_path: Path) -> None:
    line, constants = _marked("nan_batch.py")
    bad = constants["BAD_STEP"]
    alerts = _alerts(tmp_path, "nan_batch.py", "--nan-check", "full")
    loss = _nonfinite(alerts, bad)["nonfinite_loss"]
    assert loss["origin"] == {
        "op": "torch.nn.functional.linear",
        "file": str(JOBS / "nan_batch.py"),
        "line": line,  # the model's call on the batch: where the first layer read it
        "module": "0",
        "in_input": True,
    }
    assert "already in the input batch" in loss["message"]


DEFERRED_JOB = """
import threading, torch, memtui_agent
from memtui_agent.steps import health

class Landed:  # torch.cuda.Event's part the agent uses: the copy has landed when asked
    def query(self):
        return True
    def synchronize(self):
        pass

# The CPU stands in for a device whose reads would sync: the checks are read a close later.
health.DEFERRED_DEVICES = frozenset({"cpu"})
health.make_event = lambda device: Landed()
reads, closing = [0], [False]
original_close = health.HealthMonitor.close
def close(self, *args, **kwargs):
    closing[0] = True
    try:
        return original_close(self, *args, **kwargs)
    finally:
        closing[0] = False
def counting(original):
    def counted(self):
        if closing[0] and threading.current_thread() is threading.main_thread():
            reads[0] += 1  # a read of a check while the step closes: a sync on a device
        return original(self)
    return counted
for name in ("tolist", "item"):
    setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
health.HealthMonitor.close = close

torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False, nan_check="full"):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 6):
        opt.zero_grad()
        hidden = model(torch.randn(4, 8))
        loss = torch.sqrt(hidden.abs() - 10.0 * (step == 3)).mean()  # ORIGIN
        loss.backward()
        for parameter in model.parameters():
            parameter.grad.nan_to_num_(0.0, 0.0, 0.0)
        opt.step()
print("READS", reads[0])
"""


def test_a_device_whose_checks_are_read_late_still_names_the_origin_without_a_sync(
    tmp_path: Path, run_python: Any
) -> None:
    """On a device the checks (op flags included) travel with the close's one copy and are
    read at a later close: no read while a step closes, and the origin comes with the late
    alert of its own step."""
    from memtui.model.recording import read_recording
    from memtui.reports.report import build_report

    # A fresh interpreter (`run_python`): the job patches torch and the agent for good.
    result = run_python(DEFERRED_JOB, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "READS 0" in result.stdout
    report = build_report(read_recording(tmp_path / "rec.memtui"))
    line = next(n for n, text in enumerate(DEFERRED_JOB.splitlines(), 1) if "# ORIGIN" in text)
    loss = [a for a in report["alerts"] if a["kind"] == "nonfinite_loss"]
    assert [a["step"] for a in loss] == [3]
    origin = loss[0]["origin"]
    assert (origin["op"], origin["line"], origin.get("module")) == ("torch.sqrt", line, None)


def test_a_compiled_model_computes_the_same_bits_and_its_line_is_the_jobs(tmp_path: Path) -> None:
    """torch.compile traces the watch's mode as a plain call (it would otherwise break the graph
    and run the region eagerly: step 4's loss differed in its last bits); the calls the
    compiled code makes at run time are named at the job's line that called it, not in
    inductor's generated files."""
    import subprocess
    import sys

    from cli_harness import scrubbed_env

    job = JOBS / "compiled.py"
    env = scrubbed_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    plain = subprocess.run(
        [sys.executable, str(job)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert plain.returncode == 0, plain.stderr
    recording = tmp_path / "x.memtui"
    run = run_memtui(
        "run", "--headless", "--nan-check", "full", "-o", str(recording), str(job),
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr

    def losses(output: str) -> list[str]:
        return [line for line in output.splitlines() if line.startswith("LOSS")]

    assert losses(run.stdout) == losses(plain.stdout) and len(losses(plain.stdout)) == 6
    report = run_memtui("report", "--json", str(recording), cwd=tmp_path, env=env)
    line, constants = _marked("compiled.py")
    loss = _nonfinite(json.loads(report.stdout)["alerts"], constants["BAD_STEP"])["nonfinite_loss"]
    assert (loss["origin"]["file"], loss["origin"]["line"], loss["origin"]["in_input"]) == (
        str(job),
        line,
        True,
    )
