"""Jobs written as users write them, run under `memtui run` as users run it (docs/design.md#steps
and #leaks).

Each job in `tests/fixtures/growing/` is run in the default mode and with `--activations every`
(every saved tensor counted). In the default mode no step may state an activations figure (max
or end) that differs from `every`'s, and at most a fifth may say "not known". The leaking jobs
print their own count of what their holder keeps alive; memtui must name that holder within 20
steps of the leak's start, with bytes within 10% of the job's count at the end. The bounded
queue and the healthy jobs raise no leak.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI
from repo_paths import FIXTURES

from memtui.model.recording import Recording, read_recording
from memtui_protocol.schema import AlertKind, LeakKind

JOBS = FIXTURES / "growing"
STEPS = 40
pytestmark = pytest.mark.slow


@dataclass
class Run:
    recording: Recording
    counts: dict[str, Any]


def _run(job: str, tmp: Path, *options: str) -> Run:
    recording = tmp / f"{job}-{'-'.join(options) or 'default'}.memtui"
    command = [*MEMTUI, "run", "--headless", "-o", str(recording)]
    result = subprocess.run(
        [*command, *options, str(JOBS / f"{job}.py"), str(STEPS)],
        cwd=JOBS,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = [line[4:] for line in result.stdout.splitlines() if line.startswith("JOB ")]
    return Run(read_recording(recording), json.loads(lines[-1]) if lines else {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Run]:
    tmp = tmp_path_factory.mktemp("growing")
    jobs = [path.stem for path in sorted(JOBS.glob("*.py")) if path.stem != "common"]
    modes = {"default": (), "every": ("--activations", "every")}
    # Two at a time: each run is one process on one core, and CI has two.
    with ThreadPoolExecutor(max_workers=2) as pool:
        started = {
            (job, mode): pool.submit(_run, job, tmp, *options)
            for job in jobs
            for mode, options in modes.items()
        }
        return {key: future.result() for key, future in started.items()}


def _jobs(runs: dict[tuple[str, str], Run]) -> list[str]:
    return sorted({job for job, _mode in runs})


def test_the_default_never_states_a_wrong_activations_figure(
    runs: dict[tuple[str, str], Run],
) -> None:
    assert len(_jobs(runs)) >= 10
    for job in _jobs(runs):
        default, every = runs[(job, "default")].recording, runs[(job, "every")].recording
        assert len(default.steps) == len(every.steps), job
        unknown = 0
        for ours, truth in zip(default.steps, every.steps, strict=True):
            assert ours.step == truth.step
            if not ours.activations_measured and ours.activations_from is None:
                unknown += 1
                continue
            stated = (ours.max.activations, ours.end.activations)
            assert stated == (truth.max.activations, truth.end.activations), (job, ours.step)
        assert unknown * 5 <= len(default.steps), (job, unknown)


def test_the_default_still_carries_healthy_repeats(runs: dict[tuple[str, str], Run]) -> None:
    """Truth is not bought by measuring everything: repeats that are repeats are carried."""
    for job in (
        "healthy",
        "bounded_queue",
        "module_cache",
        "hook_outputs",
        "dropout_schedule",
        "fp32_outputs",  # an output backward never reaches is no graph kept (accelerate's bf16)
        "llama_autocast",
    ):
        steps = runs[(job, "default")].recording.steps
        carried = sum(1 for step in steps if step.activations_from is not None)
        assert carried * 10 >= len(steps) * 8, (job, carried)


LEAKS = {
    "logits_list": "history",
    "module_cache": "model.encoder.cache",
    "hook_outputs": "store (closure of keep_outputs.<locals>.hook)",
}


def test_every_leak_is_named_by_its_holder_soon_with_its_bytes(
    runs: dict[tuple[str, str], Run],
) -> None:
    for job, holder in LEAKS.items():
        run = runs[(job, "default")]
        alerts = [
            (step.step, alert)
            for step in run.recording.steps
            for alert in step.alerts
            if alert.kind == AlertKind.LEAK
        ]
        assert [alert.where for _, alert in alerts] == [holder], job
        assert alerts[0][0] - run.counts["first_step"] < 20, (job, alerts[0][0])
        end = run.recording.end
        assert end is not None
        leak = next(leak for leak in end.leaks if leak.holder == holder)
        assert abs(leak.bytes - run.counts["bytes"]) <= run.counts["bytes"] // 10, job
        assert leak.kind == LeakKind.TENSORS


def test_a_validation_total_without_no_grad_is_a_retained_graph(
    runs: dict[tuple[str, str], Run],
) -> None:
    """Its held bytes are the validation graphs' saved tensors, which `every` counts as the
    activations still held at the job's last close."""
    run, every = runs[("val_no_grad", "default")], runs[("val_no_grad", "every")]
    (alert,) = [a for step in run.recording.steps for a in step.alerts if a.kind == AlertKind.LEAK]
    assert alert.where == "val_total" and "torch.no_grad()" in alert.message
    end = run.recording.end
    assert end is not None
    (leak,) = end.leaks
    assert leak.kind == LeakKind.RETAINED_GRAPH
    held = every.recording.steps[-1].end.counted()[3]
    # One more validation graph is built after the last close, before the job ends.
    per_graph = every.recording.steps[1].end.counted()[3]
    assert abs(leak.bytes - (held + per_graph)) <= (held + per_graph) // 10


def _leak_alerts(run: Run) -> list[tuple[int, str, str]]:
    return [
        (step.step, str(alert.where), alert.message)
        for step in run.recording.steps
        for alert in step.alerts
        if alert.kind == AlertKind.LEAK
    ]


@pytest.mark.parametrize("job", ["val_batches", "val_outputs"])
def test_graphs_kept_by_an_evaluation_are_named_with_their_bytes_and_nodes(
    runs: dict[tuple[str, str], Run], job: str
) -> None:
    """Several validation batches a step without `torch.no_grad()`, kept by a total or a list
    of outputs: the holder, its saved bytes within 10% of the job's own count and its nodes
    (the job walks `next_functions` itself) at every census, growing from the first close that
    held them, with the fix."""
    run = runs[(job, "default")]
    holder, first = run.counts["holder"], run.counts["first_step"]
    ((named_at, where, message),) = _leak_alerts(run)
    assert where == holder and "torch.no_grad()" in message
    assert 0 <= named_at - first < 20
    kept = run.counts["kept"]  # after each step's evaluation: what the graphs saved, nodes
    censuses = [(step.step, leak) for step in run.recording.steps for leak in step.leaks]
    assert len(censuses) >= 2
    for step, leak in censuses:
        # Counted at the close of `step` (its optimizer.step): the evaluations before it.
        saved, nodes = kept[step - 2]
        assert leak.holder == holder and leak.kind == LeakKind.RETAINED_GRAPH
        assert abs(leak.bytes - saved) <= saved // 10, (step, leak.bytes, saved)
        assert abs(leak.nodes - nodes) <= nodes // 10, (step, leak.nodes, nodes)
        assert leak.first_step == first
    (step, leak), (later, last) = censuses[-2:]
    truth = (kept[later - 2][1] - kept[step - 2][1]) // (later - step)
    assert abs(last.nodes_per_step - truth) <= truth // 10


@pytest.mark.parametrize(
    "job", ["total_loss", "total_loss_module"], ids=["in a function", "at module level"]
)
def test_a_loss_total_after_backward_is_a_graph_history_named_by_the_total(
    runs: dict[tuple[str, str], Run], job: str
) -> None:
    """`total_loss += loss`: the holder is the total (never `avg`, derived from it and
    recomputed), what grows is its autograd nodes, counted as the job counts them, and their
    host bytes are said not known."""
    run = runs[(job, "default")]
    holder, nodes = run.counts["holder"], run.counts["nodes"]
    assert run.counts["saved"] == 0  # backward freed every saved tensor
    ((named_at, where, message),) = _leak_alerts(run)
    assert where == holder and "not known" in message and "`loss.item()`" in message
    assert 0 <= named_at - run.counts["first_step"] < 20
    censuses = [(step.step, leak) for step in run.recording.steps for leak in step.leaks]
    assert {leak.holder for _, leak in censuses} == {holder}
    per_step = nodes[1] - nodes[0]
    for step, leak in censuses:
        assert leak.kind == LeakKind.GRAPH_HISTORY and leak.per_step == 0
        assert leak.nodes == nodes[step - 2], step  # after the steps before its close
        assert leak.nodes_per_step == per_step
    end = run.recording.end
    assert end is not None
    (final,) = end.leaks
    assert final.kind == LeakKind.GRAPH_HISTORY and final.nodes_per_step == per_step


def test_a_kept_graph_is_counted_to_the_byte(runs: dict[tuple[str, str], Run]) -> None:
    """At each close the validation graphs kept since the last reset are in the activations
    pile exactly as the job counts what they saved, the Python numbers autograd saves without
    any saved-tensor hook included (16 B short per graph before they were adopted)."""
    for mode in ("default", "every"):
        run = runs[("val_scaled", mode)]
        kept = run.counts["kept"]
        for step in run.recording.steps[1:]:
            if not step.activations_measured and step.activations_from is None:
                continue
            # Closed by the optimizer, before this step's validation: the last step's are kept.
            assert step.end.activations == kept[step.step - 2], (mode, step.step)


def test_every_step_not_known_points_at_the_alert_that_says_why(
    runs: dict[tuple[str, str], Run],
) -> None:
    for job in _jobs(runs):
        steps = runs[(job, "default")].recording.steps
        said = {
            step.step
            for step in steps
            for alert in step.alerts
            if alert.kind == AlertKind.ACTIVATIONS_VARY
        }
        for step in steps:
            if not step.activations_measured and step.activations_from is None:
                assert step.activations_why_at in said, (job, step.step)


def test_bounded_and_healthy_jobs_raise_no_leak(runs: dict[tuple[str, str], Run]) -> None:
    for job in (
        "bounded_queue",
        "healthy",
        "layerdrop",
        "dropout_schedule",
        "wgan",
        "fp32_outputs",
    ):
        steps = runs[(job, "default")].recording.steps
        assert not any(alert.kind == AlertKind.LEAK for s in steps for alert in s.alerts), job
        end = runs[(job, "default")].recording.end
        assert end is not None and not end.leaks, job


def test_activations_vary_is_said_once_per_cause_with_its_numbers(
    runs: dict[tuple[str, str], Run],
) -> None:
    for job in _jobs(runs):
        said = [
            alert.message
            for step in runs[(job, "default")].recording.steps
            for alert in step.alerts
            if alert.kind == AlertKind.ACTIVATIONS_VARY
        ]
        assert len(said) <= 3, (job, said)
        assert not any("routing, masks" in message for message in said), job
    (dropout,) = [
        alert.message
        for step in runs[("dropout_schedule", "default")].recording.steps
        for alert in step.alerts
        if alert.kind == AlertKind.ACTIVATIONS_VARY
    ]
    assert "autograd recorded" in dropout and "dropout" in dropout
