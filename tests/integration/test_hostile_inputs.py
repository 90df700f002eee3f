"""Hostile inputs to the viewer side (issue 14: D8-D11, D13, D16, resynchronisation).

Each input is crafted the way the adversarial probe built it: a valid but huge frame, small
pickles that cost gigabytes or recurse, recorded text full of escape sequences and Rich markup,
a FIFO where a recording should be, a bit flip in the middle of a recording. The contract: one
line and a non-zero exit, bounded memory and time, never a traceback, never a raw control
character on the terminal.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui
from recording_files import bare_step, hello, write_recording
from rich.text import Text

from memtui.input.torch_snapshot import SnapshotError, load_snapshot
from memtui.model.recording import read_recording
from memtui.terminal_text import terminal_safe
from memtui.tui.timeline import _with_levels
from memtui_protocol import schema, wire

ESC = "\x1b]0;owned\x07\x1b[2J"
MARKUP = "[/] [enforce fail at alloc_cpu.cpp:127] [bold]"


def _memtui(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_memtui(*args, timeout=timeout)


def _one_line_error(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ----- D8: a valid but huge frame ---------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        schema.Names(
            kind="module", first_id=0, names=[f"{i % 4096:03x}" for i in range(3_500_000)]
        ),
        bare_step(1, top_activations=[schema.ModuleBytes(0, 0)] * 5_000_000),
        bare_step(1, alerts=[schema.Alert(kind="", message="")] * 900_000),
    ],
    ids=["names", "top_activations", "alerts"],
)
def test_a_valid_15_mib_frame_of_tiny_items_is_read_in_bounded_memory(
    tmp_path: Path, frame: schema.Message
) -> None:
    """Millions of one-byte items used to cost 1.5 GB per frame: msgspec now refuses a list
    longer than the schema allows before building it, and the reader skips that frame."""
    path = write_recording(tmp_path / "big.memtui", [hello(), frame, bare_step(2)])
    size = path.stat().st_size
    assert size > 10 * 2**20
    tracemalloc.start()
    try:
        recording = read_recording(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * size, peak
    assert [step.step for step in recording.steps] == [2]
    assert recording.warning is not None and "length <=" in recording.warning


def test_names_are_bounded_over_the_whole_recording(tmp_path: Path) -> None:
    """Frames of the most names each keep at most `MAX_NAMES` in all, and say so."""
    names = ["n"] * 1000
    frames: list[schema.Message] = [
        schema.Names(kind="module", first_id=k * 1000, names=names)
        for k in range(schema.MAX_NAMES // 1000 + 3)
    ]
    recording = read_recording(write_recording(tmp_path / "names.memtui", [hello(), *frames]))
    assert len(recording.module_names) == schema.MAX_NAMES
    assert recording.warning is not None and "module names beyond" in recording.warning


@pytest.mark.slow  # starts an interpreter
def test_report_on_ten_huge_frames_is_one_warning(tmp_path: Path) -> None:
    """Ten 15 MiB frames used to end in a MemoryError traceback."""
    frame = wire.encode(bare_step(1, top_activations=[schema.ModuleBytes(0, 0)] * 5_000_000))
    path = tmp_path / "ten.memtui"
    path.write_bytes(
        wire.preamble() + wire.encode(hello()) + frame * 10 + wire.encode(bare_step(2))
    )
    result = _memtui("report", str(path), "--json")
    assert result.returncode == 3 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# ----- resynchronisation after damage -----------------------------------------------------------


def test_a_bit_flip_loses_one_step_and_says_how_many_bytes(tmp_path: Path) -> None:
    messages: list[schema.Message] = [hello(), *(bare_step(n) for n in range(1, 11))]
    frames = [wire.encode(m) for m in messages]
    data = bytearray(wire.preamble() + b"".join(frames))
    third = len(wire.preamble()) + sum(len(f) for f in frames[:3])
    data[third + 20] ^= 0x10  # inside step 3's payload
    path = tmp_path / "flip.memtui"
    path.write_bytes(bytes(data))
    recording = read_recording(path)
    assert [s.step for s in recording.steps] == [1, 2, 4, 5, 6, 7, 8, 9, 10]
    assert recording.warning is not None
    assert f"skipped {len(frames[3])} bytes" in recording.warning


def test_a_flipped_length_runs_past_the_end_and_later_frames_still_show(tmp_path: Path) -> None:
    """A length flipped upwards claims more bytes than the file has: found at end of input."""
    messages: list[schema.Message] = [hello(), *(bare_step(n) for n in range(1, 6))]
    frames = [wire.encode(m) for m in messages]
    data = bytearray(wire.preamble() + b"".join(frames))
    second = len(wire.preamble()) + sum(len(f) for f in frames[:2])
    data[second + 2] ^= 0x01  # length += 65536: past the end of this small file
    path = tmp_path / "length.memtui"
    path.write_bytes(bytes(data))
    recording = read_recording(path)
    assert [s.step for s in recording.steps] == [1, 3, 4, 5]


def test_crafted_frame_starts_cost_bounded_work() -> None:
    """Data dense with plausible frame starts whose lengths run far: the decoder checks at most
    a bounded number of bytes per byte received, then gives up with a `WireError`."""
    fake = struct.pack("<II", wire.MAX_FRAME_BYTES - 64, 0) + b"\x83" + wire.TAG_KEY
    decoder = wire.FrameDecoder(resync=True)
    data = wire.preamble() + wire.encode(hello()) + b"\x00" * 8 + fake * 2_000_000
    with pytest.raises(wire.WireError, match="gave up"):
        for start in range(0, len(data), 1 << 20):
            list(decoder.feed(data[start : start + (1 << 20)]))
        list(decoder.finish())


# ----- D9, D10: hostile snapshot pickles --------------------------------------------------------

SNAPSHOTS = {
    "bytearray": b"\x80\x02c__builtin__\nbytearray\nJ\x00\x00\x00\xc0\x85R.",
    "memo index": b"\x80\x02]r" + struct.pack("<I", 400_000_000) + b".",
    "deep": b"\x80\x04}(\x8c\x08segments]\x8c\x12allocator_settings"
    + b"]" * 50_000
    + b"a" * 49_999
    + b"u.",
    "huge size": pickle.dumps(
        {"segments": [{"device": 0, "total_size": 10**400, "blocks": []}]}, protocol=4
    ),
    "reused references": pickle.dumps(
        {
            "segments": [{"total_size": 1, "blocks": [{"size": 1, "state": "inactive"}] * 3000}]
            * 3000
        },
        protocol=2,
    ),
}


def _self_referencing() -> bytes:
    settings: dict[str, Any] = {"expandable_segments": True}
    settings["self"] = settings
    return pickle.dumps({"segments": [], "allocator_settings": settings}, protocol=4)


SNAPSHOTS["self-referencing settings"] = _self_referencing()


@pytest.mark.parametrize("name", sorted(SNAPSHOTS))
def test_hostile_snapshot_is_refused_in_bounded_memory(tmp_path: Path, name: str) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(SNAPSHOTS[name])
    # The work-bound case walks two million items: tracing every allocation would take 10 s.
    traced = name != "reused references"
    if traced:
        tracemalloc.start()
    try:
        with pytest.raises(SnapshotError) as caught:
            load_snapshot(path)
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
    finally:
        tracemalloc.stop()
    assert "\n" not in str(caught.value)
    assert peak < 64 * 2**20, peak


@pytest.mark.parametrize("name", ["huge size", "self-referencing settings", "deep"])
@pytest.mark.parametrize("command", [["report"], ["report", "--json"]])
@pytest.mark.slow  # starts an interpreter
def test_report_on_a_hostile_snapshot_is_one_line(
    tmp_path: Path, name: str, command: list[str]
) -> None:
    path = tmp_path / "snap.pickle"
    path.write_bytes(SNAPSHOTS[name])
    _one_line_error(_memtui(*command[:1], str(path), *command[1:]))


# ----- D13: control characters ------------------------------------------------------------------


def test_terminal_safe_escapes_every_control_character() -> None:
    text = "".join(chr(c) for c in range(0x20)) + "\x7f\x9b\u202e ok"
    shown = terminal_safe(text)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c == "\u202e" for c in shown)
    assert shown.endswith(" ok") and "\\x1b" in shown
    assert terminal_safe("a\nb\tc", keep_newlines=True) == "a\nb\tc"


@pytest.mark.slow  # starts an interpreter
def test_report_prints_no_escape_sequence_from_a_recording(tmp_path: Path) -> None:
    alert = schema.Alert(kind=f"oom{ESC}", message=f"boom{ESC}", where=f"layer{ESC}")
    messages: list[schema.Message] = [
        hello(argv=["python", f"train{ESC}.py"]),
        schema.Names(kind="module", first_id=0, names=[f"evil{ESC}"]),
        bare_step(1, alerts=[alert], top_activations=[schema.ModuleBytes(0, 10)]),
        schema.End(time=2.0, status="error", error_type=f"E{ESC}", error=f"x{ESC}"),
    ]
    path = write_recording(tmp_path / f"name{ESC[:2]}.memtui", messages)
    for extra in ([], ["--json"]):
        result = _memtui("report", str(path), *extra)
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in result.stdout + result.stderr
        assert "\x07" not in result.stdout + result.stderr
    assert "\\x1b" in _memtui("report", str(path)).stdout


# ----- D16: not a regular file ------------------------------------------------------------------


@pytest.mark.parametrize("command", ["report", "replay", "export"])
@pytest.mark.slow  # starts an interpreter
def test_a_fifo_is_refused_at_once(tmp_path: Path, command: str) -> None:
    fifo = tmp_path / "r.memtui"
    os.mkfifo(fifo)
    extra = ["--format", "csv", "-o", str(tmp_path / "out.csv")] if command == "export" else []
    result = _memtui(command, str(fifo), *extra, timeout=30)
    _one_line_error(result)
    assert "not a regular file" in result.stderr


@pytest.mark.slow  # starts an interpreter
def test_a_fifo_in_a_session_folder_is_a_warning(tmp_path: Path) -> None:
    write_recording(tmp_path / "rank-0.memtui", [hello(), bare_step(1)])
    os.mkfifo(tmp_path / "rank-1.memtui")
    result = _memtui("report", str(tmp_path), timeout=30)
    assert result.returncode == 3 and "not a regular file" in result.stderr


# ----- D11: the TUI shows recorded text as text -------------------------------------------------


def test_negative_allocator_level_is_drawn_on_the_bottom_row() -> None:
    cells: list[tuple[str, str | None, str | None]] = [(" ", None, None)] * 6
    marked = _with_levels(cells, (-5_000, 10), 100.0, 6)
    assert marked[-1][0] != " "


def test_tui_shows_markup_and_escapes_as_plain_text(tui: Any, tmp_path: Path) -> None:
    """`[/]` in an alert, a dtype or a module name used to raise MarkupError; a CPU OOM message
    lost `[enforce fail at alloc_cpu.cpp:127]`; a negative allocator value raised IndexError."""
    from memtui.tui.app import MemtuiApp
    from memtui.tui.widgets import AlertsTable, DtypeTable

    alert = schema.Alert(kind="oom", message=f"{MARKUP}{ESC}", where="[/]")
    step = bare_step(
        1,
        dtypes={"weights": {"[/]float32": schema.DtypeStat(400, 1)}},
        alerts=[alert],
        top_activations=[schema.ModuleBytes(0, 64)],
        allocator=schema.Allocator(allocated=-10, reserved=-1),
    )
    messages: list[schema.Message] = [
        hello(argv=[f"[/]{ESC}"]),
        schema.Names(kind="module", first_id=0, names=["layers.[/]"]),
        step,
    ]

    app = MemtuiApp(tui.source(messages, live=False))

    async def body(pilot: Any) -> None:
        alerts = app.query_one(AlertsTable)
        cells = [str(cell) for cell in alerts.get_row_at(0)]
        assert any("[enforce fail at alloc_cpu.cpp:127]" in cell for cell in cells)
        assert not any("\x1b" in cell for cell in cells)
        dtypes = app.query_one(DtypeTable)
        assert any("[/]float32" in str(cell) for cell in dtypes.get_row_at(0))
        assert all(isinstance(cell, Text) for cell in dtypes.get_row_at(0))

    tui.drive(app, body)
    assert app.return_code in (None, 0)
