"""`memtui export PATH --format tensorboard -o DIR`: every step as TensorBoard scalars, one run
per rank, so memory sits next to the job's own loss curves.

Written with TensorBoard's own record format (`tensorboard.summary.writer.record_writer`, what
`torch.utils.tensorboard` writes through) and TensorBoard's protobuf messages; nothing here
imports torch. TensorBoard's package pulls in numpy, so this command (and only it) loads numpy
in the viewer; `tensorboard` is an optional extra (`pip install 'memtui[tensorboard]'`).

Files and folders are made as every file memtui writes (`memtui_protocol.safe_open`): DIR and
each run's folder are opened relative to their parent with `O_DIRECTORY|O_NOFOLLOW` (made 0700
when missing), the event file is created relative to its run's folder with
`O_CREAT|O_EXCL|O_NOFOLLOW` (0600). A link, a FIFO or another user's folder or file at any of
those names is refused in one line; nothing is written through it. (TensorBoard's own
`EventFileWriter` makes its folders and opens its file by path, following any link.)

Scalars are rank-0 `DT_FLOAT` tensors under the `scalars` plugin, what `tf.summary.scalar`
writes: the one tensor form TensorBoard's default loader (its Rust data server) reads as a
scalar. It drops any other dtype as data loss, so the 64-bit tensors written before showed no
curve at all unless TensorBoard ran with `--load_fast=false`; and it keeps every scalar as a
float32 anyway. A float32 holds integers exactly only up to 2^24, so a byte figure above 16 MiB
is rounded on its curve (by at most 1 part in 2^24). Each integer figure (bytes, allocator
counters) is therefore also written exactly, split in two series whose values are integers
below 2^24: `exact/<tag>/hi_16MiB` and `exact/<tag>/lo_bytes`, the figure being
`hi_16MiB x 16,777,216 + lo_bytes` (`exact_parts`; exact for any figure below 2^48 bytes,
256 TiB; a larger one has no exact point). Per step (`step` = the recording's step, wall time
= its close):

- `piles/{end,max,peak}/<pile>` and `piles/peak_total`;
- `allocator/<counter>` and `host/rss`, where the job has them (a CPU job has no allocator);
- `workers/uss` and `workers/growth` (and `workers/pss` where known): the DataLoader workers, on
  a job that has them;
- `step/duration_seconds`, `step/loss` (when finite), `step/grad_norm` (when known);
- `alerts/<kind>`: how many alerts of that kind the step raised, and the text summary `alerts`
  with each alert's line.

An alert kind's count is written where its curve bends, not at every step (`count_points`): at
the first and last step, and at every step that raised it or is next to one that did. Between
two points the count is constant, so TensorBoard draws exactly the curve of a value per step,
and the work is linear in steps plus alerts: a value per kind per step was steps x kinds, and a
recording that raised a new kind (a newer agent's) at each of 3,000 steps made 9 million values.

A session folder gives one run per recording (`DIR/rank-0`, `DIR/rank-1`, `DIR/proc-0`); a
single recording one run named after its rank (`DIR/rank-N`) or its file.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from memtui.errors import UserError
from memtui.exit_codes import EXIT_PARTIAL
from memtui.model.recording import Recording, read_recording
from memtui.model.step_rows import known_total, pile_figure
from memtui.reports.report import ALLOCATOR_KEYS
from memtui.terminal_text import terminal_safe
from memtui_protocol.safe_open import (
    FOLDER_FLAGS,
    RefusedPath,
    create_in,
    open_or_make_folder,
    open_or_make_folder_in,
)
from memtui_protocol.schema import Pile, Step

MISSING = (
    "memtui export --format tensorboard needs TensorBoard's event writer: "
    "pip install 'memtui[tensorboard]'"
)
EVENT_PREFIX = "events.out.tfevents."


def step_scalars(step: Step) -> dict[str, float]:
    """The scalars of one step, by tag (counters the job does not have are absent, and so are
    the figures the step does not know: no point, never a 0 or a partial one)."""
    scalars: dict[str, float] = {}
    for stat, piles in (("end", step.end), ("max", step.max), ("peak", step.peak)):
        for pile in Pile:
            value = pile_figure(step, piles, pile)
            if value is not None:
                scalars[f"piles/{stat}/{pile}"] = value
    total = known_total(step, step.peak)
    if total is not None:
        scalars["piles/peak_total"] = total
    for counter in ALLOCATOR_KEYS:
        value = getattr(step.allocator, counter)
        if value is not None:
            scalars[f"allocator/{counter}"] = value
    if step.host.rss:
        scalars["host/rss"] = step.host.rss
    if step.workers is not None:
        scalars["workers/uss"] = step.workers.uss
        scalars["workers/growth"] = step.workers.growth
        if step.workers.pss is not None:
            scalars["workers/pss"] = step.workers.pss
    scalars["step/duration_seconds"] = max(0.0, step.t_end - step.t_start)
    if step.loss is not None and math.isfinite(step.loss):
        scalars["step/loss"] = step.loss
    if step.grad_norm is not None:
        scalars["step/grad_norm"] = step.grad_norm
    return scalars


EXACT_BLOCK = 1 << 24
"""The split of an exact series: the largest power of two whose multiples below it (and
counts of it below it) a float32 holds exactly."""


def exact_parts(value: int) -> tuple[int, int] | None:
    """`value` as (`hi_16MiB`, `lo_bytes`), `hi_16MiB x EXACT_BLOCK + lo_bytes == value`, both
    held exactly by a float32 (|hi_16MiB| < 2^24, 0 <= lo_bytes < 2^24); None beyond 2^48
    (no exact point is written rather than a rounded one)."""
    hi, lo = divmod(value, EXACT_BLOCK)
    if not -EXACT_BLOCK < hi < EXACT_BLOCK:
        return None
    return hi, lo


def exact_scalars(scalars: dict[str, float]) -> dict[str, float]:
    """The exact series of the integer figures among `scalars` (`exact/<tag>/hi_16MiB` and
    `exact/<tag>/lo_bytes`); a float figure (seconds, loss) has none."""
    exact: dict[str, float] = {}
    for tag, value in scalars.items():
        if isinstance(value, int) and not isinstance(value, bool):
            parts = exact_parts(value)
            if parts is not None:
                exact[f"exact/{tag}/hi_16MiB"], exact[f"exact/{tag}/lo_bytes"] = parts
    return exact


def alert_counts(recording: Recording) -> tuple[list[str], dict[int, Counter[str]]]:
    """Every alert kind of the recording, and per step how many of each it raised."""
    per_step: dict[int, Counter[str]] = defaultdict(Counter)
    for item in recording.alerts:
        if item.step is not None:
            per_step[item.step][item.kind] += 1
    kinds = sorted({kind for counts in per_step.values() for kind in counts})
    return kinds, per_step


def count_points(
    order: list[int], kinds: list[str], per_step: dict[int, Counter[str]]
) -> list[dict[str, int]]:
    """For each step of `order` (the steps as written), the alert counts written there.

    A kind is written at the first and the last step, and at each step where it was raised or
    whose neighbour in `order` raised it: every other step lies inside a run of equal counts
    whose ends are written, so the curve TensorBoard draws (straight lines between points) is
    the one a point per step gives. At most 2 x kinds + 3 x alerts values in all.
    """
    points: list[dict[str, int]] = [{} for _ in order]
    last = len(order) - 1
    for position, number in enumerate(order):
        counts = per_step.get(number)
        if not counts:
            continue
        for kind in counts:
            for near in (position - 1, position, position + 1):
                if 0 <= near <= last:
                    points[near][kind] = per_step.get(order[near], Counter()).get(kind, 0)
    for position in (0, last) if order else ():
        counts = per_step.get(order[position], Counter())
        for kind in kinds:
            points[position][kind] = counts.get(kind, 0)
    return points


def _writer_parts() -> Any:
    try:
        from tensorboard.compat.proto import (
            event_pb2,
            summary_pb2,
            tensor_pb2,
            tensor_shape_pb2,
            types_pb2,
        )
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError:
        raise UserError(MISSING) from None
    return RecordWriter, event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2


def event_file_name() -> str:
    """TensorBoard's own file name (its loaders read files of this prefix, in name order)."""
    return f"{EVENT_PREFIX}{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"


class _RunWriter:
    """One run's event file: float32 scalars and text, in TensorBoard's record format.

    A tag's plugin metadata is written with its first value only, as TensorBoard's own
    `tf.summary` writer does: both its loaders take a series' metadata from its first value.
    (On every value it more than doubled the event file of the exact series' tags.)
    """

    def __init__(self, descriptor: int) -> None:
        parts = _writer_parts()
        record_class, self._event, self._summary, self._tensor, self._shape, self._types = parts
        self._file = os.fdopen(descriptor, "wb", buffering=1 << 20)
        self._records = record_class(self._file)
        self._scalar_meta = self._summary.SummaryMetadata(
            plugin_data=self._summary.SummaryMetadata.PluginData(plugin_name="scalars")
        )
        self._text_meta = self._summary.SummaryMetadata(
            plugin_data=self._summary.SummaryMetadata.PluginData(plugin_name="text")
        )
        self._described: set[str] = set()
        first = self._event.Event(wall_time=time.time(), file_version="brain.Event:2")
        self._records.write(first.SerializeToString())  # as TensorBoard's writer starts a file

    def add(self, step: int, wall_time: float, scalars: dict[str, float], text: str | None) -> None:
        values = [
            self._summary.Summary.Value(
                tag=tag,
                metadata=self._first_time(tag, self._scalar_meta),
                tensor=self._tensor.TensorProto(
                    dtype=self._types.DT_FLOAT,
                    tensor_shape=self._shape.TensorShapeProto(),
                    float_val=[float(value)],
                ),
            )
            for tag, value in scalars.items()
        ]
        if text:
            values.append(
                self._summary.Summary.Value(
                    tag="alerts",
                    metadata=self._first_time("alerts", self._text_meta),
                    tensor=self._tensor.TensorProto(
                        dtype=self._types.DT_STRING,
                        tensor_shape=self._shape.TensorShapeProto(),
                        string_val=[text.encode("utf-8")],
                    ),
                )
            )
        event = self._event.Event(
            wall_time=wall_time, step=step, summary=self._summary.Summary(value=values)
        )
        self._records.write(event.SerializeToString())

    def _first_time(self, tag: str, metadata: Any) -> Any:
        """`metadata` for the first value of `tag`, None (no metadata) after."""
        if tag in self._described:
            return None
        self._described.add(tag)
        return metadata

    def close(self) -> None:
        self._records.close()


def write_run(recording: Recording, descriptor: int) -> int:
    """Write one recording as one run into the new event file `descriptor` (closed here);
    the number of steps written."""
    kinds, per_step = alert_counts(recording)
    texts: dict[int, list[str]] = defaultdict(list)
    for item in recording.alerts:
        if item.step is not None:
            where = f" ({item.alert.where})" if item.alert.where else ""
            texts[item.step].append(f"- **{item.kind}**{where}: {item.alert.message}")
    closed = {step.step for step in recording.steps}
    # Alerts of a step that never closed (an out-of-memory in the last one): counts only.
    orphans = sorted(set(per_step) - closed)
    order = [step.step for step in recording.steps] + orphans
    points = count_points(order, kinds, per_step)
    end_time = recording.end.time if recording.end is not None else None
    writer = _RunWriter(descriptor)
    try:
        for position, step in enumerate(recording.steps):
            scalars = step_scalars(step)
            scalars.update(exact_scalars(scalars))
            scalars.update({f"alerts/{kind}": count for kind, count in points[position].items()})
            writer.add(step.step, step.t_end, scalars, "\n".join(texts.get(step.step, [])) or None)
        for position, number in enumerate(orphans, start=len(recording.steps)):
            scalars = {f"alerts/{kind}": count for kind, count in points[position].items()}
            writer.add(number, end_time or 0.0, scalars, "\n".join(texts[number]) or None)
    finally:
        writer.close()
    return len(recording.steps)


def run_name(recording: Recording, path: Path, label: str | None) -> str:
    """`rank-N` (a session's rank, or a recording whose job has a rank), `proc-N`, or the
    recording's file name without its suffix."""
    if label is not None:
        return f"rank-{label}" if label.isdigit() else label
    rank = recording.hello.rank
    return f"rank-{rank}" if rank is not None and rank >= 0 else path.stem


def default_output(path: Path) -> Path:
    """`run.memtui` -> `run.tensorboard`; a folder `sess` -> `sess.tensorboard`, beside it."""
    return (
        path.with_suffix(".tensorboard")
        if path.is_file()
        else path.parent / (path.name + ".tensorboard")
    )


def _has_events(target: int, name: str, shown: Path) -> bool:
    """Whether the run folder `name` in the open folder `target` already holds event files
    (read without following a link planted at that name)."""
    try:
        folder = os.open(name, FOLDER_FLAGS, dir_fd=target)
    except FileNotFoundError:
        return False
    except OSError:
        return False  # a link or not a folder: `open_or_make_folder_in` says so in one line
    try:
        return any(entry.startswith(EVENT_PREFIX) for entry in os.listdir(folder))
    finally:
        os.close(folder)


def run_tensorboard_export(path_text: str, output: str | None) -> int:
    """`memtui export PATH --format tensorboard [-o DIR]`; the exit code."""
    if output == "-":
        raise UserError("--format tensorboard writes a folder of runs: give -o DIR, not '-'")
    _writer_parts()  # the missing extra is one line before anything is read
    path = Path(path_text)
    warnings: list[str] = []
    runs: list[tuple[str | None, Recording]]
    if path.is_dir():
        from memtui.reports.rank_report import read_session

        recordings, warnings = read_session(path)
        runs = list(recordings.items())
    else:
        recording = read_recording(path)
        if recording.warning:
            warnings.append(f"{path}: {recording.warning}")
        runs = [(None, recording)]
    target = Path(output) if output else default_output(path)
    planned = [(run_name(recording, path, label), recording) for label, recording in runs]
    try:
        folder = open_or_make_folder(target)
    except RefusedPath as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{target}: cannot write ({exc.strerror or exc})") from None
    try:
        for name, _ in planned:
            if _has_events(folder, name, target / name):
                raise UserError(
                    f"{target / name}: already holds TensorBoard event files (an earlier "
                    "export?); remove them or choose another -o, so no step is shown twice"
                )
        for name, recording in planned:
            shown = target / name
            run = open_or_make_folder_in(folder, name, shown)
            try:
                descriptor = create_in(run, event_file_name(), shown / EVENT_PREFIX)
            finally:
                os.close(run)
            steps = write_run(recording, descriptor)
            print(f"memtui: wrote {terminal_safe(shown)} ({steps} steps)", file=sys.stderr)
    except RefusedPath as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{target}: cannot write ({exc.strerror or exc})") from None
    finally:
        os.close(folder)
    print(f"memtui: open it with: tensorboard --logdir {terminal_safe(target)}", file=sys.stderr)
    for warning in warnings:
        print(f"memtui: warning: {terminal_safe(warning)}", file=sys.stderr)
    return EXIT_PARTIAL if warnings else 0
