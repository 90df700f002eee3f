"""PyTorch memory snapshots read without torch: numbers, formats, refusals, report and replay.

The snapshots are built here as plain dicts in the shapes `torch/cuda/_memory_viz.py` reads
(the dict with `segments` and `device_traces`, and the older bare list of segments whose blocks
keep their frames under `history`), pickled with the standard library like `_dump_snapshot` does.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from repo_paths import FIXTURES

from memtui.commands.cli import main
from memtui.input.sources import ReplaySource, SnapshotSource, SourceError, replay_source
from memtui.input.torch_snapshot import SnapshotError, load_snapshot, snapshot_messages
from memtui.model.session import Session
from memtui.reports.snapshot_report import build_snapshot_report, render_snapshot_text
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind

MiB = 1 << 20
TRAIN_FRAMES: list[dict[str, Any]] = [
    {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"},
    {"filename": "/home/u/model.py", "line": 42, "name": "forward"},
    {"filename": "/home/u/train.py", "line": 7, "name": "<module>"},
]


def block(
    size: int,
    state: str,
    address: int,
    requested: int | None = None,
    frames: Iterable[dict[str, Any]] = (),
) -> dict[str, Any]:
    return {
        "size": size,
        "requested_size": size if requested is None else requested,
        "address": address,
        "state": state,
        "frames": list(frames),
    }


def segment(
    device: int, address: int, blocks: list[dict[str, Any]], **sizes: int
) -> dict[str, Any]:
    total = sum(b["size"] for b in blocks)
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    active = sum(b["size"] for b in blocks if b["state"] != "inactive")
    return {
        "device": device,
        "address": address,
        "total_size": sizes.get("total_size", total),
        "allocated_size": sizes.get("allocated_size", allocated),
        "active_size": sizes.get("active_size", active),
        "requested_size": sum(b["requested_size"] for b in blocks if b["state"] != "inactive"),
        "stream": 0,
        "segment_type": "large" if total >= MiB else "small",
        "blocks": blocks,
    }


def new_format() -> dict[str, Any]:
    """Device 0: two segments, 40 MiB reserved, 26 MiB allocated, 2 MiB pending free, 12 MiB
    in free blocks (largest 8 MiB). Device 1: one small segment and an OOM in its trace."""
    base = 0x7F00_0000_0000
    seg_a = segment(
        0,
        base,
        [
            block(20 * MiB, "active_allocated", base, 20 * MiB - 100, TRAIN_FRAMES),
            block(8 * MiB, "inactive", base + 20 * MiB),
            block(2 * MiB, "active_pending_free", base + 28 * MiB),
        ],
    )
    seg_b = segment(
        0,
        base + 64 * MiB,
        [
            block(6 * MiB, "active_allocated", base + 64 * MiB),
            block(4 * MiB, "inactive", base + 70 * MiB),
        ],
    )
    seg_c = segment(1, 0x10_0000, [block(512, "active_allocated", 0x10_0000, 500)])
    event = {"addr": base, "size": 20 * MiB, "stream": 0, "frames": TRAIN_FRAMES}
    trace0 = [
        dict(event, action="segment_alloc", size=30 * MiB),
        dict(event, action="alloc"),
        dict(event, action="alloc", addr=base + 28 * MiB, size=2 * MiB),
        dict(event, action="free_requested", addr=base + 28 * MiB, size=2 * MiB),
        dict(event, action="snapshot"),
    ]
    oom = {"action": "oom", "addr": 0, "size": 80 * 1024 * MiB, "stream": 0, "device_free": MiB}
    trace1 = [
        dict(oom, frames=TRAIN_FRAMES[1:]),
        {"action": "free_completed", "addr": 1, "size": 2},
    ]
    return {
        "segments": [seg_a, seg_b, seg_c],
        "device_traces": [trace0, trace1],
        "allocator_settings": {"expandable_segments": False, "max_split_size": -1},
    }


def old_format() -> list[dict[str, Any]]:
    """torch 1.x: a bare list; blocks carry `history` and no address; no allocated_size."""
    frames = [{"filename": "/old/train.py", "line": 3, "name": "main"}]
    blocks = [
        {"size": 3 * MiB, "state": "active_allocated", "history": [
            {"addr": 1, "real_size": 3 * MiB - 1, "frames": frames}]},
        {"size": MiB, "state": "inactive"},
    ]  # fmt: skip
    return [{"device": 0, "address": 4096, "total_size": 4 * MiB, "stream": 0, "blocks": blocks}]


def write(path: Path, data: Any, protocol: int = pickle.DEFAULT_PROTOCOL) -> Path:
    path.write_bytes(pickle.dumps(data, protocol=protocol))
    return path


@pytest.fixture
def snap(tmp_path: Path) -> Path:
    # A recording's extension on purpose: the format is detected from the bytes.
    return write(tmp_path / "snapshot.memtui", new_format())


def test_new_format_numbers(snap: Path) -> None:
    summary = load_snapshot(snap)
    assert summary.layout == "dict"
    assert summary.allocator_settings == {"expandable_segments": False, "max_split_size": -1}
    zero, one = summary.devices
    assert (zero.device, zero.segments, zero.blocks) == (0, 2, 5)
    assert zero.reserved == 40 * MiB
    assert zero.allocated == 26 * MiB
    assert zero.active == 28 * MiB
    assert zero.inactive == 12 * MiB
    assert zero.fragmentation == pytest.approx(0.3)
    assert zero.largest_free_block == 8 * MiB
    assert [a.size for a in zero.top_allocations] == [20 * MiB, 6 * MiB]
    top = zero.top_allocations[0]
    assert top.frame == "/home/u/model.py:42 forward"
    assert (top.requested_size, top.address) == (20 * MiB - 100, 0x7F00_0000_0000)
    assert zero.top_allocations[1].frame is None
    assert zero.trace_actions == {
        "segment_alloc": 1,
        "alloc": 2,
        "free_requested": 1,
        "snapshot": 1,
    }
    assert zero.ooms == ()
    assert (one.reserved, one.allocated, one.inactive, one.largest_free_block) == (512, 512, 0, 0)
    assert one.trace_actions == {"oom": 1, "free_completed": 1}
    (oom,) = one.ooms
    assert (oom.size, oom.device_free, oom.frame) == (
        80 * 1024 * MiB,
        MiB,
        TRAIN_FRAMES[1]["filename"] + ":42 forward",
    )


def test_old_list_format(tmp_path: Path) -> None:
    summary = load_snapshot(write(tmp_path / "old.pickle", old_format(), protocol=2))
    assert summary.layout == "segment list"
    (device,) = summary.devices
    assert (device.reserved, device.allocated, device.active) == (4 * MiB, 3 * MiB, 3 * MiB)
    assert (device.inactive, device.largest_free_block, device.blocks) == (MiB, MiB, 2)
    (top,) = device.top_allocations
    assert (top.size, top.requested_size, top.address) == (3 * MiB, 3 * MiB - 1, 4096)
    assert top.frame == "/old/train.py:3 main"
    assert device.trace_actions == {}


def test_empty_snapshot_still_has_device_zero(tmp_path: Path) -> None:
    summary = load_snapshot(write(tmp_path / "e.pickle", {"segments": [], "device_traces": [[]]}))
    (device,) = summary.devices
    assert (device.device, device.reserved, device.segments) == (0, 0, 0)


class NotPlainData:
    """Any class: its global reference alone must be refused."""


class RunsCode:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


@pytest.mark.parametrize(
    "payload",
    [NotPlainData(), {"segments": [NotPlainData()]}, RunsCode()],
    ids=["class", "nested class", "reduce os.system"],
)
def test_non_builtin_global_is_refused(
    tmp_path: Path, payload: Any, capsys: pytest.CaptureFixture[str], monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path / "evil.pickle", payload)
    with pytest.raises(SnapshotError, match="not a PyTorch memory snapshot"):
        load_snapshot(path)
    assert main(["report", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a PyTorch memory snapshot" in err
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "data",
    [{"nothing": 1}, [1, 2], {"segments": [{"blocks": []}]}, {"segments": [], "device_traces": 3}],
)
def test_plain_data_that_is_not_a_snapshot(tmp_path: Path, data: Any) -> None:
    with pytest.raises(SnapshotError, match=r"^.*: not a PyTorch memory snapshot \(.*\)$"):
        load_snapshot(write(tmp_path / "x.pickle", data))


def test_damaged_pickle_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cut.pickle"
    path.write_bytes(pickle.dumps(new_format())[:200])
    assert main(["report", str(path), "--json"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "damaged pickle" in err


def test_report_json(snap: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(snap), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document == build_snapshot_report(load_snapshot(snap))
    assert (document["format"], document["version"]) == ("memtui-snapshot-report", 1)
    zero, one = document["devices"]
    assert zero["device"] == "cuda:0"
    assert (zero["reserved"], zero["allocated"], zero["inactive"]) == (40 * MiB, 26 * MiB, 12 * MiB)
    assert zero["fragmentation"] == 0.3
    assert zero["top_allocations"][0]["frame"] == "/home/u/model.py:42 forward"
    assert one["oom_events"] == [
        {"size": 80 * 1024 * MiB, "device_free": MiB, "frame": "/home/u/model.py:42 forward"}
    ]


def test_report_text(snap: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(snap)]) == 0
    text = capsys.readouterr().out
    assert text == render_snapshot_text(load_snapshot(snap)) + "\n"
    assert "segments: 2 (5 blocks)" in text
    assert "reserved: 40.00 MiB" in text and "allocated: 26.00 MiB" in text
    assert "12.00 MiB, 30.0% of reserved; largest free block 8.00 MiB" in text
    assert "20.00 MiB  /home/u/model.py:42 forward" in text
    assert "OUT OF MEMORY: 80.00 GiB requested, 1.00 MiB free on the device" in text
    assert "oom events: 1" in text


def test_replay_source_is_chosen_by_content(snap: Path, tmp_path: Path) -> None:
    recording = tmp_path / "run.pickle"
    recording.write_bytes((FIXTURES / "demo.memtui").read_bytes())
    assert isinstance(replay_source(snap), SnapshotSource)
    assert isinstance(replay_source(recording), ReplaySource)
    assert isinstance(replay_source(tmp_path / "missing"), ReplaySource)


def test_snapshot_messages(snap: Path) -> None:
    summary = load_snapshot(snap)
    messages = snapshot_messages(summary, snap)
    hello, step1, alert1, step2, alert2, end = messages
    assert isinstance(hello, schema.Hello)
    assert hello.argv == ["torch.cuda.memory snapshot", str(snap)]
    assert hello.device == "cuda:0,1"
    for number, (step, alert, device) in enumerate(
        [(step1, alert1, summary.devices[0]), (step2, alert2, summary.devices[1])], start=1
    ):
        assert isinstance(step, schema.Step) and step.step == number
        assert step.end == step.max == step.peak == schema.Piles()
        assert (step.allocator.allocated, step.allocator.reserved) == (
            device.allocated,
            device.reserved,
        )
        assert isinstance(alert, schema.AlertNow) and alert.alert.kind == "snapshot"
    assert isinstance(alert1, schema.AlertNow) and isinstance(alert2, schema.AlertNow)
    assert "2 segments" in alert1.alert.message and "30% fragmentation" in alert1.alert.message
    assert "largest allocation 20.00 MiB at /home/u/model.py:42 forward" in alert1.alert.message
    assert "1 out-of-memory event" in alert2.alert.message
    assert isinstance(end, schema.End) and end.status == "ok"


def test_snapshot_source_feeds_the_session(snap: Path) -> None:
    source = replay_source(snap)
    source.check()
    batches: list[list[schema.Message]] = []
    assert source.run(batches.append, threading.Event()) is None
    session = Session(source_label=source.label, live=False)
    for batch in batches:
        session.ingest(batch)
    session.home()
    gap = {row.label: row for row in session.view_state().gap.rows}
    assert gap["torch allocated"].value == 26 * MiB
    assert gap["torch reserved"].value == 40 * MiB
    assert gap["torch reserved"].delta == 14 * MiB
    assert [row.kind for row in session.alerts] == [AlertKind.SNAPSHOT, AlertKind.SNAPSHOT]


def test_replay_refuses_a_foreign_pickle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "evil.pickle", NotPlainData())
    with pytest.raises(SourceError, match="not a PyTorch memory snapshot"):
        SnapshotSource(path).check()
    assert main(["replay", str(path)]) == 1
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow  # starts an interpreter
def test_snapshot_paths_never_import_torch(snap: Path) -> None:
    code = (
        "import sys, threading\n"
        "from pathlib import Path\n"
        "from memtui.commands.cli import main\n"
        "from memtui.input.sources import replay_source\n"
        f"path = Path({str(snap)!r})\n"
        "assert main(['report', str(path), '--json']) == 0\n"
        "source = replay_source(path)\n"
        "source.check()\n"
        "source.run(lambda batch: None, threading.Event())\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "assert not bad, bad\n"
        "print('clean')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("clean")


def test_replay_ui_shows_the_snapshot_in_the_gap_panel(snap: Path, tui: Any) -> None:
    from memtui.tui.app import MemtuiApp
    from memtui.tui.widgets import GapPanel

    source = SnapshotSource(snap)
    source.check()
    app = MemtuiApp(source)

    async def body(pilot: Any) -> None:
        app.session.home()
        app.refresh_view()
        await pilot.pause()
        panel = app.query_one(GapPanel)
        assert panel.view is not None
        gap = {row.label: row.value for row in panel.view.rows}
        assert (gap["torch allocated"], gap["torch reserved"]) == (26 * MiB, 40 * MiB)
        text = tui.plain(panel)
        assert "26.00 MiB" in text and "40.00 MiB" in text

    tui.drive(app, body)
