"""The divergence rule over sequences of losses and gradient norms, and the health check's
global gradient norm against torch's own (`clip_grad_norm_`)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from memtui_agent.steps import divergence
from memtui_agent.steps.divergence import DivergenceWatch, divergence_alerts
from memtui_agent.steps.health import HealthMonitor
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind

NAN = math.nan


def test_the_reported_blow_up_is_said_at_its_first_step() -> None:
    """The users' lr=1e4 run: 4.74 -> 3,029,213 -> 24,240,052,224, NaN from step 4."""
    assert divergence_alerts([4.74, 3_029_213.0, 24_240_052_224.0, NAN, NAN, NAN]) == [(2, 2)]


def test_the_gradient_norm_alone_is_enough() -> None:
    losses = [2.3, 2.2, 2.1, 2.05, 2.0, 2.0, 2.0]
    norms = [0.5, 0.6, 0.55, 0.5, 0.6, 80.0, 9e4]
    assert divergence_alerts(losses, norms) == [(6, 6)]


def test_a_climb_over_several_steps_names_its_first_step() -> None:
    """4x a step: 100x over the lowest of the last 5 steps at step 9; the climb began at 6."""
    assert divergence_alerts([1, 1, 1, 1, 1, 4, 16, 64, 256, 1024, 4096]) == [(9, 6)]


def test_one_alert_per_episode_and_a_new_one_after_recovery() -> None:
    losses = [1.0, 1.1, 0.9, 1e3, 1e6, 1e9, 1.2, 1.0, 0.9, 1.1, 1.0, 1e4, 1e7]
    assert divergence_alerts(losses) == [(4, 4), (12, 12)]


def test_the_alert_names_the_growth_and_the_fixes() -> None:
    watch = DivergenceWatch()
    assert watch.read(1, 4.74, 0.3) is None
    assert watch.read(2, 4.7, 0.31) is None
    alert = watch.read(3, 3_000_000.0, 3e4)
    assert alert is not None
    assert alert.kind == AlertKind.DIVERGENCE and alert.began == 3
    assert "the loss rose 638,298x in 1 step (4.7 before, 3e+06 at step 3)" in alert.message
    assert "gradient norm rose 100,000x" in alert.message
    for fix in ("learning rate", "clip gradients", "GradScaler"):
        assert fix in alert.message
    assert watch.after() == "after the divergence that began at step 3"
    assert watch.read(4, 2.4e10, 1e7) is None  # the same episode: no second alert


def test_the_first_norm_alone_is_no_baseline() -> None:
    """One earlier loss is enough (the reported run is said at step 2); one earlier norm is
    not (a first step may be clipped while scaled, or have a zero-initialised head)."""
    assert divergence_alerts([2.3, 2.3, 2.2], [0.001, 0.5, 0.6]) == []
    assert divergence_alerts([2.3, 2.3, 2.2], [0.5, 0.6, 80.0]) == [(3, 3)]


def _noisy(values: list[float], spread: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [v * rng.uniform(1 - spread, 1 + spread) for v in values]


HEALTHY = {
    "early training falls fast": (
        [10.0 * 0.6**k for k in range(80)],
        [50.0 * 0.8**k for k in range(80)],
    ),
    "a warm-up whose gradient norm rises 8-fold": (
        _noisy([2.3 - 0.01 * k for k in range(100)], 0.1),
        _noisy([0.05 * (1 + 7 * min(k, 50) / 50) for k in range(100)], 0.2),
    ),
    "loss spikes of 2-5x": (
        [1.0 if k % 17 else 5.0 for k in range(1, 200)],
        [0.4 if k % 23 else 2.0 for k in range(1, 200)],
    ),
    "a large sum-reduced loss": (
        _noisy([3e6 * 0.99**k for k in range(200)], 0.3),
        _noisy([4e4] * 200, 0.5),
    ),
    "a loss near zero that spikes 1000x below its start": (
        [1.0, 0.1, 0.01, 1e-4, 1e-6, 1e-7, 1e-7, 1e-7, 1e-4, 1e-7, 1e-7],
        None,
    ),
    "one batch fitted perfectly, then a usual one": (
        [2.3, 2.0, 1.8, 1.7, 0.001, 1.6, 1.65, 2.4, 1.5],
        [1.0, 1.1, 1.2, 1.3, 1e-5, 1.4, 1.5, 1.6, 1.5],
    ),
    "a GradScaler run whose first steps are skipped": (
        [2.3, 2.3, 2.3, 2.2, 2.1, 2.0],
        [NAN, math.inf, NAN, 0.7, 0.6, 0.6],
    ),
    "a loss at exactly zero, then positive": ([1.0, 0.0, 0.0, 0.0, 0.0, 0.5], None),
    "a first gradient clipped while scaled (1/1024 of the next), a skip, then usual ones": (
        [2.3, 2.3, 2.2, 2.2, 2.1],
        [1.0 / 1024, math.inf, 1.0, 1.1, 0.9],
    ),
    "a zero-initialised head: the first norm 1000x below the next": (
        [1.39, 1.38, 1.36, 1.35, 1.33, 1.3],
        [1e-3, 0.5, 0.6, 0.55, 0.7, 0.6],
    ),
}


@pytest.mark.parametrize("shape", list(HEALTHY))
def test_healthy_shapes_raise_nothing(shape: str) -> None:
    losses, norms = HEALTHY[shape]
    assert divergence_alerts(losses, norms) == []


def test_a_gans_two_losses_are_each_compared_with_their_own() -> None:
    """Discriminator and generator steps alternate with losses 500x apart: one history would
    read every generator step as a divergence; one per optimizer reads none."""
    losses = [5.0 + 0.01 * (k % 7) if k % 2 else 0.01 for k in range(1, 60)]
    names = ["G" if k % 2 else "D" for k in range(1, 60)]
    assert divergence_alerts(losses) != []  # the trap
    assert divergence_alerts(losses, None, names) == []
    losses[40] = 5e4  # step 41, of "G": its own history says it diverged
    assert divergence_alerts(losses, None, names) == [(41, 41)]


def test_a_loss_that_crosses_zero_is_not_read_by_ratios() -> None:
    """A WGAN critic's loss (the growing/gan_crossing fixture's, as recorded): from 0.00058 to
    -0.088 is 151x in magnitude and no divergence; its gradient norm is still read."""
    losses = [-0.0773, -0.0246, -0.0453, 0.0157, -0.0113, -0.0364, 0.00058, 0.0057, 0.00065]
    assert divergence_alerts([*losses, -0.0878]) == []
    norms = [1.5, 1.6, 1.5, 1.55, 1.6, 1.5, 1.58, 1.52, 1.56, 900.0]
    assert divergence_alerts([*losses, -0.0878], norms) == [(10, 10)]


def test_the_thresholds_are_the_documented_ones() -> None:
    """docs/numbers.md#divergence justifies these numbers; changing one changes the docs."""
    assert (divergence.GROWTH, divergence.RECENT, divergence.OVER_MEDIAN) == (100.0, 5, 10.0)


def _parameters(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)]).to(dtype)
    model(torch.randn(4, 16, dtype=dtype)).float().pow(2).mean().backward()
    extra = torch.nn.Parameter(torch.randn(5000, 2, dtype=dtype))  # one large tensor too
    extra.grad = torch.randn(5000, 2, dtype=dtype)
    return [*model.parameters(), extra]


def _grads(parameters: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in parameters if p.grad is not None]


def _named(parameters: list[torch.nn.Parameter]) -> Callable[[], list[tuple[str, torch.Tensor]]]:
    return lambda: [(str(i), p) for i, p in enumerate(parameters)]


def _close(
    monitor: HealthMonitor, step: int, parameters: list[torch.nn.Parameter], loss: float = 1.0
) -> list[schema.Alert]:
    return monitor.close(
        step, _grads(parameters), [torch.tensor(loss)], _named(parameters), False, str
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_the_checked_norm_is_clip_grad_norms(dtype: torch.dtype) -> None:
    parameters = _parameters(dtype)
    grads = _grads(parameters)
    monitor = HealthMonitor()
    assert _close(monitor, 1, parameters) == []
    if dtype is torch.float16:  # clip_grad_norm_ rounds its fp16 result to fp16; ours is fp32
        parameters = [torch.nn.Parameter(p.float()) for p in parameters]
        for copy, grad in zip(parameters, grads, strict=True):
            copy.grad = grad.float()
    truth = torch.nn.utils.clip_grad_norm_(parameters, math.inf).item()
    assert monitor.judged_norm == pytest.approx(truth, rel=1e-6)


def test_a_huge_finite_gradient_is_not_called_non_finite() -> None:
    """Its squares overflow float32 (the norm reads inf): the exact check says it is finite."""
    parameters = _parameters()
    _grads(parameters)[0][0, 0] = 3e38
    monitor = HealthMonitor()
    assert _close(monitor, 1, parameters) == []
    assert monitor.judged_norm is None  # not known: overflowed, never a false NaN
    _grads(parameters)[0][0, 1] = math.nan
    alerts = _close(monitor, 2, parameters)
    assert [a.kind for a in alerts] == [AlertKind.NONFINITE_GRADIENT]


def test_nonfinite_alerts_after_a_divergence_name_where_it_began() -> None:
    parameters = _parameters()
    monitor = HealthMonitor()
    losses = [4.74, 3e6, 2.4e10]
    alerts: list[schema.Alert] = []
    for step, loss in enumerate(losses, start=1):
        alerts += _close(monitor, step, parameters, loss)
    assert [(a.kind, a.began) for a in alerts] == [(AlertKind.DIVERGENCE, 2)]
    _grads(parameters)[0][0, 0] = math.nan
    found = _close(monitor, 4, parameters, NAN)
    assert {a.kind for a in found} == {AlertKind.NONFINITE_LOSS, AlertKind.NONFINITE_GRADIENT}
    assert all(a.began == 2 and "divergence that began at step 2" in a.message for a in found)


def test_late_norms_fold_into_their_step() -> None:
    piles = schema.Piles(0, 0, 0, 0)
    steps = [
        schema.Step(step=n, t_start=0, t_end=0, end=piles, max=piles, peak=piles) for n in (1, 2)
    ]
    schema.apply_late(
        steps, [schema.StepLate(step=1, grad_norm=2.5), schema.StepLate(step=1, loss=3.0)]
    )
    assert (steps[0].grad_norm, steps[0].loss, steps[1].grad_norm) == (2.5, 3.0, None)


class _Landed:
    """A stand-in device event: the copy has always landed."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


def test_a_deferred_check_brings_the_norm_and_the_alert_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a device the norm travels in the check's single copy: nothing is read at the close,
    and `collect` gives each step's norm (and the divergence alert) once it landed."""
    from memtui_agent.steps import health

    monkeypatch.setattr(health, "DEFERRED_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(health, "make_event", lambda device: _Landed())
    parameters = _parameters()
    monitor = HealthMonitor()
    norms = []
    for step in (1, 2, 3):
        for grad in _grads(parameters):
            grad.mul_(1000.0 if step == 3 else 1.0)
        norms.append(torch.nn.utils.clip_grad_norm_(parameters, math.inf).item())
        assert _close(monitor, step, parameters) == [] and monitor.judged_norm is None
    found = monitor.collect(list, str)
    assert [step for step, _, _ in found] == [1, 2, 3]
    assert [norm for _, _, norm in found] == pytest.approx(norms, rel=1e-6)
    kinds = [[a.kind for a in alerts] for _, alerts, _ in found]
    assert kinds == [[], [], [AlertKind.DIVERGENCE]]


@pytest.mark.parametrize("deferred", [False, True], ids=["host", "deferred"])
def test_the_norm_over_groups_of_several_dtypes(
    monkeypatch: pytest.MonkeyPatch, deferred: bool
) -> None:
    from memtui_agent.steps import health

    if deferred:
        monkeypatch.setattr(health, "DEFERRED_DEVICES", frozenset({"cpu"}))
        monkeypatch.setattr(health, "make_event", lambda device: _Landed())
    parameters = _parameters(torch.float32)[:4] + _parameters(torch.float64)[4:8]
    truth = torch.nn.utils.clip_grad_norm_(parameters, math.inf).item()
    monitor = HealthMonitor()
    assert _close(monitor, 1, parameters) == []
    norm = monitor.collect(list, str)[0][2] if deferred else monitor.judged_norm
    assert norm == pytest.approx(truth, rel=1e-6)
