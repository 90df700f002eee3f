"""Fuzzing the two byte parsers every viewer relies on: `wire.FrameDecoder` and `read_recording`.

A recording is whatever is on disk when the job stopped: torn by SIGKILL, truncated by a full
disk, bit-flipped by bad storage, or not a recording at all. A live socket can carry anything a
broken peer sends. The contract is the same for both: every frame before the damage comes out,
the only exception is `wire.WireError` (decoder) or `RecordingError` (reader), nothing hangs,
and a corrupt length claim never turns into a big allocation. `memtui report` turns all of it
into one line on stderr, never a traceback.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import struct
import subprocess
import tracemalloc
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cli_harness import MEMTUI
from hypothesis import given, settings
from hypothesis import strategies as st

from memtui.input.recording_file import RecordingError
from memtui.model.recording import Recording, apply, read_recording
from memtui.reports.report import build_report, render_text, report_of
from memtui.reports.report_format import strict_json
from memtui.terminal_text import UNSAFE
from memtui_protocol import schema, wire
from memtui_protocol.schema import ExitStatus

FUZZ = settings(max_examples=250, deadline=None, database=None)
"""Moderate example counts and no per-example deadline: a deadline is a timing assertion, and a
loaded machine took 1.29 s over one example (issue 33). A parser that hangs fails on the test's
timeout (pytest-timeout); one that crawls is a benchmark's business
(benchmarks/viewer_bounds.py)."""

MEMORY_LIMIT = 4 * 1024 * 1024
"""Peak traced allocation allowed while refusing a corrupt frame: a few MB, never the claim."""

HUGE_CLAIM = 0xFFFF_FFFF
"""The largest length a u32 prefix (or a msgpack 32-bit header) can claim: 4 GiB."""


# ----- a small, fully valid recording -------------------------------------------------------


def _piles(scale: int) -> schema.Piles:
    return schema.Piles(400 * scale, 400, 804, 96 * scale)


def _step(number: int) -> schema.Step:
    return schema.Step(
        step=number,
        t_start=float(number),
        t_end=number + 0.5,
        end=schema.Piles(400, 400, 804, 0),
        max=_piles(number),
        peak=_piles(number),
        microbatches=2,
        skipped=number == 3,
        dtypes={
            "weights": {"float32": schema.DtypeStat(400, 2)},
            "activations": {"float32": schema.DtypeStat(96 * number, 3)},
        },
        host=schema.Host(rss=10_000_000 + number),
        loss=1.0 / number,
        alerts=[schema.Alert(kind="skipped_step", message="skipped")] if number == 3 else [],
        top_activations=[schema.ModuleBytes(1, 64), schema.ModuleBytes(-1, 32)],
    )


MESSAGES: list[schema.Message] = [
    schema.Hello(
        format_version=schema.FORMAT_VERSION,
        agent_version="fuzz",
        pid=4242,
        argv=["python", "train.py", "--fuzz"],
        started="2026-01-01T00:00:00+00:00",
        started_unix=1.0,
        hostname="fuzz-host-that-is-not-this-one",
        process_create_time=1.0,
    ),
    schema.Names(kind="module", first_id=0, names=["Model", "Model.fc1", "Model.fc2"]),
    _step(1),
    _step(2),
    schema.AlertNow(
        time=2.7, step=3, alert=schema.Alert(kind="over_budget", message="forecast over budget")
    ),
    _step(3),
    schema.Tick(time=3.9, piles=_piles(1), phase="forward", step=3),
    schema.AgentError(time=4.0, component="hook:pack", message="boom"),
    _step(4),
    _step(5),
    schema.End(time=6.0, status="ok", code=0, step=5, piles=schema.Piles(400, 400, 804, 0)),
]
FRAMES = [wire.encode(message) for message in MESSAGES]
DATA = wire.preamble() + b"".join(FRAMES)
BOUNDARIES = [wire.PREAMBLE.size]
"""`BOUNDARIES[i]` is the offset where frame i starts; the last entry is the end of the data."""
for _encoded in FRAMES:
    BOUNDARIES.append(BOUNDARIES[-1] + len(_encoded))
HELLO_END = BOUNDARIES[1]


def _complete_frames(cut: int) -> int:
    """How many whole frames lie in `DATA[:cut]`."""
    return sum(1 for end in BOUNDARIES[1:] if end <= cut)


def _frame_index(byte_offset: int) -> int:
    """The frame that holds `byte_offset` (-1: the preamble)."""
    return sum(1 for start in BOUNDARIES[:-1] if start <= byte_offset) - 1


def _summary(recording: Recording) -> tuple[Any, ...]:
    """Everything a reader folds out of the frames (not the path or the warning)."""
    return (
        recording.hello,
        recording.module_names,
        recording.steps,
        recording.alerts,
        recording.last_tick,
        recording.agent_errors,
        recording.end,
    )


def _expected(frames: int) -> tuple[Any, ...]:
    """What a reader must show for a file holding the first `frames` frames of `MESSAGES`."""
    hello = MESSAGES[0]
    assert isinstance(hello, schema.Hello)
    recording = Recording(path=Path("expected"), hello=hello)
    for message in MESSAGES[1:frames]:
        apply(recording, message)
    return _summary(recording)


EXPECTED = [_expected(frames) if frames else None for frames in range(len(MESSAGES) + 1)]


# ----- helpers ---------------------------------------------------------------------------------


def _decode(
    data: bytes, cuts: Iterable[int] = ()
) -> tuple[list[schema.Message], wire.WireError | None, wire.FrameDecoder]:
    """Feed `data` in pieces split at `cuts`; only `WireError` may escape the decoder."""
    decoder = wire.FrameDecoder()
    messages: list[schema.Message] = []
    points = sorted({0, len(data), *(cut for cut in cuts if 0 < cut < len(data))})
    try:
        for start, end in itertools.pairwise(points):
            messages.extend(decoder.feed(data[start:end]))
    except wire.WireError as exc:
        assert str(exc), "a WireError must carry a sentence for the user"
        return messages, exc, decoder
    return messages, None, decoder


def _frame(payload: bytes) -> bytes:
    """A frame with a correct length and CRC around any payload."""
    return wire.FRAME_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def _read(path: Path, data: bytes) -> Recording | RecordingError:
    """Write `data` and read it back; only `RecordingError` may escape the reader."""
    path.write_bytes(data)
    try:
        return read_recording(path)
    except RecordingError as exc:
        assert str(exc) and "\n" not in str(exc), "RecordingError must be one line"
        return exc


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file path reused by every example (hypothesis runs many examples per test)."""
    return tmp_path_factory.mktemp("fuzz") / "fuzz.memtui"


def _peak_bytes(action: Callable[[], object]) -> int:
    """Peak traced Python allocation while `action` runs."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _swallow(action: Callable[[], object], *errors: type[BaseException]) -> Callable[[], None]:
    def run() -> None:
        try:
            action()
        except errors:
            pass

    return run


# ----- arbitrary bytes -------------------------------------------------------------------------

SPLITS = st.lists(st.integers(0, 5000), max_size=8)
PREFIXES = st.sampled_from([b"", wire.preamble(), wire.preamble() + FRAMES[0]])
"""Arbitrary tails after nothing, after a valid preamble, and after a valid hello: the last two
get garbage past the magic check into the frame loop and the msgpack decoder."""


@FUZZ
@given(prefix=PREFIXES, data=st.binary(max_size=4096), splits=SPLITS)
def test_decoder_on_arbitrary_bytes_raises_only_wire_error(
    prefix: bytes, data: bytes, splits: list[int]
) -> None:
    """Whatever arrives on a socket, the decoder either decodes it or raises `WireError`."""
    messages, _, _ = _decode(prefix + data, splits)
    if prefix.endswith(FRAMES[0]):
        assert messages[:1] == MESSAGES[:1]


@FUZZ
@given(prefix=PREFIXES, data=st.binary(max_size=4096))
def test_reader_on_arbitrary_bytes_raises_only_recording_error(
    scratch: Path, prefix: bytes, data: bytes
) -> None:
    """Any file is a recording or one `RecordingError`; a valid hello is never lost to junk."""
    result = _read(scratch, prefix + data)
    if prefix.endswith(FRAMES[0]):
        assert isinstance(result, Recording)
        assert result.hello == MESSAGES[0]


# ----- truncation ------------------------------------------------------------------------------


def test_decoder_on_every_truncation_yields_every_complete_frame() -> None:
    """A stream cut anywhere decodes to exactly the whole frames before the cut, no error."""
    for cut in range(len(DATA) + 1):
        messages, error, decoder = _decode(DATA[:cut])
        assert error is None, (cut, error)
        frames = _complete_frames(cut)
        assert messages == MESSAGES[:frames], cut
        assert decoder.frames == frames
        whole = BOUNDARIES[frames] if cut >= wire.PREAMBLE.size else 0
        assert decoder.pending == cut - whole, cut


def test_reader_on_every_truncation_keeps_the_prefix_and_warns(scratch: Path) -> None:
    """A recording cut at any byte (SIGKILL, full disk) still shows every frame before the cut.

    A cut inside a frame must say so (`.warning`); a cut exactly between frames is
    indistinguishable from a job that was killed there, so it carries no warning. Before the
    hello is complete there is no job to show: that is a one-line `RecordingError`.
    """
    for cut in range(len(DATA) + 1):
        result = _read(scratch, DATA[:cut])
        if cut < HELLO_END:
            assert isinstance(result, RecordingError), cut
            expected = "empty file" if cut == 0 else "truncated before its header"
            assert expected in str(result), (cut, str(result))
            continue
        assert isinstance(result, Recording), (cut, result)
        frames = _complete_frames(cut)
        assert _summary(result) == EXPECTED[frames], cut
        assert len(result.steps) == sum(isinstance(m, schema.Step) for m in MESSAGES[:frames])
        if cut in BOUNDARIES:
            assert result.warning is None, cut
        else:
            assert result.warning is not None and "partial frame" in result.warning, cut


@FUZZ
@given(cut=st.integers(0, len(DATA)), splits=SPLITS)
def test_truncation_fed_in_random_pieces_matches_whole(cut: int, splits: list[int]) -> None:
    """How the bytes are chunked (socket reads, file chunks) never changes what decodes."""
    messages, error, decoder = _decode(DATA[:cut], splits)
    assert error is None
    assert messages == MESSAGES[: _complete_frames(cut)]
    assert decoder.bytes_consumed + decoder.pending == cut


# ----- bit flips -------------------------------------------------------------------------------


def _flip(data: bytes, bits: Iterable[int]) -> bytes:
    damaged = bytearray(data)
    for bit in bits:
        damaged[bit // 8] ^= 1 << (bit % 8)
    return bytes(damaged)


def test_decoder_on_every_single_bit_flip_stops_at_the_damaged_frame() -> None:
    """CRC-32 catches every single-bit error: the frames before the flip, then `WireError`
    (or, for a length flipped upwards, a frame that never completes)."""
    flags = range(wire.PREAMBLE.size - 2, wire.PREAMBLE.size)
    for bit in range(len(DATA) * 8):
        byte = bit // 8
        messages, error, decoder = _decode(_flip(DATA, [bit]))
        if byte in flags:
            # The flags word is reserved (written as zero) and not checked by the reader.
            assert error is None and messages == MESSAGES
            continue
        frame = _frame_index(byte)
        if frame < 0:
            assert error is not None and messages == [], bit
            continue
        assert messages == MESSAGES[:frame], bit
        assert error is not None or decoder.pending > 0, bit


def _expected_without(lost: set[int]) -> tuple[Any, ...]:
    """What a reader must show when the frames with the indexes in `lost` are damaged."""
    hello = MESSAGES[0]
    assert isinstance(hello, schema.Hello)
    recording = Recording(path=Path("expected"), hello=hello)
    for index, message in enumerate(MESSAGES[1:], start=1):
        if index not in lost:
            apply(recording, message)
    return _summary(recording)


@FUZZ
@given(bit=st.integers(0, len(DATA) * 8 - 1))
def test_reader_on_a_single_bit_flip_loses_only_that_frame(scratch: Path, bit: int) -> None:
    """One flipped bit after the hello costs that frame only: the reader resynchronises on the
    next frame whose CRC matches and says how many bytes it skipped; before the hello (magic,
    version, hello) the file is refused with one line."""
    result = _read(scratch, _flip(DATA, [bit]))
    byte = bit // 8
    frame = _frame_index(byte)
    if byte in (wire.PREAMBLE.size - 2, wire.PREAMBLE.size - 1):
        assert isinstance(result, Recording) and _summary(result) == EXPECTED[len(MESSAGES)]
    elif frame < 1:
        assert isinstance(result, RecordingError)
    else:
        assert isinstance(result, Recording)
        assert _summary(result) == _expected_without({frame})
        assert result.warning is not None
        if frame < len(MESSAGES) - 1:
            skipped = BOUNDARIES[frame + 1] - BOUNDARIES[frame]
            assert f"skipped {skipped} bytes" in result.warning, result.warning


@FUZZ
@given(bits=st.lists(st.integers(0, len(DATA) * 8 - 1), min_size=1, max_size=24))
def test_reader_on_random_bit_flips_shows_only_real_frames(scratch: Path, bits: list[int]) -> None:
    """Any number of flips anywhere: a `RecordingError`, or real frames in their order (never a
    frame the job did not write), warned about unless nothing was lost."""
    result = _read(scratch, _flip(DATA, bits))
    if isinstance(result, RecordingError):
        return
    real_steps = [message for message in MESSAGES if isinstance(message, schema.Step)]
    positions = [real_steps.index(step) for step in result.steps]
    assert positions == sorted(set(positions)), "the reader showed steps the job never wrote"
    assert result.hello == MESSAGES[0]
    assert result.end in (None, MESSAGES[-1])
    assert all(error in MESSAGES for error in result.agent_errors)
    expected = EXPECTED[len(MESSAGES)]
    assert expected is not None
    assert result.module_names in ({}, expected[1])
    if result.warning is None:
        assert _summary(result) == EXPECTED[len(MESSAGES)]


# ----- magic, version, length ------------------------------------------------------------------


@FUZZ
@given(magic=st.binary(min_size=1, max_size=8).filter(lambda m: not wire.MAGIC.startswith(m)))
def test_wrong_magic_is_refused_at_once(scratch: Path, magic: bytes) -> None:
    """Not a memtui stream: refused on the first bytes that cannot be the magic."""
    data = magic + DATA[len(magic) :]
    _, error, _ = _decode(data[: len(magic)])
    assert error is not None and "wrong magic" in str(error)
    result = _read(scratch, data)
    assert isinstance(result, RecordingError) and "not a memtui recording" in str(result)


def test_every_other_format_version_is_refused() -> None:
    """Every u16 but the current version is refused before any frame is decoded."""
    for version in range(0x10000):
        if version == schema.FORMAT_VERSION:
            continue
        data = wire.preamble(version) + FRAMES[0]
        messages, error, _ = _decode(data)
        assert messages == [] and error is not None, version
        word = "newer" if version > schema.FORMAT_VERSION else "older"
        assert f"version {version} is {word}" in str(error), version


@FUZZ
@given(version=st.integers(0, 0xFFFF).filter(lambda v: v != schema.FORMAT_VERSION))
def test_reader_refuses_other_versions_in_one_line(scratch: Path, version: int) -> None:
    """A recording from a newer or older memtui is one clear sentence, not garbage."""
    result = _read(scratch, wire.preamble(version) + b"".join(FRAMES))
    assert isinstance(result, RecordingError) and f"version {version}" in str(result)


@FUZZ
@given(
    length=st.integers(wire.MAX_FRAME_BYTES + 1, HUGE_CLAIM),
    crc=st.integers(0, 0xFFFF_FFFF),
    after=st.integers(1, len(MESSAGES) - 1),
)
def test_impossible_length_claims_are_refused(
    scratch: Path, length: int, crc: int, after: int
) -> None:
    """A length prefix over the cap is corruption: refused at once, nothing waits for it."""
    head = DATA[: BOUNDARIES[after]]
    data = head + wire.FRAME_HEADER.pack(length, crc) + b"\x00" * 16
    messages, error, _ = _decode(data)
    assert messages == MESSAGES[:after]
    assert error is not None and "impossible" in str(error)
    result = _read(scratch, data)
    assert isinstance(result, Recording) and _summary(result) == EXPECTED[after]
    assert result.warning is not None and "impossible" in result.warning


@FUZZ
@given(length=st.integers(1, wire.MAX_FRAME_BYTES), short=st.integers(0, 64))
def test_plausible_length_with_missing_bytes_is_a_torn_tail(
    scratch: Path, length: int, short: int
) -> None:
    """A length under the cap whose bytes never came is a partial frame, not an error."""
    body = b"\x00" * min(short, length - 1)
    data = DATA + wire.FRAME_HEADER.pack(length, 0) + body
    messages, error, decoder = _decode(data)
    assert error is None and messages == MESSAGES
    assert decoder.pending == wire.FRAME_HEADER.size + len(body)
    result = _read(scratch, data)
    assert isinstance(result, Recording) and _summary(result) == EXPECTED[len(MESSAGES)]
    assert result.warning is not None and "partial frame" in result.warning


@pytest.mark.parametrize("length", [wire.MAX_FRAME_BYTES + 1, HUGE_CLAIM])
def test_a_4_gib_claim_costs_no_memory(tmp_path: Path, length: int) -> None:
    """The cap exists so a flipped length never allocates gigabytes: peak stays a few MB."""
    claim = wire.FRAME_HEADER.pack(length, 0) + b"\xff" * 64
    path = tmp_path / "claim.memtui"
    path.write_bytes(DATA[:HELLO_END] + claim)

    def feed() -> None:
        list(wire.FrameDecoder().feed(wire.preamble() + claim))

    assert _peak_bytes(_swallow(feed, wire.WireError)) < MEMORY_LIMIT
    assert _peak_bytes(lambda: read_recording(path)) < MEMORY_LIMIT
    assert "impossible" in str(read_recording(path).warning)


# ----- valid CRC around hostile msgpack --------------------------------------------------------

TAGS = ["hello", "names", "step", "tick", "agent_error", "end", "alert", "nope", ""]
FIELD_NAMES = sorted(
    {
        name
        for cls in (
            schema.Hello,
            schema.Names,
            schema.Step,
            schema.Tick,
            schema.AgentError,
            schema.End,
            schema.AlertNow,
        )
        for name in cls.__struct_fields__
    }
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=10) | st.sampled_from(FIELD_NAMES), inner, max_size=5)
    ),
    max_leaves=30,
)
TAGGED = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from(TAGS),
    st.dictionaries(st.sampled_from(FIELD_NAMES), VALUES, max_size=12),
)
HUGE_HEADERS = [
    b"\xdd",  # array 32
    b"\xdf",  # map 32
    b"\xc6",  # bin 32
    b"\xdb",  # str 32
    b"\xc9",  # ext 32
]
"""msgpack headers followed by a big-endian u32 count: the decoder must not believe them."""


def _huge(header: bytes, count: int) -> bytes:
    return header + struct.pack(">I", count)


def _mutate(payload: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, byte) edits: replace, insert or delete a byte."""
    data = bytearray(payload)
    for kind, position, value in edits:
        where = position % (len(data) + 1)
        if kind == 0 and where < len(data):
            data[where] = value
        elif kind == 1:
            data.insert(where, value)
        elif where < len(data):
            del data[where]
    return bytes(data)


EDITS = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 4096), st.integers(0, 255)), min_size=1, max_size=6
)
HOSTILE_PAYLOADS = st.one_of(
    st.binary(max_size=256),
    VALUES.map(msgspec.msgpack.encode),
    TAGGED.map(msgspec.msgpack.encode),
    st.builds(
        _mutate, st.sampled_from([frame[wire.FRAME_HEADER.size :] for frame in FRAMES]), EDITS
    ),
    st.builds(
        lambda tag, field, header, count, tail: (
            (b"\x82\xa4type" + msgspec.msgpack.encode(tag) + msgspec.msgpack.encode(field))
            + _huge(header, count)
            + tail
        ),
        st.sampled_from(TAGS),
        st.sampled_from(FIELD_NAMES),
        st.sampled_from(HUGE_HEADERS),
        st.integers(0, HUGE_CLAIM),
        st.binary(max_size=16),
    ),
    st.builds(_huge, st.sampled_from(HUGE_HEADERS), st.integers(0, HUGE_CLAIM)),
)
"""Payloads that pass the CRC, so the msgspec decoder itself gets fuzzed: raw bytes, random
msgpack, maps shaped like our tagged messages, byte-edited real payloads, and headers claiming
up to 4 Gi elements."""


@FUZZ
@given(payload=HOSTILE_PAYLOADS, splits=SPLITS)
def test_hostile_payload_with_valid_crc_is_decoded_or_refused(
    scratch: Path, payload: bytes, splits: list[int]
) -> None:
    """A frame that passes the CRC but holds junk is a `WireError`, never a crash, whatever
    msgpack it holds; the reader keeps every frame before it.
    """
    stream = DATA[:HELLO_END] + _frame(payload) + FRAMES[-1]
    messages, error, _ = _decode(stream, splits)
    assert messages[:1] == MESSAGES[:1]
    if error is None:
        assert len(messages) == 3 and isinstance(messages[1], schema.Message)
    else:
        assert len(messages) == 1
        assert str(error).startswith("corrupt frame 2")
    result = _read(scratch, stream)
    assert isinstance(result, Recording)
    assert (result.warning is None) == (error is None)


@pytest.mark.parametrize("header", HUGE_HEADERS)
@pytest.mark.parametrize("nested", [False, True])
def test_msgpack_headers_claiming_4_gib_cost_no_memory(header: bytes, nested: bool) -> None:
    """msgpack's own length headers are corruption the CRC cannot catch (the CRC is right):
    the decoder must check them against the bytes present, not allocate what they claim."""
    claim = _huge(header, HUGE_CLAIM) + b"\x00" * 8
    if nested:
        claim = b"\x82\xa4type\xa4step\xa6dtypes" + claim
    data = wire.preamble() + _frame(claim)

    def feed() -> None:
        list(wire.FrameDecoder().feed(data))

    assert _peak_bytes(_swallow(feed, wire.WireError)) < MEMORY_LIMIT
    with pytest.raises(wire.WireError, match="corrupt frame 1"):
        feed()


# ----- everything the reader accepts, the report renders -----------------------------------

SIZES = st.integers(-(2**63), 2**64 - 1)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)
PILES = st.builds(schema.Piles, SIZES, SIZES, SIZES, SIZES)
ALERTS = st.builds(
    schema.Alert,
    kind=st.sampled_from(["oom", "nonfinite_loss", "skipped_step", "x"]),
    message=st.text(max_size=30),
    where=st.none() | st.text(max_size=10),
    group=st.none() | st.integers(-5, 50),
)
LATES = st.builds(
    schema.StepLate,
    step=st.integers(-5, 12),
    loss=st.none() | FLOATS,
    scale=st.none() | FLOATS,
    alerts=st.lists(ALERTS, max_size=3),
)
"""Late device values naming any step, the ones the reader holds among them (issue 27, H1)."""
STEPS = st.builds(
    schema.Step,
    step=st.integers(-5, 2**40),
    t_start=FLOATS,
    t_end=FLOATS,
    end=PILES,
    max=PILES,
    peak=PILES,
    microbatches=st.integers(-1, 100),
    skipped=st.booleans(),
    dtypes=st.dictionaries(
        st.sampled_from([*schema.PILES, "other"]),
        st.dictionaries(st.text(max_size=8), st.builds(schema.DtypeStat, SIZES, SIZES), max_size=3),
        max_size=4,
    ),
    allocator=st.builds(schema.Allocator, allocated=st.none() | SIZES, reserved=st.none() | SIZES),
    host=st.builds(schema.Host, rss=SIZES),
    loss=st.none() | FLOATS,
    scale=st.none() | FLOATS,
    alerts=st.lists(ALERTS, max_size=3),
    top_activations=st.lists(st.builds(schema.ModuleBytes, st.integers(-3, 20), SIZES), max_size=3),
    late=st.lists(LATES, max_size=4),
    optimizer=st.none() | st.text(max_size=12),
)
OTHER_MESSAGES = st.one_of(
    STEPS,
    st.builds(
        schema.Names,
        kind=st.text(max_size=8),
        first_id=st.integers(-(2**31), 2**31),
        names=st.lists(st.text(max_size=12), max_size=4),
    ),
    st.builds(schema.Tick, time=FLOATS, piles=PILES, phase=st.text(max_size=10), step=SIZES),
    st.builds(schema.AlertNow, time=FLOATS, step=st.integers(-5, 2**40), alert=ALERTS),
    st.builds(schema.AgentError, time=FLOATS, component=st.text(max_size=10), message=st.text()),
    st.builds(
        schema.End,
        time=FLOATS,
        status=st.sampled_from(["ok", "error", "killed", "weird"]),
        code=st.none() | st.integers(-300, 300),
        error_type=st.none() | st.text(max_size=10),
        error=st.none() | st.text(max_size=20),
        step=st.none() | st.integers(-5, 2**40),
        phase=st.none() | st.text(max_size=10),
        piles=st.none() | PILES,
        alerts=st.lists(ALERTS, max_size=2),
        requested=st.none() | SIZES,
        late=st.lists(LATES, max_size=4),
    ),
)


@settings(FUZZ, max_examples=150)
@given(messages=st.lists(OTHER_MESSAGES, max_size=8))
def test_report_renders_any_recording_the_reader_accepts(
    scratch: Path, messages: list[schema.Message]
) -> None:
    """Frames with legal types but absurd values (negative sizes, NaN losses, 2**64 bytes,
    unknown statuses) must still give a report: the reader accepted them, so `report` may not
    crash on them."""
    data = DATA[:HELLO_END] + b"".join(wire.encode(message) for message in messages)
    result = _read(scratch, data)
    assert isinstance(result, Recording) and result.warning is None
    report = build_report(result)
    json.dumps(report)
    render_text(result)
    render_text(result, binary=False)
    # Recorded text (hypothesis' text holds every control and format character) reaches JSON
    # escaped, and reads back as recorded (issue 27, R1).
    document = strict_json(report_of(result))
    assert not [char for char in document if char != "\n" and UNSAFE.fullmatch(char)]
    assert json.loads(document) == json.loads(msgspec.json.encode(report_of(result)))


# ----- the CLI on damaged files --------------------------------------------------------------


class _Exploit:
    """Unpickling this runs a shell command: `report` reads snapshots (pickles) too, and must
    refuse any global beyond plain containers."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _damaged_files(folder: Path) -> dict[str, tuple[Path, set[int]]]:
    """Files `memtui report` must answer with one stderr line; each with its allowed codes."""
    files: dict[str, bytes] = {
        "empty": b"",
        "garbage": bytes(range(256)) * 8,
        "wrong-magic": b"PK\x03\x04" + DATA[4:],
        "newer-version": wire.preamble(schema.FORMAT_VERSION + 1) + b"".join(FRAMES),
        "torn-hello": DATA[: HELLO_END - 3],
        "claim-before-hello": wire.preamble() + wire.FRAME_HEADER.pack(HUGE_CLAIM, 0),
        "torn-tail": DATA[:-5],
        "flipped-step": _flip(DATA, [BOUNDARIES[3] * 8 + 77]),
        "claim-after-steps": DATA[: BOUNDARIES[4]] + wire.FRAME_HEADER.pack(HUGE_CLAIM, 0),
        "hostile-msgpack": DATA[:HELLO_END] + _frame(_huge(b"\xdf", HUGE_CLAIM)),
        "pickle-garbage": b"\x80\x04" + bytes(range(256)),
        "pickle-exploit": pickle.dumps(_Exploit(folder / "exploited"), protocol=4),
    }
    out: dict[str, tuple[Path, set[int]]] = {}
    for name, data in files.items():
        path = folder / f"{name}.memtui"
        path.write_bytes(data)
        out[name] = (
            path,
            {3} if len(data) > HELLO_END and data[:HELLO_END] == DATA[:HELLO_END] else {1},
        )
    directory = folder / "a-directory.memtui"
    directory.mkdir()
    out["directory"] = (directory, {1})
    out["missing"] = (folder / "missing.memtui", {1})
    return out


@pytest.mark.slow  # starts an interpreter
def test_report_on_damaged_files_is_one_line_never_a_traceback(tmp_path: Path) -> None:
    """The CLI's promise: a bad file is one stderr line and exit 1 (unusable) or 3 (partial)."""
    cases = _damaged_files(tmp_path)
    running = {
        name: subprocess.Popen(
            [*MEMTUI, "report", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (path, _) in cases.items()
    }
    for name, process in running.items():
        stdout, stderr = process.communicate(timeout=60)
        allowed = cases[name][1]
        assert "Traceback" not in stderr, (name, stderr)
        lines = stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("memtui: "), (name, stderr)
        assert process.returncode in allowed, (name, process.returncode, stderr)
        if process.returncode == 3:
            assert "warning" in lines[0] and "steps:" in stdout, name
    assert not (tmp_path / "exploited").exists(), "report ran code from a pickle"


# ----- a bug: the hello's pid is trusted ------------------------------------------------------


def _crafted_hello(pid: int) -> bytes:
    """A CRC-valid recording from this host whose hello holds an impossible pid."""
    hello = msgspec.structs.replace(MESSAGES[0], pid=pid, hostname=os.uname().nodename)
    return wire.preamble() + wire.encode(hello)


@pytest.mark.parametrize("pid", [2**64 - 1, 2**63, 0, -1])
def test_status_of_a_recording_with_an_impossible_pid_is_killed(tmp_path: Path, pid: int) -> None:
    """A recording's pid is data from a file: a value no process can have means 'killed'."""
    path = tmp_path / "pid.memtui"
    path.write_bytes(_crafted_hello(pid))
    assert read_recording(path).how_it_ended() is ExitStatus.KILLED


def _report_cli(path: Path) -> subprocess.CompletedProcess[str]:
    """`memtui report PATH` as a user runs it."""
    return subprocess.run(
        [*MEMTUI, "report", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow  # starts an interpreter
def test_report_on_an_impossible_pid_is_not_a_traceback(tmp_path: Path) -> None:
    """`memtui report` must never print a traceback, whatever the file holds."""
    path = tmp_path / "pid.memtui"
    path.write_bytes(_crafted_hello(2**64 - 1))
    result = _report_cli(path)
    assert "Traceback" not in result.stderr
    assert result.returncode == 0, result.stderr


# ----- a bug: strings that are not UTF-8 escape as UnicodeDecodeError -------------------------

NOT_UTF8 = {
    "tag": b"\x81\xa4type\xa1\x80",
    "field": msgspec.msgpack.encode(
        schema.AgentError(time=1.0, component="abc", message="xyz")
    ).replace(b"\xa3abc", b"\xa3a\xff\xfe"),
    "argv": wire.encode(MESSAGES[0])[wire.FRAME_HEADER.size :].replace(
        b"\xa6--fuzz", b"\xa6--\xc3\x28zz"
    ),
}
"""CRC-valid payloads holding a msgpack str that is not UTF-8: in the union tag, in a plain
field of a known message, and in the hello's argv."""


@pytest.mark.parametrize("where", sorted(NOT_UTF8))
def test_non_utf8_string_is_a_wire_error(where: str) -> None:
    """A frame with a right CRC around a non-UTF-8 string is corruption: `WireError`."""
    with pytest.raises(wire.WireError, match="corrupt frame 1"):
        list(wire.FrameDecoder().feed(wire.preamble() + _frame(NOT_UTF8[where])))


def test_reader_skips_a_frame_with_a_non_utf8_string(tmp_path: Path) -> None:
    """The reader skips the bad frame and shows what came before and after it, with a warning,
    as for any damage."""
    path = tmp_path / "utf8.memtui"
    path.write_bytes(DATA[: BOUNDARIES[3]] + _frame(NOT_UTF8["field"]) + FRAMES[-1])
    recording = read_recording(path)
    expected = EXPECTED[3]
    assert expected is not None
    assert _summary(recording)[:-1] == expected[:-1]
    assert recording.end == MESSAGES[-1]
    assert recording.warning is not None and "skipped" in recording.warning


@pytest.mark.slow  # starts an interpreter
def test_report_on_a_non_utf8_string_is_one_line(tmp_path: Path) -> None:
    """`memtui report` on such a file: partial report, one warning line, exit 3."""
    path = tmp_path / "utf8.memtui"
    path.write_bytes(DATA[:HELLO_END] + _frame(NOT_UTF8["tag"]))
    result = _report_cli(path)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert result.returncode == 3


# ----- issue 27: late floods, reused references, sparse files --------------------------------

LATE_FLOODS = st.lists(
    st.lists(
        st.tuples(st.integers(1, 70), st.integers(0, schema.MAX_LATE_ALERTS)),
        max_size=schema.MAX_LATE,
    ),
    min_size=1,
    max_size=12,
)
"""Frames of late values: (the step each names, how many alerts it carries)."""


@settings(FUZZ, max_examples=60)
@given(floods=LATE_FLOODS)
def test_late_values_fold_in_work_bounded_by_what_they_carry(
    floods: list[list[tuple[int, int]]],
) -> None:
    """However late values name steps, the fold copies a bounded multiple of the alerts the
    stream carries, and no step holds more than `MAX_ITEMS`."""
    alert = schema.Alert(kind="nonfinite_loss", message="late")
    recording = Recording(path=Path("fuzz"), hello=MESSAGES[0])  # type: ignore[arg-type]
    given = 0
    copied = [0]
    replace = msgspec.structs.replace

    def counting(struct: Any, **changes: Any) -> Any:
        copied[0] += len(changes.get("alerts", ()))
        return replace(struct, **changes)

    msgspec.structs.replace = counting  # type: ignore[assignment]
    try:
        for number in range(1, 71):
            apply(recording, _step(number))
        for frame, flood in enumerate(floods, start=71):
            late = [schema.StepLate(step=step, alerts=[alert] * count) for step, count in flood]
            given += sum(count for _step, count in flood)
            apply(recording, msgspec.structs.replace(_step(frame), late=late))
    finally:
        msgspec.structs.replace = replace
    assert all(len(step.alerts) <= schema.MAX_ITEMS for step in recording.steps)
    assert copied[0] <= schema.MAX_LATE_BATCHES * (given + 1), (copied[0], given)


SNAPSHOT_SHAPES = st.tuples(
    st.integers(1, 400),  # blocks per segment (one block object reused)
    st.integers(1, 200),  # segments (one segment object reused)
    st.integers(0, 400),  # trace events (one event reused)
    st.integers(0, 8),  # devices sharing one trace list
    st.integers(1, 20_000),  # characters of the one reused file name
    st.sampled_from(["active_allocated", "inactive", "active_pending_free"]),
)


@settings(FUZZ, max_examples=12)  # about 1 s each: CI's 20 minutes
@given(shape=SNAPSHOT_SHAPES)
@pytest.mark.slow  # starts an interpreter
def test_snapshots_of_reused_references_read_in_memory_bounded_by_their_size(
    tmp_path_factory: pytest.TempPathFactory, shape: tuple[int, int, int, int, int, str]
) -> None:
    """Pickle memo references make a small file stand for a large tree: the summary's memory
    stays a small multiple of the file, or the file is refused in one line (issue 27, H2)."""
    from memtui.input.torch_snapshot import SnapshotError, load_snapshot

    blocks, segments, events, devices, name, state = shape
    frames = [{"filename": "f" * name + ".py", "line": 1, "name": "g"}]
    block = {"size": 4096, "state": state, "frames": frames}
    segment = {"device": 0, "total_size": 4096 * blocks, "blocks": [block] * blocks}
    event = {"action": "oom", "size": 1, "device_free": 0, "frames": frames}
    trace = [event] * events
    data = {"segments": [segment] * segments, "device_traces": [trace] * devices}
    path = tmp_path_factory.mktemp("snap") / "reused.pickle"
    path.write_bytes(pickle.dumps(data, protocol=4))

    def load() -> None:
        try:
            load_snapshot(path)
        except SnapshotError as exc:
            assert "\n" not in str(exc)

    assert _peak_bytes(load) < 8 * 2**20 + 64 * path.stat().st_size


HOLES = st.lists(
    st.tuples(st.integers(1, 2**34), st.integers(0, len(FRAMES) - 1)), min_size=1, max_size=4
)
"""(bytes of hole, then how many of the fixture's frames) after a valid hello."""


@settings(FUZZ, max_examples=40)
@given(holes=HOLES)
def test_sparse_recordings_cost_the_bytes_they_store(scratch: Path, holes: list[Any]) -> None:
    """Holes of up to 16 GiB between frames: the reader skips them unread (issue 27, H4)."""
    with open(scratch, "wb") as handle:
        handle.truncate(0)
        handle.write(DATA[:HELLO_END])
        for size, count in holes:
            handle.seek(handle.tell() + size)
            handle.write(b"".join(FRAMES[1 : 1 + count]))
    read = [0]
    pread = os.pread

    def counting(fd: int, size: int, offset: int) -> bytes:
        data = pread(fd, size, offset)
        read[0] += len(data)
        return data

    os.pread = counting
    try:
        try:
            result: Recording | RecordingError = read_recording(scratch)
        except RecordingError as exc:
            result = exc
    finally:
        os.pread = pread
    info = scratch.stat()
    stored = info.st_blocks * 512
    assert read[0] <= stored + 4096, (read[0], stored)
    if isinstance(result, Recording) and info.st_size - stored > 1 << 20:  # a real hole
        assert result.warning is not None and "holes of a sparse file" in result.warning
