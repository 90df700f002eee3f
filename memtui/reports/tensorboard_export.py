"""`memtui export PATH --format tensorboard -o DIR`: every step as TensorBoard scalars, one run
per rank, so memory sits next to the job's own loss curves.

Written with TensorBoard's own event writer (`tensorboard.summary.writer.event_file_writer`, the
one `torch.utils.tensorboard` uses) and TensorBoard's protobuf messages; nothing here imports
torch. TensorBoard's writer package pulls in numpy, so this command (and only it) loads numpy in
the viewer; `tensorboard` is an optional extra (`pip install 'memtui[tensorboard]'`).

Scalars are double-precision tensors under the `scalars` plugin, not the legacy 32-bit
`simple_value`: a byte count above 16 MiB does not fit a float32 exactly, and an export must
read back equal to the recording. Per step (`step` = the recording's step, wall time = its
close):

- `piles/{end,max,peak}/<pile>` and `piles/peak_total`;
- `allocator/<counter>` and `host/rss`, where the job has them (a CPU job has no allocator);
- `step/duration_seconds`, `step/loss` (when finite);
- `alerts/<kind>`: how many alerts of that kind the step raised (every kind the recording has,
  at every step, 0 included), and the text summary `alerts` with each alert's line.

A session folder gives one run per recording (`DIR/rank-0`, `DIR/rank-1`, `DIR/proc-0`); a
single recording one run named after its rank (`DIR/rank-N`) or its file.
"""

from __future__ import annotations

import math
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from memtui.errors import UserError
from memtui.exit_codes import EXIT_PARTIAL
from memtui.model.recording import Recording, read_recording
from memtui.reports.report import ALLOCATOR_KEYS
from memtui.terminal_text import terminal_safe
from memtui_protocol.schema import PILES, Step

MISSING = (
    "memtui export --format tensorboard needs TensorBoard's event writer: "
    "pip install 'memtui[tensorboard]'"
)


def step_scalars(step: Step) -> dict[str, float]:
    """The scalars of one step, by tag (counters the job does not have are absent)."""
    scalars: dict[str, float] = {}
    for stat, piles in (("end", step.end), ("max", step.max), ("peak", step.peak)):
        for pile in PILES:
            scalars[f"piles/{stat}/{pile}"] = getattr(piles, pile)
    scalars["piles/peak_total"] = step.peak.total
    for counter in ALLOCATOR_KEYS:
        value = getattr(step.allocator, counter)
        if value is not None:
            scalars[f"allocator/{counter}"] = value
    if step.host.rss:
        scalars["host/rss"] = step.host.rss
    scalars["step/duration_seconds"] = max(0.0, step.t_end - step.t_start)
    if step.loss is not None and math.isfinite(step.loss):
        scalars["step/loss"] = step.loss
    return scalars


def alert_counts(recording: Recording) -> tuple[list[str], dict[int, Counter[str]]]:
    """Every alert kind of the recording, and per step how many of each it raised."""
    per_step: dict[int, Counter[str]] = defaultdict(Counter)
    for item in recording.alerts:
        if item.step is not None:
            per_step[item.step][item.kind] += 1
    kinds = sorted({kind for counts in per_step.values() for kind in counts})
    return kinds, per_step


def _writer_parts() -> Any:
    try:
        from tensorboard.compat.proto import (
            event_pb2,
            summary_pb2,
            tensor_pb2,
            tensor_shape_pb2,
            types_pb2,
        )
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        raise UserError(MISSING) from None
    return EventFileWriter, event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2


class _RunWriter:
    """One run's event file: double scalars and text, through TensorBoard's writer."""

    def __init__(self, folder: Path) -> None:
        parts = _writer_parts()
        writer_class, self._event, self._summary, self._tensor, self._shape, self._types = parts
        self._writer = writer_class(str(folder), max_queue_size=1000, flush_secs=3600)
        self._scalar_meta = self._summary.SummaryMetadata(
            plugin_data=self._summary.SummaryMetadata.PluginData(plugin_name="scalars")
        )
        self._text_meta = self._summary.SummaryMetadata(
            plugin_data=self._summary.SummaryMetadata.PluginData(plugin_name="text")
        )

    def add(self, step: int, wall_time: float, scalars: dict[str, float], text: str | None) -> None:
        values = [
            self._summary.Summary.Value(
                tag=tag,
                metadata=self._scalar_meta,
                tensor=self._tensor.TensorProto(
                    dtype=self._types.DT_DOUBLE,
                    tensor_shape=self._shape.TensorShapeProto(),
                    double_val=[float(value)],
                ),
            )
            for tag, value in scalars.items()
        ]
        if text:
            values.append(
                self._summary.Summary.Value(
                    tag="alerts",
                    metadata=self._text_meta,
                    tensor=self._tensor.TensorProto(
                        dtype=self._types.DT_STRING,
                        tensor_shape=self._shape.TensorShapeProto(),
                        string_val=[text.encode("utf-8")],
                    ),
                )
            )
        self._writer.add_event(
            self._event.Event(
                wall_time=wall_time, step=step, summary=self._summary.Summary(value=values)
            )
        )

    def close(self) -> None:
        self._writer.close()


def write_run(recording: Recording, folder: Path) -> int:
    """Write one recording as one run into `folder`; the number of steps written."""
    kinds, per_step = alert_counts(recording)
    texts: dict[int, list[str]] = defaultdict(list)
    for item in recording.alerts:
        if item.step is not None:
            where = f" ({item.alert.where})" if item.alert.where else ""
            texts[item.step].append(f"- **{item.kind}**{where}: {item.alert.message}")
    writer = _RunWriter(folder)
    written = set()
    try:
        for step in recording.steps:
            scalars = step_scalars(step)
            counts = per_step.get(step.step, Counter())
            scalars.update({f"alerts/{kind}": counts.get(kind, 0) for kind in kinds})
            text = "\n".join(texts.get(step.step, [])) or None
            writer.add(step.step, step.t_end, scalars, text)
            written.add(step.step)
        # Alerts of a step that never closed (an out-of-memory in the last one): counts only.
        end_time = recording.end.time if recording.end is not None else None
        for number in sorted(set(per_step) - written):
            counts = per_step[number]
            scalars = {f"alerts/{kind}": counts.get(kind, 0) for kind in kinds}
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
    for name, _ in planned:
        folder = target / name
        if folder.is_dir() and any(folder.glob("events.out.tfevents.*")):
            raise UserError(
                f"{folder}: already holds TensorBoard event files (an earlier export?); remove "
                "them or choose another -o, so no step is shown twice"
            )
    try:
        for name, recording in planned:
            steps = write_run(recording, target / name)
            print(f"memtui: wrote {target / name} ({steps} steps)", file=sys.stderr)
    except OSError as exc:
        raise UserError(f"{target}: cannot write ({exc.strerror or exc})") from None
    print(f"memtui: open it with: tensorboard --logdir {target}", file=sys.stderr)
    for warning in warnings:
        print(f"memtui: warning: {terminal_safe(warning)}", file=sys.stderr)
    return EXIT_PARTIAL if warnings else 0
