"""The ledger's byte counts against independently computed truth.

Every number asserted here is derived inside the test (from shapes and dtypes) or measured by the
job itself *without* the agent (its own saved-tensor hooks, its own storage walk): never copied
from the agent's output. The jobs share two interpreters (tests/fixtures/job_host.py), one for
jobs under the agent and one, never entered by the agent, for the jobs that measure the truth:
each imports torch once, runs each job as `python -c` would and fails a job that leaves any
process-global state behind (the agent's hooks, wrappers, threads, files, the job's objects), so
no job sees what an earlier one left. Jobs that only differ by the agent run at the same time.
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from memtui_protocol import schema, wire

JOB_TIMEOUT_S = 120
RECORDING = "rec.memtui"
REPORT_TAG = "@@memtui-test"

_PRELUDE = f"""\
import json as _json

def report(name, value):
    print({REPORT_TAG!r}, name, _json.dumps(value), flush=True)

def storage_key(t):
    return (str(t.device), t.untyped_storage().data_ptr())

def unique_nbytes(tensors):
    seen = {{}}
    for t in tensors:
        seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())
"""

_ACTIVATION_COUNTER = """\
class SavedCounter:
    # Independent activation count: unique non-parameter storages packed by autograd.
    def __init__(self, params):
        self.param_keys = {storage_key(p) for p in params}
        self.saved = {}
        self.param_packed = False

    def pack(self, t):
        key = storage_key(t)
        if key in self.param_keys:
            self.param_packed = True
        else:
            # Hold the storage so its address cannot be reused while we count.
            self.saved[key] = t.untyped_storage()
        return t

    def unpack(self, t):
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def total(self):
        return sum(s.nbytes() for s in self.saved.values())
"""


@dataclass
class JobResult:
    """What one job left behind: its printed reports and, with the agent, its recording."""

    stdout: str
    stderr: str
    reports: dict[str, Any] = field(default_factory=dict)
    messages: list[schema.Message] = field(default_factory=list)

    @property
    def steps(self) -> list[schema.Step]:
        """The closed steps, in stream order."""
        return [m for m in self.messages if isinstance(m, schema.Step)]

    @property
    def end(self) -> schema.End | None:
        """The final message, if the agent wrote one."""
        ends = [m for m in self.messages if isinstance(m, schema.End)]
        return ends[-1] if ends else None

    @property
    def agent_errors(self) -> list[schema.AgentError]:
        """Parts of the agent that switched themselves off."""
        return [m for m in self.messages if isinstance(m, schema.AgentError)]


def job_source(body: str, with_agent: bool) -> str:
    """A complete `python -c` program: the prelude, then `body` (under the agent if asked)."""
    body = textwrap.dedent(body).strip("\n")
    head = f"import torch\nimport torch.nn.functional as F\nfrom torch import nn\n{_PRELUDE}"
    head += _ACTIVATION_COUNTER
    if not with_agent:
        return f"{head}\n{body}\n"
    wrapped = textwrap.indent(body, "    ")
    return (
        f"import memtui_agent\n{head}\n"
        f"with memtui_agent.monitor(record={RECORDING!r}, socket=False):\n{wrapped}\n"
    )


def _job_env(runtime_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMTUI_")}
    env["MEMTUI_RUNTIME_DIR"] = str(runtime_dir)
    # One thread per job: jobs run concurrently on small machines, and the same setting in the
    # runs with and without the agent keeps their numerics comparable.
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    return env


_AGENT_PRELOAD = (
    "torch",
    "memtui_agent.startup.agent",
    "memtui_agent.hooks.tracker",
    "memtui_agent.output.emitter",
)
"""What the agent's host imports while it starts, beside the other host (not inside a test)."""


class Jobs:
    """Runs jobs in two shared interpreters: one for jobs under the agent, one for jobs without.

    The truths never come from the interpreter the agent ran in: the jobs without the agent have
    a host of their own, which the agent never entered. Each host imports torch once; each job
    runs in it as `python -c` would (fresh `__main__`, its own folder, output and traceback), and
    the host fails the job that leaves any process-global state behind (see job_host.py).
    """

    def __init__(self, folder: Path, job_host: ModuleType) -> None:
        runtime = folder / "runtime"
        runtime.mkdir(mode=0o700)
        env = _job_env(runtime)
        self.hosts: dict[bool, Any] = {
            with_agent: job_host.JobHost(
                env, folder, preload=_AGENT_PRELOAD if with_agent else ("torch",)
            )
            for with_agent in (True, False)
        }
        for host in self.hosts.values():
            host.start()

    def run(self, workdir: Path, jobs: dict[str, tuple[str, bool]]) -> dict[str, JobResult]:
        """Run every `name: (body, with_agent)` job, each in `workdir/name`; a job with the agent
        and one without run at the same time, in their two hosts."""
        queues = {
            flag: [(name, body) for name, (body, with_agent) in jobs.items() if with_agent is flag]
            for flag in (True, False)
        }

        def run_queue(with_agent: bool) -> dict[str, JobResult]:
            return {
                name: self._run_one(workdir, name, body, with_agent)
                for name, body in queues[with_agent]
            }

        with ThreadPoolExecutor(2) as pool:
            parts = [pool.submit(run_queue, flag) for flag, queue in queues.items() if queue]
            results = {name: result for part in parts for name, result in part.result().items()}
        return {name: results[name] for name in jobs}

    def one(self, workdir: Path, body: str, with_agent: bool = True) -> JobResult:
        """Run one job (see `run`)."""
        return self.run(workdir, {"job": (body, with_agent)})["job"]

    def _run_one(self, workdir: Path, name: str, body: str, with_agent: bool) -> JobResult:
        cwd = workdir / name
        cwd.mkdir(parents=True)
        source = job_source(body, with_agent)
        outcome = self.hosts[with_agent].run(name, source, cwd, timeout=JOB_TIMEOUT_S)
        stdout, stderr = outcome.stdout, outcome.stderr
        failure = outcome.failure
        assert failure is None, f"job {name} failed: {failure}\n--- its stdout:\n{stdout}"
        result = JobResult(stdout=stdout, stderr=stderr)
        for line in stdout.splitlines():
            if line.startswith(REPORT_TAG + " "):
                _tag, key, value = line.split(" ", 2)
                result.reports[key] = json.loads(value)
        if with_agent:
            data = (cwd / RECORDING).read_bytes()
            decoder = wire.FrameDecoder()
            result.messages = list(decoder.feed(data))
            assert decoder.pending == 0, f"job {name}: torn recording tail"
        return result

    def close(self) -> None:
        """End both hosts."""
        for host in self.hosts.values():
            host.close()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, job_host: ModuleType) -> Iterator[Jobs]:
    """The module's two job hosts, started once."""
    shared = Jobs(tmp_path_factory.mktemp("job-hosts"), job_host)
    try:
        yield shared
    finally:
        shared.close()


def assert_clean(result: JobResult) -> None:
    """The agent ran to the end with every part switched on."""
    assert result.agent_errors == []
    assert result.end is not None and result.end.status == "ok"
    assert "memtui:" not in result.stderr


FP32 = 4
BF16 = 2


# ----- optimizer state: the seed's figures ------------------------------------------------------


def test_adamw_single_parameter_matches_seed_figures(tmp_path: Path, jobs: Jobs) -> None:
    """AdamW on 100 fp32 values holds two 400 B moments and a 4 B step tensor
    (docs/design.md#measured-facts-to-build-on)."""
    result = jobs.one(
        tmp_path,
        """
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(100))
        opt = torch.optim.AdamW([p], foreach=False)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            loss = (p * p).sum()
            loss.backward()
            opt.step()
            report("state", unique_nbytes(opt.state[p].values()))
        """,
    )
    assert_clean(result)
    numel = 100
    moments = 2 * numel * FP32
    step_tensor = 1 * FP32
    # The job's own walk of optimizer.state agrees with the seed's figure on this torch.
    assert result.reports["state"] == moments + step_tensor == 804
    assert [s.step for s in result.steps] == [1, 2]
    for step in result.steps:
        assert step.end.optimizer_state == 804
        assert step.end.weights == numel * FP32 == 400
        assert step.end.gradients == numel * FP32 == 400
        assert step.end.activations == 0
        assert step.dtypes["optimizer_state"] == {"float32": schema.DtypeStat(804, 3)}


def test_sgd_momentum_holds_one_buffer(tmp_path: Path, jobs: Jobs) -> None:
    """SGD with momentum keeps exactly one fp32 momentum buffer per parameter (400 B here)."""
    result = jobs.one(
        tmp_path,
        """
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(100))
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, foreach=False)
        loss = (p * p).sum()
        loss.backward()
        opt.step()
        report("state", unique_nbytes(opt.state[p].values()))
        """,
    )
    assert_clean(result)
    assert result.reports["state"] == 100 * FP32
    (step,) = result.steps
    assert step.end.optimizer_state == 100 * FP32 == 400
    assert step.end.weights == 400
    assert step.end.gradients == 400


# ----- weights: unique storages ----------------------------------------------------------------


def test_tied_weights_count_once(tmp_path: Path, jobs: Jobs) -> None:
    """An embedding tied to its output projection is one storage: weights and grads count once."""
    result = jobs.one(
        tmp_path,
        """
        torch.manual_seed(0)

        class Tied(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(50, 16)
                self.head = nn.Linear(16, 50, bias=False)
                self.head.weight = self.emb.weight

            def forward(self, idx):
                return self.head(self.emb(idx))

        model = Tied()
        assert model.head.weight is model.emb.weight
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        idx = torch.randint(0, 50, (4, 7))
        loss = F.cross_entropy(model(idx).reshape(-1, 50), idx.reshape(-1))
        loss.backward()
        opt.step()
        report("weights", unique_nbytes([*model.parameters(), *model.buffers()]))
        report("grads", unique_nbytes([p.grad for p in model.parameters()]))
        """,
    )
    assert_clean(result)
    tied = 50 * 16 * FP32
    assert result.reports["weights"] == tied
    assert result.reports["grads"] == tied
    (step,) = result.steps
    assert step.end.weights == tied
    assert step.end.gradients == tied
    assert step.end.optimizer_state == 0
    assert step.dtypes["weights"] == {"float32": schema.DtypeStat(tied, 1)}


# ----- dtypes ---------------------------------------------------------------------------------


def test_bf16_adamw_dtype_inventory(tmp_path: Path, jobs: Jobs) -> None:
    """bf16 parameters give bf16 AdamW moments and float32 step tensors, per dtype and count."""
    result = jobs.one(
        tmp_path,
        """
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), foreach=False)
        x = torch.randn(5, 8, dtype=torch.bfloat16)
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        params = list(model.parameters())
        report("numel", sum(p.numel() for p in params))
        report("tensors", len(params))
        """,
    )
    assert_clean(result)
    shapes = [(16, 8), (16,), (4, 16), (4,)]
    numel = sum(torch.Size(shape).numel() for shape in shapes)
    tensors = len(shapes)
    assert (result.reports["numel"], result.reports["tensors"]) == (numel, tensors)
    (step,) = result.steps
    assert step.dtypes["optimizer_state"] == {
        "bfloat16": schema.DtypeStat(2 * numel * BF16, 2 * tensors),
        "float32": schema.DtypeStat(tensors * FP32, tensors),
    }
    assert step.dtypes["weights"] == {"bfloat16": schema.DtypeStat(numel * BF16, tensors)}
    assert step.dtypes["gradients"] == {"bfloat16": schema.DtypeStat(numel * BF16, tensors)}
    assert step.end.optimizer_state == 2 * numel * BF16 + tensors * FP32
    assert step.end.weights == numel * BF16


# ----- activations ------------------------------------------------------------------------------

_MLP_JOB = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 32)
target = torch.randn(16, 8)
counter = SavedCounter(model.parameters())
with counter.hooks() if COUNT else contextlib.nullcontext():
    loss = F.mse_loss(model(x), target)
report("saved", counter.total())
report("param_packed", counter.param_packed)
loss.backward()
opt.step()
"""

_LINEAR_VIEW_JOB = """
torch.manual_seed(0)

class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(48, 32) / 6)
        self.w2 = nn.Parameter(torch.randn(8, 48) / 7)

    def forward(self, x):
        # mm saves `w2.t()`, a view of the parameter, because `h` requires grad.
        h = torch.tanh(F.linear(x, self.w1))
        return F.linear(h, self.w2)

model = TwoLinear()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 32)
counter = SavedCounter(model.parameters())
with counter.hooks() if COUNT else contextlib.nullcontext():
    loss = model(x).square().sum()
report("saved", counter.total())
report("param_packed", counter.param_packed)
report("weights", unique_nbytes(model.parameters()))
loss.backward()
opt.step()
"""


def _activation_jobs(body: str) -> dict[str, tuple[str, bool]]:
    """The same job twice: under the agent (its counter idle) and alone, counting by itself."""
    with_agent = "import contextlib\nCOUNT = False\n" + textwrap.dedent(body)
    alone = "import contextlib\nCOUNT = True\n" + textwrap.dedent(body)
    return {"agent": (with_agent, True), "truth": (alone, False)}


def test_mlp_saved_activations_match_independent_count(tmp_path: Path, jobs: Jobs) -> None:
    """max.activations is exactly the unique non-parameter storages autograd saved; 0 at close."""
    results = jobs.run(tmp_path, _activation_jobs(_MLP_JOB))
    agent, truth = results["agent"], results["truth"]
    assert_clean(agent)
    expected = truth.reports["saved"]
    # Sanity of the independent count: at least the input, the ReLU output and the MLP output.
    assert expected >= (16 * 32 + 16 * 64 + 16 * 8) * FP32
    (step,) = agent.steps
    assert step.max.activations == expected
    assert step.end.activations == 0
    assert agent.end is not None and agent.end.piles is not None
    assert agent.end.piles.activations == 0


def test_parameter_view_is_never_an_activation(tmp_path: Path, jobs: Jobs) -> None:
    """A weight packed as `weight.t()` (a view) stays in weights, never in activations."""
    results = jobs.run(tmp_path, _activation_jobs(_LINEAR_VIEW_JOB))
    agent, truth = results["agent"], results["truth"]
    assert_clean(agent)
    # The scenario really does pack a parameter storage, or this test proves nothing.
    assert truth.reports["param_packed"] is True
    weights = (48 * 32 + 8 * 48) * FP32
    assert truth.reports["weights"] == weights
    (step,) = agent.steps
    assert step.max.activations == truth.reports["saved"]
    assert step.end.weights == weights
    assert step.end.activations == 0


# ----- steps, microbatches and the loss ----------------------------------------------------------

_ACCUMULATION_JOB = """
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.arange(12.0).reshape(3, 4) / 10
y = torch.tensor([[1.0], [-2.0], [0.5]])
losses = []
# Step 1: three microbatches accumulated into one update; then three plain steps.
for microbatches in (3, 1, 1, 1):
    step_losses = []
    for i in range(microbatches):
        loss = F.mse_loss(model(x[i : i + 1] + len(losses)), y[i : i + 1])
        loss.backward()
        step_losses.append(loss.item())
    opt.step()
    opt.zero_grad()
    losses.append(step_losses)
report("losses", losses)
"""


@pytest.fixture(scope="module")
def accumulation(tmp_path_factory: pytest.TempPathFactory, jobs: Jobs) -> JobResult:
    """One job shared by the microbatch and loss tests (3 + 1 + 1 + 1 forwards, 4 updates)."""
    result = jobs.one(tmp_path_factory.mktemp("accumulation"), _ACCUMULATION_JOB)
    assert_clean(result)
    return result


def test_gradient_accumulation_counts_microbatches(accumulation: JobResult) -> None:
    """Forwards between two optimizer steps are that step's microbatches; steps number 1..n."""
    steps = accumulation.steps
    assert len(steps) == 4
    assert [s.step for s in steps] == [1, 2, 3, 4]
    assert [s.microbatches for s in steps] == [3, 1, 1, 1]
    assert not any(s.skipped for s in steps)


def test_step_loss_is_the_jobs_loss(accumulation: JobResult) -> None:
    """With one backward per step, step.loss is the scalar the job itself computed."""
    printed = accumulation.reports["losses"]
    assert len(printed) == len(accumulation.steps) == 4
    for step, step_losses in zip(accumulation.steps[1:], printed[1:], strict=True):
        (expected,) = step_losses
        assert step.loss == pytest.approx(expected, rel=1e-6)


# ----- the agent must not change the job -----------------------------------------------------

_BITWISE_JOB = """
torch.manual_seed(1234)
model = nn.Sequential(
    nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Dropout(0.3), nn.Linear(32, 4)
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
for _ in range(5):
    x = torch.randn(8, 16)
    y = torch.randn(8, 4)
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
torch.save(model.state_dict(), "final.pt")
report("losses", losses)
"""


def test_training_is_bit_identical_with_and_without_agent(tmp_path: Path, jobs: Jobs) -> None:
    """The agent only observes: same seed, same weights to the bit (dropout RNG, in-place ReLU)."""
    results = jobs.run(tmp_path, {"agent": (_BITWISE_JOB, True), "plain": (_BITWISE_JOB, False)})
    assert_clean(results["agent"])
    assert len(results["agent"].steps) == 5
    assert results["agent"].reports["losses"] == results["plain"].reports["losses"]
    with_agent = torch.load(tmp_path / "agent" / "final.pt")
    plain = torch.load(tmp_path / "plain" / "final.pt")
    assert with_agent.keys() == plain.keys()
    for name, tensor in plain.items():
        assert torch.equal(with_agent[name], tensor), name


# ----- the shared interpreter ------------------------------------------------------------------


def test_a_job_in_the_shared_host_meets_a_fresh_agent(tmp_path: Path, jobs: Jobs) -> None:
    """Two runs of one job in one interpreter record the same steps: nothing of the first
    agent (optimizer names and counts, step numbers, piles) carries over to the second."""
    body = """
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(100))
    opt = torch.optim.AdamW([p], foreach=False)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        (p * p).sum().backward()
        opt.step()
    """
    first, second = (jobs.one(tmp_path / run, body) for run in ("first", "second"))
    hellos = [next(m for m in r.messages if isinstance(m, schema.Hello)) for r in (first, second)]
    assert hellos[0].pid == hellos[1].pid  # one interpreter, or this proves nothing
    for result in (first, second):
        assert_clean(result)
        assert [(s.step, s.optimizer, s.optimizer_step) for s in result.steps] == [
            (1, "AdamW#1", 1),
            (2, "AdamW#1", 2),
        ]
    assert [s.end for s in first.steps] == [s.end for s in second.steps]
    assert [s.dtypes for s in first.steps] == [s.dtypes for s in second.steps]


# ----- regressions found while writing the tests above ---------------------------------------

_CHECKPOINT_JOB = """
import weakref
from torch.utils.checkpoint import checkpoint

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(checkpoint(self.a, x, use_reentrant=False))

torch.manual_seed(0)
model = Block()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
alive = []
for _ in range(2):
    opt.zero_grad()
    x = torch.randn(4, 8, requires_grad=True)
    storage = weakref.ref(x.untyped_storage())
    model(x).sum().backward()
    del x
    alive.append(storage() is not None)
    opt.step()
report("alive_after_backward", alive)
"""


def test_checkpoint_inputs_are_released_after_backward(tmp_path: Path, jobs: Jobs) -> None:
    """The agent must not keep a checkpointed block's inputs alive past backward.

    Non-reentrant checkpoint stops its recomputation by raising an exception through the
    recomputed module; an agent that keeps that exception keeps its traceback, and with it the
    checkpoint frame and the block's saved inputs, alive: memory the job would otherwise free,
    and activations that never leave the ledger.
    """
    results = jobs.run(
        tmp_path, {"agent": (_CHECKPOINT_JOB, True), "plain": (_CHECKPOINT_JOB, False)}
    )
    assert results["plain"].reports["alive_after_backward"] == [False, False]
    agent = results["agent"]
    assert_clean(agent)
    assert agent.reports["alive_after_backward"] == [False, False]
    assert [s.end.activations for s in agent.steps] == [0, 0]


_SUBCLASS_PRELUDE = """
# Before the MLP's forward, autograd packs a tensor subclass (a jagged nested tensor) whose
# storage is not reachable through untyped_storage(); the ledger must skip it and go on counting.
nt = torch.nested.nested_tensor(
    [torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged, requires_grad=True
)
(nt * nt).values().sum().backward()
"""


def test_tensor_subclass_does_not_switch_off_activation_tracking(
    tmp_path: Path, jobs: Jobs
) -> None:
    """A saved tensor subclass is skipped (ledger docstring), not fatal to activation counting."""
    results = jobs.run(tmp_path, _activation_jobs(_SUBCLASS_PRELUDE + _MLP_JOB))
    agent, truth = results["agent"], results["truth"]
    assert agent.agent_errors == []
    assert agent.end is not None and agent.end.status == "ok"
    # The prelude's backward ran before any optimizer existed: it is a step of its own
    # (docs/design.md#steps); the MLP's optimizer step is the next.
    closed_by = [step.closed_by for step in agent.steps]
    assert closed_by == [schema.StepTrigger.BACKWARD, schema.StepTrigger.OPTIMIZER]
    step = agent.steps[-1]
    assert step.max.activations == truth.reports["saved"]
    assert step.end.activations == 0


def test_sync_recounts_a_storage_freed_since_even_at_the_same_pointer() -> None:
    """The close-time sync skips unchanged piles and caches tensors by id and pointer; neither
    shortcut may keep out a storage that left the pile (freed, its pointer then reused)."""
    from memtui_agent.memory.ledger import WEIGHTS, Ledger

    ledger = Ledger()
    weight = torch.zeros(64)
    ledger.sync(WEIGHTS, [weight])
    ledger.sync(WEIGHTS, [weight])  # unchanged: the fingerprint path
    assert ledger.current().weights == 256
    key = next(iter(ledger._members[WEIGHTS]))
    ledger._clear_bit(key, WEIGHTS)  # as the free callback does when the storage dies
    assert ledger.current().weights == 0
    ledger.sync(WEIGHTS, [weight])  # same object, same pointer: must be counted again
    assert ledger.current().weights == 256
    other = torch.zeros(16)
    ledger.sync(WEIGHTS, [weight, other])
    assert ledger.current().weights == 256 + 64
    ledger.sync(WEIGHTS, [other])
    assert ledger.current().weights == 64


def test_high_water_marks_match_an_eager_replay_of_random_event_sequences() -> None:
    """The ledger takes the peak's composition and the activation dtypes at their maximum lazily
    (at the first decrease after a new high); an eager replay, copying at every new high, must
    agree after any interleaving of packs, releases, gradient claims and gradient frees."""
    import random

    from memtui_agent.memory.ledger import ACTIVATIONS, GRADIENTS, Ledger

    def as_list(piles: schema.Piles) -> list[int]:
        return list(piles.counted())

    for seed in range(25):
        rng = random.Random(seed)
        ledger = Ledger()
        piles = [0, 0, 0, 0]
        best_total, best_piles, best_pile = 0, list(piles), list(piles)
        act_dtypes: dict[str, list[int]] = {}
        dtypes_at_max: dict[str, tuple[int, int]] = {}
        acts: dict[int, tuple[int, str]] = {}
        grads: dict[int, tuple[Any, int]] = {}
        for index in range(300):
            choice = rng.random()
            if choice < 0.35 or (not acts and not grads):
                key, nbytes = ((index + 1) << 8) | 0x55, rng.randrange(1, 5000)
                dtype = rng.choice(["float32", "bfloat16"])
                ledger.acquire_activation(key, nbytes, dtype, rng.randrange(-1, 4))
                acts[key] = (nbytes, dtype)
                piles[ACTIVATIONS] += nbytes
                act_dtypes.setdefault(dtype, [0, 0])
                act_dtypes[dtype][0] += nbytes
                act_dtypes[dtype][1] += 1
            elif choice < 0.6 and acts:
                key = rng.choice(sorted(acts))
                nbytes, dtype = acts.pop(key)
                ledger.release_activation(key)
                piles[ACTIVATIONS] -= nbytes
                act_dtypes[dtype][0] -= nbytes
                act_dtypes[dtype][1] -= 1
                if not act_dtypes[dtype][1]:
                    del act_dtypes[dtype]
            elif choice < 0.85:
                tensor = torch.empty(rng.randrange(1, 4000), dtype=torch.uint8)
                storage = tensor.untyped_storage()
                key = (storage.data_ptr() << 8) | 0  # a CPU storage's key
                ledger.claim(GRADIENTS, key, storage.nbytes(), "uint8", storage, tensor)
                grads[key] = (tensor, storage.nbytes())
                piles[GRADIENTS] += storage.nbytes()
                del storage
            elif grads:
                key = rng.choice(sorted(grads))
                tensor, nbytes = grads.pop(key)
                del tensor  # the storage's weakref callback takes it out of the pile
                piles[GRADIENTS] -= nbytes
            if piles[ACTIVATIONS] > best_pile[ACTIVATIONS]:  # a new activations high
                dtypes_at_max = {name: (s, c) for name, (s, c) in act_dtypes.items()}
            best_pile = [max(a, b) for a, b in zip(best_pile, piles, strict=True)]
            if sum(piles) > best_total:
                best_total, best_piles = sum(piles), list(piles)
        current, high, peak, dtypes = ledger.at_close()
        assert as_list(current) == piles, seed
        assert as_list(high) == best_pile, seed
        assert as_list(peak) == best_piles and sum(best_piles) == best_total, seed
        at_max = {name: (stat.bytes, stat.count) for name, stat in dtypes["activations"].items()}
        assert at_max == dtypes_at_max, seed
