"""Modules a job builds at every call are named once, not registered again each time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from memtui.model.recording import read_recording
from memtui_protocol import schema, wire

LOSS_IN_FORWARD = """
import sys, torch, memtui_agent
from torch import nn

class Classifier(nn.Module):
    # As Hugging Face models do: the loss module is built inside forward, at every call.
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 4)

    def forward(self, x, labels):
        return nn.CrossEntropyLoss()(self.body(x), labels)

torch.manual_seed(0)
with memtui_agent.monitor(record="rec.memtui", socket=False, activations="every"):
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(int(sys.argv[1])):
        opt.zero_grad()
        model(torch.randn(8, 16), torch.randint(0, 4, (8,))).backward()
        criterion = nn.CrossEntropyLoss()  # and one built in the loop, called at top level
        criterion(model.body(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
        opt.step()
"""


def _module_names(path: Path) -> list[str]:
    names: list[str] = []
    for message in wire.FrameDecoder().feed(path.read_bytes()):
        if isinstance(message, schema.Names) and message.kind == "module":
            names.extend(message.names)
    return names


@pytest.mark.slow
def test_a_loss_module_built_at_every_call_is_named_once(
    tmp_path: Path, shared_python: Any
) -> None:
    short = tmp_path / "short"
    long = tmp_path / "long"
    for folder, steps in ((short, "2"), (long, "12")):
        folder.mkdir()
        result = shared_python(LOSS_IN_FORWARD, steps, cwd=folder)
        assert result.returncode == 0, result.stderr
    names = _module_names(long / "rec.memtui")
    assert names == _module_names(short / "rec.memtui")
    assert names.count("CrossEntropyLoss") == 1
    recorded = read_recording(long / "rec.memtui").steps
    assert len(recorded) == 12 and all(step.activations_measured for step in recorded)


def test_two_roots_of_one_class_get_names_of_their_own() -> None:
    """A GAN's pair, a teacher and its student, an EMA copy: the second tree of a class is
    named under `Class#2.`, its parameters too, so no row or alert is ambiguous."""
    from torch import nn

    from memtui_agent.job.modules import ModuleRegistry

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

    published: list[schema.Names] = []
    registry = ModuleRegistry(published.append)
    first, second = Net(), Net()
    ids = [registry.lookup(module) for module in (first, first.fc, second, second.fc)]
    assert [registry.name(i) for i in ids] == ["Net", "fc", "Net#2", "Net#2.fc"]
    assert registry.param_names[id(second.fc.weight)] == "Net#2.fc.weight"
    assert registry.param_names[id(first.fc.weight)] == "fc.weight"
    assert [n for names in published for n in names.names] == ["Net", "fc", "Net#2", "Net#2.fc"]
