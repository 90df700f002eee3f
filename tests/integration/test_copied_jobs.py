"""A job copies and pickles what the agent hooked, under `memtui run`, as it does without it.

`copy.deepcopy(model)` (`AveragedModel`, an EMA, a best-model snapshot) raised `TypeError:
cannot pickle '_thread.RLock' object` once the agent had hooked the model: each root's hook dicts
held bound methods of the agent. Now the agent's hooks there copy and pickle as an inert stand-in
of the standard library (`agent/memtui_agent/hooks/copy_safe.py`), the functions it wraps pickle
as torch's own, and a whole model saved with `torch.save` loads where memtui is not installed.

The job runs under plain python and under `memtui run` in each `--activations` mode; its stdout
(losses, what the copies compute, the pickles that are deterministic) and its own stderr (no
"will not be serialized" warning of torch's) must be the same.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from cli_harness import MEMTUI, scrubbed_env

from memtui_protocol import schema, wire

pytestmark = pytest.mark.slow  # torch jobs in fresh interpreters

JOB = """\
import copy, hashlib, json, pickle
import torch
from torch.optim.swa_utils import AveragedModel

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
extra = torch.zeros(1, requires_grad=True)  # a plain leaf tensor the optimizer steps
optimizer = torch.optim.Adam([*model.parameters(), extra], lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
scaler = torch.amp.GradScaler("cpu")
for step in range(4):
    loss = (model(torch.randn(4, 8)) + extra).pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    scheduler.step()
    print("loss", step, loss.item())

x = torch.randn(2, 8)
held = model(x)  # a root call whose graph is still held
twin = copy.deepcopy(model)
averaged = AveragedModel(model)
for obj in (optimizer, scheduler, scaler):
    copied = copy.deepcopy(obj)
    print("copied", type(copied).__name__, copied.state_dict().keys() == obj.state_dict().keys())
with torch.no_grad():
    expected = model(x)
    print("copies agree", torch.equal(twin(x), expected), torch.equal(averaged(x), expected))
twin(x).pow(2).mean().backward()  # the copy trains as a model of its own
print("copy trained", all(p.grad is not None for p in twin.parameters()))
torch.save(model, "model.pt")
torch.save(extra, "extra.pt")
functions = [
    torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_, torch.autograd.backward,
    torch.utils.checkpoint.checkpoint, torch.amp.GradScaler.step, torch.optim.Optimizer.__init__,
]
for name, obj in [("model", model), ("optimizer", optimizer), ("scaler", scaler),
                  ("held", held), ("extra", extra), ("params", list(model.parameters())),
                  ("functions", functions)]:
    data = pickle.dumps(obj)
    print("pickled", name, b"memtui_agent" in data, type(pickle.loads(data)).__name__)
    if name in ("scaler", "functions"):  # tensors pickle with addresses: never the same bytes
        print("bytes", name, hashlib.sha256(data).hexdigest())
with torch.no_grad():
    print("reloaded", torch.equal(pickle.loads(pickle.dumps(model))(x), expected))
scripted = torch.jit.script(model)  # compiles every hook of the tree: none of the agent's
traced = torch.jit.trace(model, x)
with torch.no_grad():
    print("scripted", torch.equal(scripted(x), expected), torch.equal(traced(x), expected))
print("script hooks", len(scripted._forward_hooks), len(scripted._forward_pre_hooks))
with open("expected.json", "w") as file:
    json.dump({"x": x.tolist(), "y": expected.tolist(), "extra": extra.tolist()}, file)
print("done")
"""

LOAD = """\
import importlib.abc, importlib.util, json, sys

class NoMemtui(importlib.abc.MetaPathFinder):
    # Whatever else the interpreter's folder holds (an installed memtui): not importable here.
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("memtui", "memtui_agent", "memtui_protocol"):
            raise ModuleNotFoundError(name)
        return None

sys.meta_path.insert(0, NoMemtui())
sys.path.append(sys.argv[1])
import torch

expected = json.load(open("expected.json"))
model = torch.load("model.pt", weights_only=False)
extra = torch.load("extra.pt", weights_only=False)
with torch.no_grad():
    y = model(torch.tensor(expected["x"]))
print(y.tolist() == expected["y"], extra.tolist() == expected["extra"])
print(sorted(name for name in sys.modules if name.startswith("memtui")))
"""

MODES = ("auto", "every", "off")
SERIALIZE_WARNING = "will not be serialized"


def _torch_folder() -> str:
    """The folder torch is imported from (its dependencies beside it)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).parent.parent)


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        command, cwd=cwd, env=scrubbed_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result


def _root_names(recording: Path) -> list[str]:
    """The names of the root modules the agent registered, in order."""
    names: list[str] = []
    for message in wire.FrameDecoder().feed(recording.read_bytes()):
        if isinstance(message, schema.Names) and message.kind == "module":
            names.extend(name for name in message.names if "." not in name)
    return names


def _jobs_own(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("memtui: ")]


def _load_without_memtui(folder: Path) -> list[str]:
    """What the loader prints in an isolated interpreter that has torch and no memtui."""
    (folder / "load.py").write_text(LOAD)
    loaded = _run([sys.executable, "-I", "-S", "load.py", _torch_folder()], folder)
    return loaded.stdout.splitlines()


def test_a_job_copies_and_pickles_what_the_agent_hooked(tmp_path: Path) -> None:
    plain_folder = tmp_path / "plain"
    plain_folder.mkdir()
    (plain_folder / "train.py").write_text(JOB)
    plain = _run([sys.executable, "train.py"], plain_folder)
    assert plain.stdout.endswith("done\n")
    assert "pickled model False Sequential" in plain.stdout
    assert SERIALIZE_WARNING not in plain.stderr
    for mode in MODES:
        folder = tmp_path / mode
        folder.mkdir()
        (folder / "train.py").write_text(JOB)
        run = [*MEMTUI, "run", "--headless", "-o", "rec.memtui", "--activations", mode]
        monitored = _run([*run, "train.py"], folder)
        assert monitored.stdout == plain.stdout, mode
        assert _jobs_own(monitored.stderr) == _jobs_own(plain.stderr), mode
        assert SERIALIZE_WARNING not in monitored.stderr
        assert b"memtui_agent" not in (folder / "model.pt").read_bytes()
        assert _load_without_memtui(folder) == ["True True", "[]"], mode
        roots = _root_names(folder / "rec.memtui")
        assert roots[0] == "Sequential", mode
        if mode != "off":  # `off` stops looking for new models after the first step
            # The copy the job called is a model of its own, not taken for the original.
            assert "Sequential#2" in roots and "AveragedModel" in roots, (mode, roots)
