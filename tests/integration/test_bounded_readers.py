"""Readers bounded in work and memory on hostile files (issue 27: H1, H2, H4, T1).

Each input is shaped like the adversarial round's: late values that name one step over and
over, a snapshot pickle that reuses references, a sparse recording whose apparent size is
gigabytes, snapshot fields of the wrong type. Bounds are asserted on work counts and sizes (items
copied, bytes read, objects kept), never on wall-clock time.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cli_harness import run_memtui
from recording_files import bare_step, hello, write_recording

from memtui.input import torch_snapshot
from memtui.input.torch_snapshot import SnapshotError, load_snapshot, snapshot_messages
from memtui.model.recording import read_recording
from memtui_protocol import schema, wire


def _memtui(*args: str) -> subprocess.CompletedProcess[str]:
    return run_memtui(*args, timeout=120)


# ----- H1: late values ----------------------------------------------------------------------


def _late_flood(frames: int, entries: int, alerts: int) -> list[schema.Message]:
    """Step 1, then `frames` steps whose late lists all name step 1 again."""
    alert = schema.Alert(kind="nonfinite_loss", message="x")
    late = [schema.StepLate(step=1, loss=2.0, alerts=[alert] * alerts)] * entries
    return [hello(), bare_step(1), *(bare_step(2 + k, late=late) for k in range(frames))]


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the alerts every step rebuilt by the fold holds (the fold's copying work)."""
    counted = [0]
    replace = msgspec.structs.replace

    def counting(struct: Any, **changes: Any) -> Any:
        if isinstance(struct, schema.Step) and "alerts" in changes:
            counted[0] += len(changes["alerts"])
        return replace(struct, **changes)

    monkeypatch.setattr(msgspec.structs, "replace", counting)
    return counted


def test_late_values_naming_one_step_fold_in_linear_work(tmp_path: Path, copies: list[int]) -> None:
    """5.1 MB of late lists naming one step took 116 s of CPU: every late value copied that
    step's whole alert list again. Now a step is rebuilt once per frame and takes late alerts
    from a few frames only, so the copying is a small multiple of the alerts the file holds."""
    frames, entries, per_entry = 40, 64, 4
    recording = read_recording(
        write_recording(tmp_path / "late.memtui", _late_flood(frames, entries, 4))
    )
    given = frames * entries * per_entry
    first = recording.steps[0]
    assert first.step == 1 and first.loss == 2.0
    assert len(first.alerts) == schema.MAX_LATE_BATCHES * entries * per_entry
    assert len(recording.alerts) == len(first.alerts)  # the ones kept, as the step holds them
    assert copies[0] <= 4 * given, copies[0]  # it was about given**2 / (2 * per_entry)


def test_a_step_keeps_at_most_max_items_alerts_however_many_arrive_late() -> None:
    alert = schema.Alert(kind="x", message="")
    steps = [bare_step(1, alerts=[alert] * (schema.MAX_ITEMS - 10))]
    late = [schema.StepLate(step=1, alerts=[alert] * 64)] * 3
    added = schema.apply_late(steps, late, {})
    assert len(steps[0].alerts) == schema.MAX_ITEMS and len(added) == 10


@pytest.mark.parametrize(
    "message",
    [
        bare_step(2, late=[schema.StepLate(step=1)] * (schema.MAX_LATE + 1)),
        schema.End(time=1.0, status="ok", late=[schema.StepLate(step=1)] * (schema.MAX_LATE + 1)),
        bare_step(
            2,
            late=[
                schema.StepLate(
                    step=1, alerts=[schema.Alert("x", "")] * (schema.MAX_LATE_ALERTS + 1)
                )
            ],
        ),
    ],
    ids=["Step.late", "End.late", "StepLate.alerts"],
)
def test_late_lists_longer_than_the_schema_allows_are_refused_before_they_are_built(
    tmp_path: Path, message: schema.Message
) -> None:
    """A 40.8 MB recording of late lists cost 1.7 GB: msgspec now refuses the list by its
    declared length, and the reader skips that frame and says so."""
    path = write_recording(tmp_path / "long.memtui", [hello(), bare_step(1), message, bare_step(3)])
    recording = read_recording(path)
    assert [step.step for step in recording.steps] == [1, 3]
    assert recording.warning is not None and "length <=" in recording.warning


def test_the_agent_never_writes_more_late_values_than_readers_take() -> None:
    from memtui_agent.output.emitter import MAX_LATE as PENDING
    from memtui_agent.steps.health import MAX_DEFERRED

    assert PENDING + MAX_DEFERRED + 1 <= schema.MAX_LATE


# ----- H2, T1: snapshot pickles ---------------------------------------------------------------


def _pickle(path: Path, data: Any) -> Path:
    path.write_bytes(pickle.dumps(data, protocol=4))
    return path


def test_reused_references_in_a_snapshot_cost_bounded_memory(tmp_path: Path) -> None:
    """A 280 KB pickle whose blocks and OOM events all reuse one frame with a 200,000-character
    file name took 7.6 GB (every block's text copied the name): only what is shown is turned
    into text now, names are cut, and the OOMs kept are bounded (all are counted)."""
    name = "a" * 200_000 + ".py"
    frames = [{"filename": name, "line": 1, "name": "f"}]
    event = {"action": "oom", "size": 1, "device_free": 1, "frames": frames}
    block = {"size": 1, "state": "active_allocated", "frames": frames}
    data = {
        "segments": [{"total_size": 20_000, "blocks": [block] * 20_000, "device": 0}],
        "device_traces": [[event] * 20_000],
    }
    path = _pickle(tmp_path / "reused.pickle", data)
    assert path.stat().st_size < 300_000
    tracemalloc.start()
    try:
        summary = load_snapshot(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    (device,) = summary.devices
    assert device.oom_events == 20_000 and len(device.ooms) == torch_snapshot.MAX_OOMS
    assert len(device.top_allocations) == torch_snapshot.TOP_ALLOCATIONS
    frame = device.top_allocations[0].frame
    assert frame is not None and len(frame) < 2 * torch_snapshot.MAX_FRAME_TEXT
    assert peak < 20 * path.stat().st_size, peak  # was about 27,000 times its size


def test_the_tree_walk_keeps_one_iterator_per_level() -> None:
    """Half a million references to one small list (a 1 MB pickle): the walk used to stack
    every one of them at once (32 MB); now its memory is its depth, whatever the width."""
    inner = [1, 2]
    data = {"segments": [], "allocator_settings": {"x": [inner] * 500_000}}
    tracemalloc.start()
    try:
        torch_snapshot._check_tree(data, 10**9)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak


def _segment(**fields: Any) -> dict[str, Any]:
    block = {"size": 10, "state": "active_allocated", **fields.pop("block", {})}
    return {"device": 0, "total_size": 10, "blocks": [block], **fields}


WRONG_FIELDS = {
    "negative device": ({"segments": [_segment(device=-3)]}, "device is negative"),
    "huge device": ({"segments": [_segment(device=10**6)]}, "not a device 0-255"),
    "digits for a requested size": (
        {"segments": [_segment(block={"requested_size": "9" * 30, "frames": []})]},
        "str of 30 characters, not a size",
    ),
    "digits for allocated_size": (
        {"segments": [_segment(allocated_size="9" * 5000)]},
        "str of 5,000 characters, not a size",
    ),
    "digits for a history's real size": (
        {"segments": [_segment(block={"history": [{"real_size": "12"}]})]},
        "not a size",
    ),
    "a string for device_free": (
        {"segments": [], "device_traces": [[{"action": "oom", "size": 5, "device_free": "x"}]]},
        "device_free on device 0 is a str",
    ),
    "a list for device_free": (
        {"segments": [], "device_traces": [[{"action": "oom", "size": 5, "device_free": [1]}]]},
        "device_free on device 0 is a list",
    ),
    "a bool for a block size": ({"segments": [_segment(block={"size": True})]}, "not a size"),
    "too many devices": ({"segments": [], "device_traces": [[]] * 1000}, "at most 256"),
}


@pytest.mark.parametrize("name", sorted(WRONG_FIELDS))
@pytest.mark.slow  # starts an interpreter
def test_snapshot_fields_of_the_wrong_type_are_one_line(tmp_path: Path, name: str) -> None:
    """A negative device raised IndexError, digit strings OverflowError (or were read as
    numbers), a non-int device_free TypeError: 77 tracebacks in the adversarial round."""
    data, words = WRONG_FIELDS[name]
    path = _pickle(tmp_path / "wrong.pickle", data)
    with pytest.raises(SnapshotError) as caught:
        load_snapshot(path)
    assert words in str(caught.value) and "\n" not in str(caught.value)
    for extra in ([], ["--json"]):
        result = _memtui("report", str(path), *extra)
        assert result.returncode == 1, result
        assert "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines() == [f"memtui: error: {caught.value}"]


def test_a_snapshot_with_every_field_typed_still_reads(tmp_path: Path) -> None:
    data = {
        "segments": [_segment(address=4096, block={"address": 4096, "frames": []})],
        "device_traces": [[{"action": "oom", "size": 5, "device_free": None}, {"action": 7}]],
    }
    summary = load_snapshot(_pickle(tmp_path / "ok.pickle", data))
    (device,) = summary.devices
    assert device.oom_events == 1 and device.ooms[0].device_free is None
    assert device.trace_actions == {"oom": 1, "(no action)": 1}
    assert snapshot_messages(summary, tmp_path / "ok.pickle")


# ----- H4: sparse recordings ------------------------------------------------------------------

APPARENT = 8 << 30


def _sparse(path: Path, before: list[schema.Message], after: list[schema.Message]) -> Path:
    """`before`, then a hole of `APPARENT` bytes, then `after` (8 GiB apparent, KiB stored)."""
    head = wire.preamble() + b"".join(wire.encode(m) for m in before)
    with open(path, "wb") as handle:
        handle.write(head)
        handle.seek(len(head) + APPARENT)
        handle.write(b"".join(wire.encode(m) for m in after))
    if path.stat().st_blocks * 512 > 1 << 20:
        pytest.skip("this file system stores no holes")
    return path


@pytest.fixture
def bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the bytes every reader asks the kernel for (the readers' work)."""
    counted = [0]
    pread, read = os.pread, os.read

    def counting_pread(fd: int, size: int, offset: int) -> bytes:
        data = pread(fd, size, offset)
        counted[0] += len(data)
        return data

    def counting_read(fd: int, size: int) -> bytes:
        data = read(fd, size)
        counted[0] += len(data)
        return data

    monkeypatch.setattr(os, "pread", counting_pread)
    monkeypatch.setattr(os, "read", counting_read)
    return counted


def test_a_sparse_recording_is_read_in_the_bytes_it_stores(
    tmp_path: Path, bytes_read: list[int]
) -> None:
    """8 GiB apparent, a few KiB stored: reading it took time in its apparent size. The hole
    is skipped (SEEK_DATA) as one damaged region, and the frames after it still show."""
    path = _sparse(
        tmp_path / "sparse.memtui",
        [hello(), bare_step(1), bare_step(2)],
        [bare_step(3), bare_step(4)],
    )
    recording = read_recording(path)
    assert [step.step for step in recording.steps] == [1, 2, 3, 4]
    assert recording.warning is not None
    found = re.search(r"([\d,]+) of them in holes of a sparse file", recording.warning)
    assert found is not None and int(found.group(1).replace(",", "")) > APPARENT - 8192
    assert bytes_read[0] < 1 << 20, bytes_read[0]


def test_a_hole_cutting_a_frame_loses_that_frame_only(tmp_path: Path) -> None:
    cut = wire.encode(bare_step(3))
    head = wire.preamble() + wire.encode(hello()) + wire.encode(bare_step(1))
    path = tmp_path / "cut.memtui"
    with open(path, "wb") as handle:
        handle.write(head + cut[:20])
        handle.seek(len(head) + APPARENT)
        handle.write(wire.encode(bare_step(4)))
    recording = read_recording(path)
    assert [step.step for step in recording.steps] == [1, 4]


@pytest.mark.slow  # starts an interpreter
def test_a_sparse_file_before_its_header_is_one_line(tmp_path: Path, bytes_read: list[int]) -> None:
    path = tmp_path / "hollow.memtui"
    with open(path, "wb") as handle:
        handle.seek(APPARENT)
        handle.write(wire.preamble() + wire.encode(hello()))
    result = _memtui("report", str(path))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_sparse_snapshot_is_refused_without_reading_it(
    tmp_path: Path, bytes_read: list[int]
) -> None:
    path = tmp_path / "sparse.pickle"
    with open(path, "wb") as handle:
        handle.write(pickle.dumps({"segments": []}, protocol=4)[:-1])
        handle.seek(APPARENT // 8)  # under the size memtui reads as a snapshot
        handle.write(b".")
    with pytest.raises(SnapshotError, match="a sparse file"):
        load_snapshot(path)
    assert bytes_read[0] < 1 << 20
