"""`--activations auto`: steps whose activations can differ are measured, repeats carry the
figures of the measured step they repeat, and every step says which (issue 15).

The job's truth is an independent count (its own saved-tensor hooks, in a run without the agent,
since a job's own hooks would shadow the agent's): per step, the bytes of unique non-parameter
storages autograd saved, all alive until that step's backward.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI, scrubbed_env

from memtui.model.recording import read_recording
from memtui_agent.steps import activation_policy
from memtui_agent.steps.activation_policy import Figures, Verdict
from memtui_agent.steps.activation_wording import SaidOnce
from memtui_agent.steps.decision import ActivationReading, DecisionState, decide
from memtui_agent.steps.step_signature import Signature
from memtui_protocol import schema


class ActivationPolicy(activation_policy.ActivationPolicy):
    """The policy with each close decided and the decision applied as the gate applies it
    (`gate.ActivationGate._apply`): a close gives its verdict, with its alert."""

    def __init__(
        self, mode: schema.ActivationMode, audit_every: int = activation_policy.AUDIT_EVERY
    ) -> None:
        super().__init__(mode, audit_every)
        self.state = DecisionState(mode)
        self.said = SaidOnce()

    def close(self, step: int, figures: Figures, blind: bool = False) -> Verdict:  # type: ignore[override]
        decision = decide(
            self.state, ActivationReading(step, figures, super().close(step, figures, blind))
        )
        self.state = decision.next_state
        self.mode = decision.next_mode
        self.measure_next(decision.measure_next)
        return replace(decision.verdict, alert=self.said.alert(decision))


VARYING_BATCH = """
import contextlib, json, sys, torch, memtui_agent
torch.manual_seed(0)
BATCHES = [8, 8, 8, 8, 8, 16, 16, 8, 4, 16, 8, 8, 4]

class Counter:
    def __init__(self, params):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.saved = {}
    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.saved[s.data_ptr()] = s
        return t

def train(counting):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in BATCHES:
        x, y = torch.randn(batch, 32), torch.randn(batch, 4)
        counter = Counter(model.parameters())
        hooks = torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)
        with hooks if counting else contextlib.nullcontext():
            loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print("SAVED", sum(s.nbytes() for s in counter.saved.values()), flush=True)

if sys.argv[1] == "truth":
    train(True)
else:
    with memtui_agent.monitor(record="rec.memtui", socket=False, activations=sys.argv[1]):
        train(False)
"""

BATCHES = [8, 8, 8, 8, 8, 16, 16, 8, 4, 16, 8, 8, 4]


def _saved(stdout: str) -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("SAVED")]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", "every"])
def test_changing_batch_sizes_are_exact_on_every_step(
    tmp_path: Path, shared_python: Any, mode: str
) -> None:
    truth = shared_python(VARYING_BATCH, "truth", cwd=tmp_path)
    assert truth.returncode == 0, truth.stderr
    result = shared_python(VARYING_BATCH, mode, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    steps = read_recording(tmp_path / "rec.memtui").steps
    expected = _saved(truth.stdout)
    assert len(steps) == len(BATCHES) == len(expected)
    assert [step.max.activations for step in steps] == expected
    assert all(step.end.activations == 0 for step in steps)
    # Weights, gradients (counted without the ledger between measured steps) and AdamW's state
    # are exact at every close, measured or carried.
    weights = (32 * 64 + 64 + 64 * 4 + 4) * 4
    state = 2 * weights + 4 * 4
    for step in steps:
        assert (step.end.weights, step.end.gradients) == (weights, weights)
        assert step.end.optimizer_state == state
        assert step.dtypes["gradients"] == {"float32": schema.DtypeStat(weights, 4)}
    measured = [step.activations_measured for step in steps]
    if mode == "every":
        assert all(measured)
        return
    # Measured: the first three steps, then each batch size the first time it comes back to a
    # state not seen before (steps 6: 16 rows, 9: 4 rows); the rest repeat a measured step.
    assert measured == [True] * 3 + [False, False, True, False, False, True] + [False] * 4
    for step, batch in zip(steps, BATCHES, strict=True):
        if not step.activations_measured:
            assert step.activations_from is not None
            source = steps[step.activations_from - 1]
            assert source.activations_measured
            assert BATCHES[source.step - 1] == batch
            assert step.dtypes["activations"] == source.dtypes["activations"]
            assert step.top_activations == source.top_activations


@pytest.mark.slow
def test_off_counts_no_activations_and_says_so(tmp_path: Path, shared_python: Any) -> None:
    result = shared_python(VARYING_BATCH, "off", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    steps = read_recording(tmp_path / "rec.memtui").steps
    assert len(steps) == len(BATCHES)
    # Not known: null, never a 0 that reads as a measurement.
    assert all(step.max.activations is None and step.end.activations is None for step in steps)
    assert not any(step.activations_measured for step in steps)
    assert all(step.activations_from is None for step in steps)
    weights = (32 * 64 + 64 + 64 * 4 + 4) * 4
    assert all(step.end.weights == weights and step.end.gradients == weights for step in steps)


SAME_OPS = Signature(nodes=(5, 0), memory=None, exact_memory=False)
"""Every step here runs the same autograd ops: a repeat measured differently then depends on
the data (with other ops it simply did something else)."""


def _figures(step: int, activations: int) -> Figures:
    piles = schema.Piles(activations=activations)
    return Figures(step, 0, piles, piles, {}, (), signature=SAME_OPS)


def test_policy_carries_a_repeat_and_measures_what_is_new() -> None:
    policy = ActivationPolicy(schema.ActivationMode.AUTO, audit_every=1000)
    start = schema.Piles(weights=100)
    verdicts = []
    for step, (shape, size) in enumerate([("a", 10), ("a", 10), ("b", 20), ("a", 10)], 1):
        policy.begin(start)
        armed = policy.root_call((shape,), step, must_measure=False)
        verdicts.append((armed, policy.close(step, _figures(step, size if armed else 0))))
    assert [armed for armed, _ in verdicts] == [True, False, True, False]
    assert [v.measured for _, v in verdicts] == [True, False, True, False]
    assert [v.carried.step if v.carried else None for _, v in verdicts] == [None, 1, None, 1]


def _run_steps(
    policy: ActivationPolicy, steps: list[tuple[Any, ...]], first: int = 1
) -> list[bool]:
    """Each step's calls through `policy`; whether each step was measured."""
    measured = []
    for step, calls in enumerate(steps, first):
        policy.begin(schema.Piles(weights=100))
        armed = False
        for call in calls:
            armed = policy.root_call(call, step, must_measure=False) or armed
        measured.append(policy.close(step, _figures(step, len(calls) if armed else 0)).measured)
    return measured


def test_dynamic_padding_is_carried_once_every_length_was_seen() -> None:
    # A text dataset padded per batch: 300 lengths in turn. The first pass measures each one,
    # the second carries them all (with 64 remembered, as before, it measured every step).
    policy = ActivationPolicy(schema.ActivationMode.AUTO, audit_every=10_000)
    policy.measure_next(0)
    lengths = [((8, length),) for length in range(1, 301)]
    assert _run_steps(policy, lengths) == [True] * 300
    assert _run_steps(policy, lengths, first=301) == [False] * 300


def test_remembered_calls_stay_bounded_and_prefixes_stay_right() -> None:
    # Steps of many root calls (a rollout) keep the remembered calls under KEEP_CALLS; the
    # prefix tree always answers as a scan of the remembered signatures would.
    import random

    from memtui_agent.steps.activation_policy import KEEP_CALLS

    rng = random.Random(0)
    policy = ActivationPolicy(schema.ActivationMode.AUTO, audit_every=10_000)
    for step in range(1, 400):
        calls = [(rng.randrange(3),) for _ in range(rng.choice([1, 2, 50, 500]))]
        policy.begin(schema.Piles(weights=100))
        references = list(policy._references)  # before this step remembers itself
        for index, call in enumerate(calls, 1):
            policy.root_call(call, step, must_measure=False)
            scanned = any(
                start == policy._start and kept[:index] == tuple(calls[:index])
                for start, kept in references
            )
            assert (policy._cursor is not None) == scanned, (step, index)
        policy.close(step, _figures(step, 1))
        kept = sum(len(kept_calls) for _, kept_calls in policy._references)
        assert kept == policy._kept_calls
        assert kept <= KEEP_CALLS or len(policy._references) == 1


def test_policy_measures_a_step_that_leaves_its_repeat_and_says_it_is_partial() -> None:
    policy = ActivationPolicy(schema.ActivationMode.AUTO, audit_every=1000)
    start = schema.Piles()
    policy.begin(start)
    policy.root_call(("a",), 1, must_measure=False)
    policy.root_call(("a",), 1, must_measure=False)
    assert policy.close(1, _figures(1, 10)).measured
    policy.begin(start)
    assert not policy.root_call(("a",), 2, must_measure=False)  # repeats so far
    assert policy.root_call(("b",), 2, must_measure=False)  # then leaves it: arm
    verdict = policy.close(2, _figures(2, 5))
    assert not verdict.measured and verdict.carried is None  # measured in part: not known
    policy.begin(start)
    assert policy.root_call(("a",), 3, must_measure=False)  # so the next step is measured


def test_an_audit_that_disagrees_switches_to_every_step() -> None:
    policy = ActivationPolicy(schema.ActivationMode.AUTO, audit_every=3)
    start = schema.Piles()
    for step, size in [(1, 10), (2, 10), (3, 12)]:
        policy.begin(start)
        armed = policy.root_call(("a",), step, must_measure=False)
        verdict = policy.close(step, _figures(step, size if armed else 0))
    assert verdict.measured and verdict.alert is not None
    assert verdict.alert.kind == "activations_vary"
    assert policy.mode is schema.ActivationMode.EVERY


def _measured_pair(
    first: tuple[int, int, schema.Piles], second: tuple[int, int, schema.Piles]
) -> Any:
    """Two measured steps with the same calls, start and autograd ops; each given as (its
    activations' high, those left at its close, its peak). The second's verdict."""
    policy = ActivationPolicy(schema.ActivationMode.AUTO, audit_every=1000)
    verdict = None
    for step, (high, end, peak) in enumerate([first, second], 1):
        policy.begin(schema.Piles(weights=100, gradients=100))
        policy.root_call(("a",), step, must_measure=True)
        figures = Figures(
            step, end, schema.Piles(activations=high), peak, {}, (), signature=SAME_OPS
        )
        verdict = policy.close(step, figures)
    return verdict


def test_a_peak_that_moved_with_the_gradients_is_no_varying_activations() -> None:
    """Gradients freed between two steps (`model.zero_grad()` at an epoch's end) are allocated
    again during the next backward: its peak comes at another moment, with other piles, while
    the activations are the same bytes. Nothing about them varies (issue 26: the alert fired
    quoting equal numbers)."""
    with_gradients = schema.Piles(weights=100, gradients=100, activations=70)
    without = schema.Piles(weights=100, gradients=40, activations=30)
    verdict = _measured_pair((70, 0, with_gradients), (70, 0, without))
    assert verdict.measured and verdict.alert is None


def test_activations_vary_quotes_only_the_figures_that_differ() -> None:
    peak = schema.Piles(weights=100, activations=70)
    verdict = _measured_pair((70, 0, peak), (90, 0, peak))
    assert verdict.alert is not None and verdict.alert.kind == "activations_vary"
    assert "(max 90 B vs 70 B)" in verdict.alert.message
    verdict = _measured_pair((70, 8, peak), (70, 12, peak))
    assert verdict.alert is not None and "(at the close 12 B vs 8 B)" in verdict.alert.message
    for message in (verdict.alert.message,):
        quoted = re.findall(r"([\d,]+) B vs ([\d,]+) B", message)
        assert quoted and all(mine != theirs for mine, theirs in quoted)


EPOCH_END_ZERO_GRAD = """
import io, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for epoch in range(2):
    for batch in range(8):
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    model.zero_grad()  # set_to_none: the gradients are freed before the checkpoint
    torch.save(model.state_dict(), io.BytesIO())
"""


@pytest.mark.slow
def test_no_varying_activations_at_an_epochs_end_with_every_step_probed(tmp_path: Path) -> None:
    """`memtui run --headless --nan-check full` (every step measured, every repeat compared)
    on a job whose activations never vary: no `activations_vary`."""
    import subprocess

    (tmp_path / "train.py").write_text(EPOCH_END_ZERO_GRAD)
    env = scrubbed_env(tmp_path / "rt", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [*MEMTUI, "run", "--headless", "--nan-check", "full",
         "-o", "rec.memtui", "train.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    recording = read_recording(tmp_path / "rec.memtui")
    assert len(recording.steps) == 16 and all(s.activations_measured for s in recording.steps)
    assert [
        item.alert.message for item in recording.alerts if item.kind == "activations_vary"
    ] == []
    # The step after the epoch's end really peaked lower (its gradients came back late).
    assert sum(recording.steps[8].peak.counted()) < sum(recording.steps[7].peak.counted())


STAND_IN_DEVICE = """
import sys, threading, torch, memtui_agent
from memtui_agent.steps import health

class LandsAtNextClose:
    # torch.cuda.Event's part the agent uses: the copy has landed when the next close asks.
    waits = 0
    def query(self):
        return True
    def synchronize(self):
        LandsAtNextClose.waits += 1

if sys.argv[1] == "stand-in":  # the CPU stands in for a device whose reads would sync
    health.DEFERRED_DEVICES = frozenset({"cpu"})
    health.make_event = lambda device: LandsAtNextClose()
reads = [0]
closing = [False]
original_close = health.HealthMonitor.close
def counting(original):
    def counted(self):
        # A read of the step's own check results while it closes: on a device, a host sync.
        if closing[0] and threading.current_thread() is threading.main_thread():
            reads[0] += 1
        return original(self)
    return counted
def close(self, *args, **kwargs):
    closing[0] = True
    try:
        return original_close(self, *args, **kwargs)
    finally:
        closing[0] = False
for name in ("tolist", "item"):  # every way a tensor's values reach the host
    setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
health.HealthMonitor.close = close

torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False):
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 7):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        if step == 4:
            model.bias.grad[0] = float("nan")
        before = reads[0]
        opt.step()
        if step <= 3:
            print("READS", reads[0] - before, "WAITS", LandsAtNextClose.waits, flush=True)
print("END WAITS", LandsAtNextClose.waits)
"""


@pytest.mark.slow
def test_a_device_step_close_reads_nothing_back_and_its_alarm_arrives_late(
    tmp_path: Path, run_python: Any
) -> None:
    """On a device, the healthy step's check is copied behind an event and read at a later
    close: no read on the training thread at the close (a stand-in device counts them), and
    the step that went bad still gets its alert, carried by a later frame."""
    # A fresh interpreter per run (`run_python`, not `shared_python`): the job patches
    # torch.Tensor.tolist and the agent's health module and never undoes it.
    control = run_python(STAND_IN_DEVICE, "host", cwd=tmp_path)
    assert control.returncode == 0, control.stderr
    # On the host the check is read at once: the counter sees those reads.
    assert all(int(line.split()[1]) >= 1 for line in control.stdout.splitlines()[:3])
    result = run_python(STAND_IN_DEVICE, "stand-in", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    healthy = [line.split() for line in result.stdout.splitlines() if line.startswith("READS")]
    assert [(fields[1], fields[3]) for fields in healthy] == [("0", "0")] * 3
    steps = read_recording(tmp_path / "rec.memtui").steps
    kinds = {step.step: [alert.kind for alert in step.alerts] for step in steps}
    assert "nonfinite_gradient" in kinds[4]  # folded into step 4 from a later frame's `late`
    assert not any(kinds[n] for n in (1, 2, 3))
    assert any(late.step == 4 for step in steps for late in step.late)


SECOND_STAGE = """
import sys, torch, memtui_agent
torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False, activations=sys.argv[1]):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for stage in range(2):  # a tuning pass, then training with a new optimizer of equal state
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(6):
            def closure():
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()  # after the forward: last step's gradients live through it
                loss.backward()
                return loss
            opt.step(closure)
"""


@pytest.mark.slow
def test_auto_equals_every_through_a_second_stage_and_late_zero_grad(
    tmp_path: Path, shared_python: Any
) -> None:
    """Lightning's shape: forward and backward in a closure, gradients zeroed after the forward
    (so the previous step's are alive in it), and a second optimizer with state of the same
    size. `auto` gives every figure `every` gives, carries only true repeats, and raises no
    `activations_vary`."""
    figures = {}
    for mode in ("every", "auto"):
        folder = tmp_path / mode
        folder.mkdir()
        result = shared_python(SECOND_STAGE, mode, cwd=folder)
        assert result.returncode == 0, result.stderr
        recording = read_recording(folder / "rec.memtui")
        assert not [a for a in recording.alerts if a.alert.kind == "activations_vary"]
        figures[mode] = [(s.max, s.peak, s.end, s.dtypes) for s in recording.steps]
        if mode == "auto":
            carried = [s.step for s in recording.steps if not s.activations_measured]
            assert carried and 7 not in carried and 8 not in carried  # the new optimizer's
    assert figures["auto"] == figures["every"]


def test_a_new_optimizer_makes_a_step_new_even_at_equal_piles() -> None:
    policy = ActivationPolicy(schema.ActivationMode.AUTO, audit_every=1000)
    start = schema.Piles(weights=100, optimizer_state=50)
    policy.begin(start)
    assert policy.root_call(("a",), 1, must_measure=False, optimizers=((1, True),))
    policy.close(1, _figures(1, 10))
    policy.begin(start)
    assert not policy.root_call(("a",), 2, must_measure=False, optimizers=((1, True),))
    policy.close(2, _figures(2, 0))
    policy.begin(start)  # the same piles, but another optimizer, without state yet
    assert policy.root_call(("a",), 3, must_measure=False, optimizers=((2, False),))


REMOVED_MID_CALL = """
import torch, memtui_agent
from torch.nn.modules.module import register_module_forward_pre_hook
memtui_agent.start(record="rec.memtui", socket=False)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
calls = [0]
def stop_on_fifth(module, args):
    # As `memtui detach` does: the agent leaves from a global pre-hook of a forward in which
    # its own root pre-hook is still queued.
    calls[0] += 1
    if calls[0] == 5:
        memtui_agent.stop()
register_module_forward_pre_hook(stop_on_fifth)
for _ in range(8):
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
print("JOB OK")
"""


@pytest.mark.slow
def test_removing_the_agent_inside_a_forward_never_breaks_it(
    tmp_path: Path, run_python: Any
) -> None:
    # A fresh interpreter (`run_python`): the job leaves its global pre-hook registered.
    result = run_python(REMOVED_MID_CALL, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "JOB OK" in result.stdout


class _Text(str):
    """A job's own string type (weakly referenceable, unlike a plain str)."""


def test_signatures_hold_bounded_data_never_the_jobs_strings() -> None:
    """A job passing a new 1 MiB string per step grew by 515 MiB: every remembered signature
    kept its string alive. Now a remembered step keeps none of the job's objects (a long
    string is its length and hash, a short one a copy of our own), and still tells two calls
    apart."""
    import gc
    import weakref

    import torch

    from memtui_agent.steps import activation_policy
    from memtui_agent.steps.activation_policy import call_signature

    module = torch.nn.Linear(2, 2)
    policy = ActivationPolicy(schema.ActivationMode.AUTO, audit_every=10_000)
    policy.measure_next(0)
    kept: list[weakref.ref[_Text]] = []
    signatures = []
    for step in range(1, 21):
        prompt = _Text(str(step) * (1 << 20))
        short = _Text("train")
        kept += [weakref.ref(prompt), weakref.ref(short)]
        signature = call_signature(module, (prompt,), {"mode": short, short: 1})
        signatures.append(signature)
        policy.begin(schema.Piles(weights=100))
        armed = policy.root_call(signature, step, must_measure=False)
        policy.close(step, _figures(step, 1 if armed else 0))
        del prompt, short
    gc.collect()
    assert all(ref() is None for ref in kept)  # none of the job's strings is alive
    texts = [value for s in signatures for value in _leaves(s) if isinstance(value, str)]
    assert texts and all(len(text) <= activation_policy.MAX_KEPT_CHARS for text in texts)
    assert len(set(signatures)) == 20  # every step's string differs, and so do the keys
    again = call_signature(module, (_Text("1" * (1 << 20)),), {"mode": "train", "train": 1})
    assert again == signatures[0]


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, tuple):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]
