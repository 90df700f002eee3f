"""`memtui export`: the fixture recording as a Chrome/Perfetto trace and as CSV, value by value.

The recording is the fixture run with allocator counters added to a few steps and an early
alert, so the optional counters and every alert source are exercised.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

from memtui.commands.cli import main
from memtui.reports.export import CSV_COLUMNS, default_output
from memtui_protocol import schema

MiB = 1 << 20
GPU_STEPS = {3: (40 * MiB, 64 * MiB, 48 * MiB), 4: (41 * MiB, 64 * MiB, 50 * MiB)}
"""Steps that carry allocator counters: (allocated, reserved, peak_allocated)."""


def messages(builder: ModuleType) -> list[schema.Message]:
    result = []
    for message in builder.demo_messages():
        if isinstance(message, schema.Step) and message.step in GPU_STEPS:
            allocated, reserved, peak = GPU_STEPS[message.step]
            counters = schema.Allocator(allocated=allocated, reserved=reserved, peak_allocated=peak)
            message = msgspec.structs.replace(message, allocator=counters)
        result.append(message)
        if isinstance(message, schema.Step) and message.step == 5:
            early = schema.Alert(kind="over_budget", message="forecast over budget")
            result.append(schema.AlertNow(time=message.t_end + 0.1, step=6, alert=early))
    return result


@pytest.fixture
def recording(tmp_path: Path, builder: ModuleType) -> Path:
    path = tmp_path / "run.memtui"
    path.write_bytes(builder.encode_recording(messages(builder)))
    return path


@pytest.fixture
def steps(builder: ModuleType) -> list[schema.Step]:
    return [m for m in messages(builder) if isinstance(m, schema.Step)]


def us(builder: ModuleType, unix: float) -> float:
    started: float = builder.STARTED_UNIX
    return round((unix - started) * 1e6, 3)


def test_chrome_trace_counters_match_steps(
    recording: Path, steps: list[schema.Step], builder: ModuleType
) -> None:
    assert main(["export", str(recording), "--format", "chrome-trace"]) == 0
    out = default_output(recording, "chrome-trace")
    assert out == recording.with_name("run.trace.json")
    document = json.loads(out.read_text())
    events = document["traceEvents"]
    assert document["otherData"]["format"] == "memtui-chrome-trace"
    assert all(event["pid"] == builder.PID for event in events)

    def counters(name: str) -> list[dict[str, Any]]:
        return [e for e in events if e["ph"] == "C" and e["name"] == name]

    piles, peaks = counters("piles"), counters("peak piles")
    assert len(piles) == len(peaks) == len(steps) == 24
    for step, pile, peak in zip(steps, piles, peaks, strict=True):
        assert pile["ts"] == peak["ts"] == us(builder, step.t_end)
        assert pile["args"] == step.end.as_dict()
        assert peak["args"] == step.peak.as_dict()
    assert [e["args"]["allocated"] for e in counters("allocated")] == [40 * MiB, 41 * MiB]
    assert [e["args"]["reserved"] for e in counters("reserved")] == [64 * MiB, 64 * MiB]
    assert [e["ts"] for e in counters("allocated")] == [
        us(builder, steps[2].t_end),
        us(builder, steps[3].t_end),
    ]
    assert {e["args"]["rss"] for e in counters("rss")} == {builder.RSS}
    spans = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in spans] == [f"step {s.step}" for s in steps]
    assert spans[0]["ts"] == us(builder, steps[0].t_start) == 2_000_000.0
    assert spans[0]["dur"] == 250_000.0
    assert spans[builder.NAN_STEP - 1]["args"]["loss"] is None  # NaN is not JSON


def test_chrome_trace_instant_alerts(recording: Path, builder: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert main(["export", str(recording), "--format", "chrome-trace", "-o", str(out)]) == 0
    instants = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "i"]
    found = sorted((e["args"]["step"], e["name"]) for e in instants)
    assert found == [
        (1, "first_step_growth"),
        (6, "over_budget"),
        (builder.SKIPPED_STEP, "skipped_step"),
        (builder.NAN_STEP, "nonfinite_activation"),
        (builder.NAN_STEP, "nonfinite_loss"),
    ]
    assert all(e["s"] == "g" for e in instants)
    skipped = next(e for e in instants if e["name"] == "skipped_step")
    assert skipped["ts"] == us(builder, builder.make_step(builder.SKIPPED_STEP).t_end)


def test_csv_rows_match_steps(
    recording: Path, steps: list[schema.Step], builder: ModuleType
) -> None:
    assert main(["export", str(recording), "--format", "csv"]) == 0
    out = recording.with_name("run.csv")
    reader = csv.DictReader(io.StringIO(out.read_text()))
    assert tuple(reader.fieldnames or ()) == CSV_COLUMNS
    rows = list(reader)
    assert len(rows) == 24
    for step, row in zip(steps, rows, strict=True):
        assert int(row["step"]) == step.step
        assert float(row["t_start"]) == pytest.approx(step.t_start - builder.STARTED_UNIX)
        assert float(row["t_end"]) == pytest.approx(step.t_end - builder.STARTED_UNIX)
        assert float(row["duration_s"]) == pytest.approx(0.25)
        assert row["skipped"] == str(int(step.skipped))
        assert int(row["microbatches"]) == 2
        loss = float(row["loss"])
        assert math.isnan(loss) if step.step == builder.NAN_STEP else loss == step.loss
        for prefix, piles in (("end", step.end), ("max", step.max), ("peak", step.peak)):
            for pile, value in piles.as_dict().items():
                assert int(row[f"{prefix}_{pile}"]) == value
        assert int(row["peak_total"]) == step.peak.total
        assert int(row["rss"]) == builder.RSS
        expected = GPU_STEPS.get(step.step)
        counters = (row["allocated"], row["reserved"], row["peak_allocated"])
        assert counters == (tuple(str(v) for v in expected) if expected else ("", "", ""))


def test_stdout(recording: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(recording), "--format", "csv", "-o", "-"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == ",".join(CSV_COLUMNS)
    assert len(captured.out.splitlines()) == 25
    assert captured.err == ""
    assert not recording.with_name("run.csv").exists()


@pytest.mark.parametrize("name", ["missing.memtui", "."])
def test_bad_path_is_one_line(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(tmp_path / name), "--format", "csv"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("memtui: error: ")


def test_not_a_recording_and_unwritable_output(
    recording: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert main(["export", str(text), "--format", "chrome-trace"]) == 1
    assert "not a memtui recording" in capsys.readouterr().err
    bad_out = tmp_path / "no" / "such" / "dir.csv"
    assert main(["export", str(recording), "--format", "csv", "-o", str(bad_out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err
    assert main(["export", str(recording), "--format", "csv", "-o", str(recording)]) == 1
    assert "would overwrite the recording" in capsys.readouterr().err


def test_unknown_format_is_a_usage_error(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(recording), "--format", "xlsx"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_damaged_tail_exports_the_prefix(
    recording: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = recording.read_bytes()
    recording.write_bytes(data[:-40])
    assert main(["export", str(recording), "--format", "csv", "-o", "-"]) == 3
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 25  # the End frame was cut, every step survives
    assert "warning" in captured.err


def test_csv_names_why_a_step_is_not_known_and_what_the_job_keeps(
    tmp_path: Path, builder: ModuleType
) -> None:
    """`activations_why_at` on a step not known, `kept` on the steps whose census counted it
    (empty where the census stopped at its bound, and on every other step)."""
    changed: dict[int, dict[str, Any]] = {
        3: {"kept": schema.Kept(bytes=548_864, tensors=7)},
        5: {"activations_measured": False, "activations_from": None, "activations_why_at": 4},
        7: {"kept": schema.Kept(bytes=None, tensors=9)},
    }
    written = [
        msgspec.structs.replace(m, **changed[m.step])
        if isinstance(m, schema.Step) and m.step in changed
        else m
        for m in messages(builder)
    ]
    path = tmp_path / "run.memtui"
    path.write_bytes(builder.encode_recording(written))
    assert main(["export", str(path), "--format", "csv"]) == 0
    rows = {
        int(row["step"]): row
        for row in csv.DictReader(io.StringIO(path.with_name("run.csv").read_text()))
    }
    assert rows[3]["kept"] == "548864" and rows[7]["kept"] == "" and rows[4]["kept"] == ""
    assert rows[5]["activations_why_at"] == "4" and rows[5]["end_activations"] == ""
    assert rows[4]["activations_why_at"] == ""
