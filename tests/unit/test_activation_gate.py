"""The activation gate (`steps.gate.ActivationGate`) on its own: every reason to arm or disarm
the costly hooks, and the close-time verdict.

The hooks are a stand-in switch that records what the gate asks; the policy, health monitor and
budget are the real ones. No training job runs: root calls are reported as the root hooks report
them, and closes as the step closer's readings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.steps.activation_policy import FIRST_STEPS, Verdict
from memtui_agent.steps.budget import Budget
from memtui_agent.steps.frame import CloseReading, LedgerReading, StepInputs
from memtui_agent.steps.gate import MEASURE_WHILE_HELD, ActivationGate
from memtui_agent.steps.health import ARMED_STEPS, HealthMonitor
from memtui_agent.steps.step_signature import SignatureRecorder
from memtui_protocol import schema
from memtui_protocol.schema import ActivationMode, AlertKind, NanCheck, Pile

MODEL = torch.nn.Linear(2, 2)
BATCH = (torch.zeros(3, 2),)
OTHER_BATCH = (torch.zeros(5, 2),)


class Switch:
    """The hooks side: records arming and disarming."""

    def __init__(self) -> None:
        self.armed = False
        self.log: list[str] = []
        self.job_hooks = False
        """The job's own saved-tensor hooks are on top (the agent's pair cannot be pushed)."""
        self.disabled = False
        """torch disabled saved-tensor hooks (a torch.func transform runs the model)."""

    def foreign_hooks(self) -> bool:
        return self.job_hooks or self.disabled

    @property
    def pack_missing(self) -> bool:
        return self.armed and (self.job_hooks or self.disabled)

    @property
    def saved_hooks_disabled(self) -> bool:
        return self.disabled

    @property
    def installed(self) -> bool:
        return self.armed

    def arm(self, root: torch.nn.Module | None) -> None:
        self.armed = True
        self.log.append("arm" if root is None else "arm-root")

    def disarm(self) -> None:
        self.armed = False
        self.log.append("disarm")

    def hook_new_parameters(self) -> None:
        self.log.append("hook-params")


class Job:
    """A gate, its switch and its parts, stepped as the hooks and the closer would."""

    def __init__(
        self,
        mode: ActivationMode = ActivationMode.AUTO,
        nan_check: NanCheck = NanCheck.DEFAULT,
        budget: int | None = None,
    ) -> None:
        self.switch = Switch()
        self.health = HealthMonitor(nan_check)
        self.budget = Budget(budget)
        self.gate = ActivationGate(
            mode, self.switch, ModuleRegistry(lambda names: None), self.health, self.budget
        )
        self.step = 1
        self.gate.started()

    def run(
        self,
        batch: tuple[Any, ...] = BATCH,
        activations: int = 100,
        alarm: bool = False,
        returned: Callable[[], Any] | None = None,
        **inputs: Any,
    ) -> tuple[bool, Verdict]:
        """One step: a root call, the close's verdict, the next step opening. `alarm`: the
        close's NaN check raised one (it arms the module probes, as `HealthMonitor` does).
        `returned`: the root call's forward, run inside the call (its graph numbered there),
        whose output the root call returns (a graph the job may keep past the close).
        Returns whether the hooks were armed during the step, and the verdict."""
        self.gate.root_call(MODEL, batch, {}, self.step)
        if returned is not None:
            returned = returned()
            self.gate.root_returned(returned, self.step)
        armed = self.switch.armed
        verdict = self.gate.verdict(reading(self.step, activations if armed else 0))
        if alarm:
            self.health.armed_until = self.step + ARMED_STEPS
        self.gate.step_opens(closed_inputs(self.step, verdict, **inputs))
        self.step += 1
        return armed, verdict

    def settle(self) -> None:
        """Steps 1 and 2: the first starts from empty piles, the second from the weights, so
        step 3 is the first that can repeat a measured one."""
        self.run()
        self.run()


def reading(step: int, activations: int) -> CloseReading:
    """A close's reading whose activation figures are `activations` bytes."""
    high = schema.Piles(weights=24, activations=activations)
    dtypes: dict[str, dict[str, schema.DtypeStat]] = {
        Pile.ACTIVATIONS: {"float32": schema.DtypeStat(activations, 1)}
    }
    ledger = LedgerReading(schema.Piles(weights=24), high, high, dtypes, [])
    return CloseReading(step, ledger, schema.Allocator())


def closed_inputs(step: int, verdict: Verdict, **changes: Any) -> StepInputs:
    return StepInputs(step, 0.0, 1.0, reading(step, 0), verdict, **changes)


def test_auto_measures_what_is_new_then_carries_its_repeats() -> None:
    job = Job()
    assert job.switch.log == ["arm"]  # armed from the start: the models are found there
    armed, first = job.run()
    assert armed and first.measured and first.carried is None
    assert job.switch.log[-1] == "disarm"  # a root module was called: the next call decides
    armed, second = job.run()  # it starts from other piles (the weights): new
    assert armed and second.measured
    armed, third = job.run()
    assert not armed and not third.measured
    assert third.carried is not None and third.carried.step == 2
    assert third.carried.high.activations == 100  # the measured step's figures


def test_a_new_signature_is_measured_whole() -> None:
    job = Job()
    job.settle()
    armed, verdict = job.run(OTHER_BATCH)
    assert armed and verdict.measured
    assert job.switch.log[-2] == "arm-root"  # armed at the root call, the root on the stack


def test_every_never_disarms_and_off_never_arms() -> None:
    every = Job(ActivationMode.EVERY)
    for _ in range(3):
        armed, verdict = every.run()
        assert armed and verdict.measured
    assert "disarm" not in every.switch.log
    off = Job(ActivationMode.OFF)
    assert off.switch.log == []
    for _ in range(3):
        armed, verdict = off.run()
        assert not armed and not verdict.measured and verdict.carried is None
    assert "arm" not in off.switch.log and "arm-root" not in off.switch.log


def test_a_new_optimizer_makes_its_first_steps_measured() -> None:
    job = Job()
    job.settle()
    job.gate.optimizer_created()
    measured = [job.run()[0] for _ in range(FIRST_STEPS + 1)]
    assert measured == [True] * FIRST_STEPS + [False]


def test_an_alert_that_calls_for_measuring_arms_the_next_steps() -> None:
    job = Job()
    job.settle()
    job.run(over_budget=schema.Alert(kind=AlertKind.OVER_BUDGET, message="over"))
    assert [job.run()[0] for _ in range(FIRST_STEPS + 1)] == [True] * FIRST_STEPS + [False]
    job.run(raised=(schema.Alert(kind=AlertKind.CLIP_BEFORE_UNSCALE, message="clip"),))
    assert not job.run()[0]  # a warning about clipping changes nothing measured


def test_nan_probes_and_fsdp_arm_every_step_they_cover() -> None:
    full = Job(nan_check=NanCheck.FULL)
    assert full.gate.probing
    assert all(full.run()[0] for _ in range(4))
    job = Job()
    job.settle()
    assert not job.gate.probing and not job.run()[0]
    job.run(alarm=True)  # the close's check found NaN: the module probes are armed
    assert job.gate.probing and job.run()[0]
    job.gate.fsdp = True
    job.health.armed_until = 0
    assert job.run()[0] and job.run()[0]
    job.gate.fsdp = False
    assert not job.run()[0]


def test_a_peak_near_the_budget_is_measured() -> None:
    job = Job(budget=1000)
    job.settle()
    job.budget.judge_peak(schema.Piles(weights=899))
    assert not job.run()[0]
    job.budget.judge_peak(schema.Piles(weights=900))
    assert job.run()[0]


def test_a_step_with_no_root_call_arms_the_next_from_its_start() -> None:
    job = Job()
    job.run()
    assert not job.switch.armed
    verdict = job.gate.verdict(reading(job.step, 0))  # plain tensors: no root module called
    job.gate.step_opens(closed_inputs(job.step, verdict))
    assert job.switch.armed and job.switch.log[-1] == "arm"


def test_new_parameters_get_gradient_hooks_only_while_measuring() -> None:
    job = Job()
    job.gate.parameters_found()
    assert job.switch.log[-1] == "hook-params"
    job.run()  # disarmed after it
    job.gate.parameters_found()
    assert job.switch.log[-1] == "disarm"
    off = Job(ActivationMode.OFF)
    off.switch.armed = True  # the module hooks that find the models
    off.gate.parameters_found()
    assert off.switch.log == []


def test_a_repeat_that_measures_differently_switches_to_every_step() -> None:
    job = Job()
    job.gate.policy.audit_every = 3
    job.run(activations=100)
    job.run()
    armed, audit = job.run(activations=180)  # step 3 is an audit: measured, and it differs
    assert armed and audit.measured and audit.alert is not None
    assert audit.alert.kind is AlertKind.ACTIVATIONS_VARY
    assert job.gate.mode is ActivationMode.EVERY


def test_probing_lasts_the_armed_steps_after_an_alarm() -> None:
    job = Job()
    job.settle()
    job.run(alarm=True)
    probed = []
    for _ in range(ARMED_STEPS + 1):
        probed.append(job.gate.probing)
        job.run()
    assert probed == [True] * ARMED_STEPS + [False]


def test_the_budget_is_reported_once_naming_the_pile_that_grew_most() -> None:
    budget = Budget(1000)
    assert budget.judge_peak(schema.Piles(weights=400, activations=500)) is None
    over = budget.judge_peak(schema.Piles(weights=400, activations=700))
    assert over is not None and over.kind is AlertKind.OVER_BUDGET
    assert over.where == Pile.ACTIVATIONS and "(+200 B)" in over.message
    assert budget.judge_peak(schema.Piles(weights=900, activations=900)) is None  # said once
    forecast = Budget(1000)
    assert forecast.forecast_over(600, 400, "the first SGD.step()") is None
    alert = forecast.forecast_over(600, 401, "the first SGD.step()")
    assert alert is not None and alert.where == Pile.OPTIMIZER_STATE
    assert forecast.judge_peak(schema.Piles(weights=2000)) is None  # the forecast said it


def test_a_heap_that_moves_with_the_agents_own_measuring_is_not_called_a_size_change() -> None:
    """On a CPU the heap at the first backward also holds what the agent allocated while it
    measured: where that exceeds the tolerance no repeat is confirmed, the job is measured
    every step, and the alerts say the heap cannot tell why instead of blaming the job."""
    job = Job()
    bias = 80_000  # what the 601-module benchmark's measured steps add (about 74 KiB)
    heap = {"now": 1_000_000}
    job.gate.signatures = SignatureRecorder(lambda: heap["now"])
    alerts = []
    for _ in range(12):
        job.gate.root_call(MODEL, BATCH, {}, job.step)
        armed = job.switch.armed
        heap["now"] = 1_000_000 + 50_000 + (bias if armed else 0)
        job.gate.backward_starts(False)
        heap["now"] = 1_000_000
        verdict = job.gate.verdict(reading(job.step, 100 if armed else 0))
        if verdict.alert is not None:
            alerts.append(verdict.alert.message)
        job.gate.step_opens(closed_inputs(job.step, verdict))
        job.step += 1
    assert job.gate.mode is ActivationMode.EVERY
    assert len(alerts) == 2
    assert "memtui's own allocations while it measured moved the heap" in alerts[0]
    assert "could not be confirmed by the heap" in alerts[1]
    assert not any("LayerDrop" in message for message in alerts)


def test_a_repeat_not_confirmed_has_its_twin_measured_again() -> None:
    """Two batch shapes in turn (a padded batch's lengths). The twin of one was measured while
    its heap still held first-time allocations: its first repeat is not known, the next step of
    that shape is measured anew and the repeats after it are carried from it. (Measuring only the
    next step, of the other shape, left every later repeat of the first one not known.)"""
    job = Job()
    heap = {"now": 1_000_000}
    job.gate.signatures = SignatureRecorder(lambda: heap["now"])
    biased = False
    not_known: list[int] = []
    carried_from: dict[int, int] = {}
    for _ in range(16):
        batch = BATCH if job.step % 2 else OTHER_BATCH
        job.gate.root_call(MODEL, batch, {}, job.step)
        armed = job.switch.armed
        one_off = 0
        if armed and batch is BATCH and job.step > 2 and not biased:
            one_off, biased = 230_000, True
        heap["now"] = 1_000_000 + 50_000 + one_off
        job.gate.backward_starts(False)
        heap["now"] = 1_000_000
        verdict = job.gate.verdict(reading(job.step, 100 if armed else 0))
        if not verdict.measured and verdict.carried is None:
            not_known.append(job.step)
        elif verdict.carried is not None:
            carried_from[job.step] = verdict.carried.step
        job.gate.step_opens(closed_inputs(job.step, verdict))
        job.step += 1
    assert biased and len(not_known) == 1, not_known
    assert carried_from[15] == carried_from[13] > not_known[0]  # the twin measured anew
    assert job.gate.mode is ActivationMode.AUTO


def _kept(kept: list[torch.Tensor]) -> torch.Tensor:
    """A forward whose output the job keeps past the close."""
    kept.append(MODEL(torch.ones(1, 2)))
    return kept[-1]


def test_graphs_held_at_a_close_make_the_next_steps_measured() -> None:
    """What a graph saved is known only from the pack hook: while the job keeps graphs across
    closes (a GAN's generator output, a validation total), the steps after are armed, so the
    graphs they build are counted; once none is held, repeats are carried again."""
    job = Job()
    job.settle()
    kept: list[torch.Tensor] = []
    armed, verdict = job.run(OTHER_BATCH, returned=lambda: _kept(kept))  # new: measured, kept
    assert armed and verdict.measured
    for _ in range(MEASURE_WHILE_HELD):
        armed, verdict = job.run(OTHER_BATCH)  # repeats, measured while the graph is held
        assert armed and verdict.measured
    kept.clear()
    for _ in range(MEASURE_WHILE_HELD):
        assert job.run(OTHER_BATCH)[0]  # the last close that held it still arms two
    armed, verdict = job.run(OTHER_BATCH)
    assert not armed and verdict.carried is not None


def test_a_graph_built_unarmed_and_held_leaves_activations_not_known_while_held() -> None:
    """Nothing recorded what it saved, and nothing may unpack it: every close that finds it
    held says "not known", with one alert; the steps after are measured."""
    job = Job()
    job.settle()
    kept: list[torch.Tensor] = []
    armed, verdict = job.run(returned=lambda: _kept(kept))  # a carried repeat: built unarmed
    assert not armed and not verdict.measured and verdict.carried is None
    assert verdict.alert is not None and verdict.alert.kind == AlertKind.ACTIVATIONS_VARY
    assert "memtui never saw what they saved" in verdict.alert.message
    said_at = job.step - 1
    assert verdict.why_at == said_at
    for _ in range(3):
        armed, verdict = job.run()
        assert armed and not verdict.measured and verdict.carried is None and verdict.alert is None
        assert verdict.why_at == said_at  # said once; each step not known points at it
    kept.clear()
    armed, verdict = job.run()
    assert armed and verdict.measured and verdict.why_at is None


def test_once_the_job_has_compiled_the_hooks_stay_and_it_is_told_once(
    monkeypatch: Any,
) -> None:
    # Whether dynamo compiled is read from dynamo's counters (`job.compiled`); here it is set.
    from memtui_agent.steps import gate as gate_module

    compiled = [False]
    monkeypatch.setattr(gate_module, "has_compiled", lambda: compiled[0])
    job = Job()
    job.run()
    assert job.switch.log[-1] == "disarm"  # nothing compiled yet: `auto` as ever
    compiled[0] = True
    armed, verdict = job.run()  # from other piles: measured, and the close sees the compile
    assert armed and verdict.measured
    assert verdict.note is not None and verdict.note.kind is AlertKind.COMPILED
    assert "torch.compile" in verdict.note.message
    assert job.gate.mode is ActivationMode.EVERY
    since = len(job.switch.log)
    for _ in range(3):  # repeats that `auto` would carry, hooks off
        armed, verdict = job.run()
        assert armed and verdict.measured and verdict.note is None
    assert "disarm" not in job.switch.log[since:]
    compiled[0] = False  # dynamo's counters reset: the job still compiles
    armed, verdict = job.run()
    assert armed and verdict.measured and job.gate.mode is ActivationMode.EVERY


def test_a_forward_no_hook_saw_is_said_with_its_cause() -> None:
    # The job's own saved-tensor hooks on top, or torch's disabling them for a torch.func
    # transform that runs the model: both leave the step not known, each with its own words.
    for flag, words in (
        ("job_hooks", "the job's own saved-tensor hooks"),
        ("disabled", "torch.func"),
    ):
        job = Job()
        job.settle()
        setattr(job.switch, flag, True)
        _armed, verdict = job.run(OTHER_BATCH)  # a new signature, and nothing can count it
        assert not verdict.measured and verdict.carried is None
        assert verdict.alert is not None and verdict.alert.kind is AlertKind.ACTIVATIONS_VARY
        assert words in verdict.alert.message, (flag, verdict.alert.message)
