"""`memtui export --format tensorboard`, read back with TensorBoard's own event reader
(`EventAccumulator`), step for step, one run per rank; and the data loader TensorBoard's UI uses
(`plugin_event_accumulator`) sees every memtui figure as a scalar."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import cast

import pytest
from cli_harness import MEMTUI

from memtui.commands.cli import main
from memtui.model.recording import read_recording
from memtui_protocol import schema

pytest.importorskip("tensorboard", reason="TensorBoard is in the [test] extra")


def read_run(folder: Path) -> dict[str, dict[int, object]]:
    """tag -> step -> value (float for scalars, str for text), as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={TENSORS: 0})
    accumulator.Reload()
    values: dict[str, dict[int, object]] = {}
    for tag in accumulator.Tags()["tensors"]:
        for event in accumulator.Tensors(tag):
            proto = event.tensor_proto
            value = proto.string_val[0].decode() if proto.string_val else proto.float_val[0]
            values.setdefault(tag, {})[event.step] = value
    return values


def exact(values: dict[str, dict[int, object]], tag: str) -> dict[int, int]:
    """step -> the figure of `tag` to the byte, from its exact series (docs/cluster.md)."""
    hi, lo = values[f"exact/{tag}/hi_16MiB"], values[f"exact/{tag}/lo_bytes"]
    assert set(hi) == set(lo) == set(values[tag])
    parts = {step: (cast(float, hi[step]), cast(float, lo[step])) for step in hi}
    assert all(part.is_integer() for pair in parts.values() for part in pair)
    return {step: int(high) * 16_777_216 + int(low) for step, (high, low) in parts.items()}


def test_every_step_reads_back_exactly(
    tmp_path: Path, builder: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "demo.memtui"
    path.write_bytes(builder.encode_recording(builder.demo_messages()))
    recording = read_recording(path)
    assert main(["export", str(path), "--format", "tensorboard", "-o", str(tmp_path / "tb")]) == 0
    assert "tensorboard --logdir" in capsys.readouterr().err
    [run] = list((tmp_path / "tb").iterdir())
    assert run.name == "demo"  # a recording without a rank: named after its file
    values = read_run(run)
    steps = [step.step for step in recording.steps]
    for step in recording.steps:
        for stat, piles in (("end", step.end), ("max", step.max), ("peak", step.peak)):
            for pile in schema.PILES:
                assert exact(values, f"piles/{stat}/{pile}")[step.step] == getattr(piles, pile)
                # The curve: a float32, equal here as the demo's figures are all below 2^24
                # or multiples of a float32's step (tests/integration/test_tensorboard_served.py
                # has figures that are not).
                assert values[f"piles/{stat}/{pile}"][step.step] == getattr(piles, pile)
        assert exact(values, "piles/peak_total")[step.step] == step.peak.total
        assert exact(values, "host/rss")[step.step] == step.host.rss
    assert sorted(values["piles/end/weights"]) == steps
    assert not any(tag.startswith("allocator/") for tag in values)  # a CPU job has none
    kinds = {item.kind for item in recording.alerts}
    for kind in kinds:  # each kind's count where its curve bends; constant between points
        points = values[f"alerts/{kind}"]
        assert {steps[0], steps[-1]} <= set(points)
        for number in steps:
            held = points[max(point for point in points if point <= number)]
            raised = sum(
                1 for item in recording.alerts if item.kind == kind and item.step == number
            )
            assert held == raised, (kind, number)
    texts = values["alerts"]
    assert all(isinstance(text, str) and text.startswith("- **") for text in texts.values())
    assert set(texts) == {item.step for item in recording.alerts}
    # The loader TensorBoard's scalars dashboard uses files these under its plugin.
    from tensorboard.backend.event_processing import plugin_event_accumulator

    loader = plugin_event_accumulator.EventAccumulator(str(run))
    loader.Reload()
    assert "piles/peak/activations" in loader.PluginTagToContent("scalars")
    assert "alerts" in loader.PluginTagToContent("text")
    # A second export into the same folder would show every step twice: refused in one line.
    assert main(["export", str(path), "--format", "tensorboard", "-o", str(tmp_path / "tb")]) == 1
    assert "already holds TensorBoard event files" in capsys.readouterr().err


def test_a_session_folder_is_one_run_per_rank(tmp_path: Path, builder: ModuleType) -> None:
    session = tmp_path / "session"
    session.mkdir()
    for rank in (0, 1):
        messages = builder.demo_messages()
        messages[0] = _with_rank(messages[0], rank)
        (session / f"rank-{rank}.memtui").write_bytes(builder.encode_recording(messages))
    assert main(["export", str(session), "--format", "tensorboard"]) == 0
    out = tmp_path / "session.tensorboard"  # the default: beside the folder
    assert sorted(path.name for path in out.iterdir()) == ["rank-0", "rank-1"]
    for run in ("rank-0", "rank-1"):
        assert len(read_run(out / run)["piles/end/weights"]) == builder.STEPS


def _with_rank(hello: schema.Message, rank: int) -> schema.Message:
    import msgspec

    assert isinstance(hello, schema.Hello)
    return msgspec.structs.replace(hello, rank=rank)


@pytest.mark.slow  # starts an interpreter
def test_help_says_where_it_writes() -> None:
    result = subprocess.run(
        [*MEMTUI, "export", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    text = " ".join(result.stdout.split())
    assert "tensorboard writes TensorBoard event files into the folder -o DIR" in text
    assert "RECORDING.tensorboard" in text and "DIR/rank-N" in text


@pytest.mark.slow  # starts an interpreter
def test_without_tensorboard_it_is_one_line(tmp_path: Path, builder: ModuleType) -> None:
    path = tmp_path / "demo.memtui"
    path.write_bytes(builder.encode_recording(builder.demo_messages()))
    code = (
        "import sys\n"
        "sys.modules['tensorboard'] = None\n"
        "from memtui.commands.cli import main\n"
        f"raise SystemExit(main(['export', {str(path)!r}, '--format', 'tensorboard']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0 and result.stderr.count("\n") == 1
    assert "pip install 'memtui[tensorboard]'" in result.stderr
