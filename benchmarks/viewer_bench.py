"""Viewer-side costs: Session ingest throughput, and `memtui replay` open and seek times.

The messages are synthetic, built with `schema.Step` the way `tests/fixtures/make_fixture.py`
builds its fixture, but shaped like a GPU job's steps (allocator counters filled in, ten top
activation modules, an alert now and then), because those are the largest frames a viewer meets.
Nothing here imports torch: the viewer never does.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from memtui.input.sources import ReplaySource
from memtui.model.session import Session
from memtui_protocol import schema, wire

STARTED_UNIX = 1_795_942_800.0
MODULES = 40
GIB = 1 << 30


def synthetic_step(number: int) -> schema.Step:
    """Step `number` of a steady GPU-like run; every 500th step carries an alert."""
    jitter = 1.0 + 0.1 * ((number * 7919) % 13) / 13
    activations = int(3 * GIB * jitter) // 4096 * 4096
    weights, gradients, state = 2 * GIB, 2 * GIB, 4 * GIB
    t_start = STARTED_UNIX + 0.25 * number
    alerts = []
    if number % 500 == 0:
        alerts.append(schema.Alert(kind="nonfinite_loss", message="the loss is nan at this step"))
    return schema.Step(
        step=number,
        t_start=t_start,
        t_end=t_start + 0.25,
        end=schema.Piles(weights, gradients, state, 0),
        max=schema.Piles(weights, gradients, state, activations),
        peak=schema.Piles(weights, 0, state, activations),
        microbatches=2,
        dtypes={
            "weights": {"bfloat16": schema.DtypeStat(weights, 291)},
            "gradients": {"bfloat16": schema.DtypeStat(gradients, 291)},
            "optimizer_state": {"float32": schema.DtypeStat(state, 873)},
            "activations": {
                "bfloat16": schema.DtypeStat(activations - 65_536, 480),
                "int64": schema.DtypeStat(65_536, 2),
            },
        },
        allocator=schema.Allocator(
            allocated=weights + gradients + state,
            reserved=12 * GIB,
            peak_allocated=weights + state + activations,
            process_gpu=13 * GIB,
            device_used=14 * GIB,
            device_total=80 * GIB,
            active=weights + gradients + state,
            peak_reserved=12 * GIB,
            inactive_split=37_748_736,
            peak_exact=True,
            allocations=4_210 + number % 17,
            frees=4_210 + number % 17,
        ),
        host=schema.Host(rss=6 * GIB, system_total=512 * GIB, system_used=96 * GIB),
        loss=round(4.6 * 0.9999**number, 4),
        alerts=alerts,
        top_activations=[
            schema.ModuleBytes(module, activations // (12 + module)) for module in range(10)
        ],
    )


def hello() -> schema.Hello:
    """The synthetic job's hello."""
    return schema.Hello(
        format_version=schema.FORMAT_VERSION,
        agent_version="0.1.0",
        pid=4242,
        argv=["python", "train.py"],
        started="2026-11-29T09:00:00+00:00",
        started_unix=STARTED_UNIX,
        torch="2.13.0",
        device="cuda:0 (synthetic)",
    )


def names() -> schema.Names:
    """Module names for the ids the synthetic steps reference."""
    return schema.Names(
        kind="module", first_id=0, names=[f"model.layers.{i}" for i in range(MODULES)]
    )


@dataclass(frozen=True)
class IngestResult:
    """Frames per second into a Session, for already-decoded messages and from raw bytes."""

    frames: int
    ingest_per_s: float
    decode_ingest_per_s: float


def ingest_throughput(frames: int, repeats: int, batch: int = 256) -> IngestResult:
    """Median over `repeats` fresh Sessions of the rate at which `frames` Steps are folded in.

    Batches of `batch` messages mimic the app, which drains its inbox once per tick. The second
    rate adds the wire decoding a live socket or a replay pays before ingest.
    """
    steps: list[schema.Message] = [synthetic_step(n) for n in range(1, frames + 1)]
    batches = [steps[i : i + batch] for i in range(0, len(steps), batch)]
    data = wire.preamble() + b"".join(wire.encode(step) for step in steps)
    chunk = 1 << 16
    ingest, decode = [], []
    for _ in range(repeats):
        session = Session(live=True)
        session.ingest([hello(), names()])  # a Session folds nothing before the job's hello
        started = time.perf_counter()
        for messages in batches:
            session.ingest(messages)
        ingest.append(frames / (time.perf_counter() - started))
        session = Session(live=True)
        session.ingest([hello(), names()])
        decoder = wire.FrameDecoder()
        started = time.perf_counter()
        for offset in range(0, len(data), chunk):
            session.ingest(list(decoder.feed(data[offset : offset + chunk])))
        decode.append(frames / (time.perf_counter() - started))
    return IngestResult(frames, statistics.median(ingest), statistics.median(decode))


def write_recording(path: Path, steps: int) -> int:
    """Write a finished synthetic recording of `steps` steps; returns its size in bytes."""
    with open(path, "wb") as handle:
        handle.write(wire.preamble())
        handle.write(wire.encode(hello()))
        handle.write(wire.encode(names()))
        for number in range(1, steps + 1):
            handle.write(wire.encode(synthetic_step(number)))
        last = synthetic_step(steps)
        end = schema.End(time=last.t_end + 0.1, status="ok", code=0, step=steps, piles=last.end)
        handle.write(wire.encode(end))
    return path.stat().st_size


@dataclass(frozen=True)
class ReplayResult:
    """`memtui replay` on one recording: open (check + read into a Session) and seek times."""

    steps: int
    file_bytes: int
    check_s: float
    read_s: float
    seek_median_ms: float
    seek_max_ms: float

    @property
    def open_s(self) -> float:
        """What the user waits for before the last step is on screen."""
        return self.check_s + self.read_s


def replay_open_and_seek(path: Path, steps: int, seeks: int) -> ReplayResult:
    """Open `path` as `memtui replay` does, then seek to `seeks` random steps.

    Open is `ReplaySource.check()` (which validates the whole file) plus `ReplaySource.run()`
    feeding one Session, the path the app's worker takes. Seek is `jump_to_step(n)` plus the
    `view_state()` the screen renders from, for seeded random n.
    """
    file_bytes = write_recording(path, steps)
    source = ReplaySource(path)
    started = time.perf_counter()
    source.check()
    checked = time.perf_counter()
    session = Session(source_label=str(path), live=False)
    reason = source.run(session.ingest, threading.Event())
    read = time.perf_counter()
    if reason is not None or len(session.steps) != steps:
        raise RuntimeError(f"replay read {len(session.steps)} of {steps} steps ({reason})")
    session.view_state()
    chooser = random.Random(0)
    times = []
    for _ in range(seeks):
        target = chooser.randint(1, steps)
        begun = time.perf_counter()
        session.jump_to_step(target)
        session.view_state()
        times.append(time.perf_counter() - begun)
        if session.steps[session.cursor or 0].step != target:
            raise RuntimeError(f"seek to step {target} landed elsewhere")
    return ReplayResult(
        steps=steps,
        file_bytes=file_bytes,
        check_s=checked - started,
        read_s=read - checked,
        seek_median_ms=statistics.median(times) * 1000,
        seek_max_ms=max(times) * 1000,
    )
