"""The framing shared by recordings and sockets: round trips and every way bytes can be wrong."""

from __future__ import annotations

import struct

import pytest

from memtui_protocol import schema, wire


def _hello() -> schema.Hello:
    return schema.Hello(
        format_version=schema.FORMAT_VERSION,
        agent_version="test",
        pid=123,
        argv=["python", "train.py"],
        started="2026-01-01T00:00:00+00:00",
        started_unix=1.0,
    )


def _step(number: int) -> schema.Step:
    piles = schema.Piles(400, 400, 804, 0)
    return schema.Step(
        step=number,
        t_start=0.0,
        t_end=1.0,
        end=piles,
        max=piles,
        peak=piles,
        dtypes={"weights": {"float32": schema.DtypeStat(400, 1)}},
        alerts=[schema.Alert(kind="first_step_growth", message="grew")],
    )


def _stream(*messages: schema.Message) -> bytes:
    return wire.preamble() + b"".join(wire.encode(message) for message in messages)


def test_round_trip_every_message_type() -> None:
    messages: list[schema.Message] = [
        _hello(),
        schema.Names(kind="module", first_id=0, names=["Model", "fc"]),
        _step(1),
        schema.Tick(time=2.0, piles=schema.Piles(1, 2, 3, 4), phase="forward", step=1),
        schema.AgentError(time=3.0, component="hook:pack", message="boom"),
        schema.End(time=4.0, status="ok", code=0),
    ]
    decoded = list(wire.FrameDecoder().feed(_stream(*messages)))
    assert decoded == messages


def test_byte_at_a_time_feeding_gives_the_same_messages() -> None:
    data = _stream(_hello(), _step(1), _step(2))
    decoder = wire.FrameDecoder()
    out: list[schema.Message] = []
    for index in range(len(data)):
        out.extend(decoder.feed(data[index : index + 1]))
    assert [type(message).__name__ for message in out] == ["Hello", "Step", "Step"]
    assert decoder.pending == 0


def test_wrong_magic_is_refused_early() -> None:
    with pytest.raises(wire.WireError, match="not a memtui recording"):
        list(wire.FrameDecoder().feed(b"PK\x03\x04"))


@pytest.mark.parametrize(("version", "word"), [(schema.FORMAT_VERSION + 1, "newer"), (0, "older")])
def test_other_versions_are_refused_with_one_sentence(version: int, word: str) -> None:
    data = wire.preamble(version) + wire.encode(_hello())
    with pytest.raises(wire.WireError, match=word):
        list(wire.FrameDecoder().feed(data))


def test_bit_flip_in_payload_is_detected_by_crc() -> None:
    data = bytearray(_stream(_hello(), _step(1)))
    data[-5] ^= 0x40
    decoder = wire.FrameDecoder()
    got = []
    with pytest.raises(wire.WireError, match="checksum"):
        for message in decoder.feed(bytes(data)):
            got.append(message)
    assert len(got) == 1  # the hello before the damage survives


def test_length_claiming_gigabytes_is_refused_without_allocating() -> None:
    data = wire.preamble() + struct.pack("<II", 3 * 1024**3, 0) + b"x" * 10
    with pytest.raises(wire.WireError, match="impossible"):
        list(wire.FrameDecoder().feed(data))


def test_torn_tail_is_left_pending() -> None:
    full = _stream(_hello(), _step(1))
    decoder = wire.FrameDecoder()
    messages = list(decoder.feed(full[:-7]))
    assert len(messages) == 1
    assert decoder.pending > 0


def test_valid_msgpack_of_an_unknown_message_is_refused() -> None:
    import zlib

    import msgspec

    payload = msgspec.msgpack.encode({"type": "mystery"})
    frame = struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    with pytest.raises(wire.WireError, match="corrupt frame 1"):
        list(wire.FrameDecoder().feed(wire.preamble() + frame))


def test_piles_total_and_dict() -> None:
    piles = schema.Piles(1, 2, 3, 4)
    assert piles.total == 10
    assert piles.as_dict() == {
        "weights": 1,
        "gradients": 2,
        "optimizer_state": 3,
        "activations": 4,
    }
