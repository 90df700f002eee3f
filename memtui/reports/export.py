"""`memtui export`: a recording as a Chrome/Perfetto trace or as CSV, for other tools.

A trace lines memtui's piles up against a profiler timeline in Perfetto or `chrome://tracing`;
a CSV goes into a notebook or a spreadsheet. Both are pure functions over a `Recording`, with
times in seconds (CSV) or microseconds (trace) since the job started, so two runs overlay.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from memtui.errors import UserError
from memtui.exit_codes import EXIT_PARTIAL
from memtui.model.recording import Recording, StepAlert, read_recording
from memtui.model.step_rows import activations_known, known_total, pile_figure
from memtui.terminal_text import json_safe, terminal_safe
from memtui_protocol.safe_open import RefusedPath, Replace, refusal, write_new
from memtui_protocol.schema import Pile, Piles, Step

FORMATS = {"chrome-trace": ".trace.json", "csv": ".csv"}
"""Each format and the suffix of its default output file."""
STEP_TID = 1
"""Thread id of the step spans and alert markers (one track is enough for one process)."""

CSV_COLUMNS = (
    "step",
    "t_start",
    "t_end",
    "duration_s",
    "skipped",
    "microbatches",
    "loss",
    "grad_norm",
    *(f"end_{pile}" for pile in Pile),
    *(f"max_{pile}" for pile in Pile),
    "peak_total",
    *(f"peak_{pile}" for pile in Pile),
    "allocated",
    "reserved",
    "peak_allocated",
    "rss",
    "activations_measured",
    "activations_from",
    "activations_why_at",
    "kept",
    "workers_uss",
    "workers_growth",
)
"""A step whose activations are not known (neither measured nor carried: `activations_measured`
0 and `activations_from` empty) leaves its activation cells and `peak_total` empty: its frame's
figures for them are partial, and `activations_why_at` is the step whose alert says why. `kept`:
the bytes the job keeps outside every pile (part of `other`), on the steps whose close took a
census only, empty elsewhere and where that census stopped at its bound. `workers_uss` and
`workers_growth`: the DataLoader workers' private memory and its growth since their baseline
(empty for a job without workers). `grad_norm`: the step's global gradient norm, empty where not
known (`schema.Step.grad_norm`)."""


def _finite(value: float | None) -> float | None:
    """JSON has no NaN; a non-finite loss becomes null (the alerts say it was non-finite)."""
    return value if value is not None and math.isfinite(value) else None


def _us(recording: Recording, unix: float) -> float:
    return round((unix - recording.hello.started_unix) * 1e6, 3)


def _instant(recording: Recording, item: StepAlert) -> dict[str, Any]:
    alert = item.alert
    return {
        "name": item.kind,
        "ph": "i",
        "s": "g",
        "ts": _us(recording, item.time),
        "pid": recording.hello.pid,
        "tid": STEP_TID,
        "args": {"step": item.step, "message": alert.message, "where": alert.where},
    }


def _counter(recording: Recording, step: Step, name: str, args: dict[str, Any]) -> dict[str, Any]:
    ts = _us(recording, step.t_end)
    return {"name": name, "ph": "C", "ts": ts, "pid": recording.hello.pid, "args": args}


def _known_piles(step: Step, piles: Piles) -> dict[str, int]:
    """A counter's args: the piles the step states (no activations where they are not known,
    so the trace draws no partial figure for them)."""
    return {
        pile.value: value for pile in Pile if (value := pile_figure(step, piles, pile)) is not None
    }


def chrome_trace(recording: Recording) -> dict[str, Any]:
    """The Trace Event Format document.

    Counters with several args are drawn stacked, so each track holds values that add up: the
    piles at step end (`piles`) and at the step's peak (`peak piles`) stack to the tracked
    total, while allocated, reserved and RSS nest inside each other and get a track each.
    """
    hello = recording.hello
    pid = hello.pid
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": " ".join(hello.argv)}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": STEP_TID, "args": {"name": "steps"}},
    ]
    for step in recording.steps:
        events.append(
            {
                "name": f"step {step.step}",
                "ph": "X",
                "ts": _us(recording, step.t_start),
                "dur": round((step.t_end - step.t_start) * 1e6, 3),
                "pid": pid,
                "tid": STEP_TID,
                "args": {
                    "skipped": step.skipped,
                    "microbatches": step.microbatches,
                    "loss": _finite(step.loss),
                    "activations_known": activations_known(step),
                },
            }
        )
        events.append(_counter(recording, step, "piles", _known_piles(step, step.end)))
        events.append(_counter(recording, step, "peak piles", _known_piles(step, step.peak)))
        for key in ("allocated", "reserved"):
            value = getattr(step.allocator, key)
            if value is not None:
                events.append(_counter(recording, step, key, {key: value}))
        if step.host.rss:
            events.append(_counter(recording, step, "rss", {"rss": step.host.rss}))
    events.extend(_instant(recording, item) for item in recording.alerts)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": "memtui-chrome-trace",
            "version": 1,
            "recording": str(recording.path),
            "started": hello.started,
            "device": hello.device,
        },
    }


def csv_rows(recording: Recording) -> list[dict[str, Any]]:
    """One row per step, keyed by `CSV_COLUMNS`; counters that do not exist are None."""
    start = recording.hello.started_unix
    rows = []
    for step in recording.steps:
        row: dict[str, Any] = {
            "step": step.step,
            "t_start": round(step.t_start - start, 6),
            "t_end": round(step.t_end - start, 6),
            "duration_s": round(step.t_end - step.t_start, 6),
            "skipped": int(step.skipped),
            "microbatches": step.microbatches,
            "loss": step.loss,
            "grad_norm": step.grad_norm,
            "peak_total": known_total(step, step.peak),
            "allocated": step.allocator.allocated,
            "reserved": step.allocator.reserved,
            "peak_allocated": step.allocator.peak_allocated,
            "rss": step.host.rss,
            "activations_measured": int(step.activations_measured),
            "activations_from": step.activations_from,
            "activations_why_at": step.activations_why_at,
            "kept": step.kept.bytes if step.kept is not None else None,
            "workers_uss": step.workers.uss if step.workers is not None else None,
            "workers_growth": step.workers.growth if step.workers is not None else None,
        }
        for prefix, piles in (("end", step.end), ("max", step.max), ("peak", step.peak)):
            row.update({f"{prefix}_{pile}": pile_figure(step, piles, pile) for pile in Pile})
        rows.append(row)
    return rows


def render_csv(recording: Recording) -> str:
    """The CSV text, header first; None is an empty cell."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(csv_rows(recording))
    return out.getvalue()


def render(recording: Recording, fmt: str) -> str:
    """The export of `recording` in `fmt` (a key of `FORMATS`), as text."""
    if fmt == "csv":  # a CSV is read in terminals too: recorded controls escaped, as in reports
        return terminal_safe(render_csv(recording), keep_newlines=True)
    return json_safe(json.dumps(chrome_trace(recording), separators=(",", ":"))) + "\n"


def default_output(path: str | os.PathLike[str], fmt: str) -> Path:
    """`run.memtui` -> `run.trace.json` / `run.csv`, beside the recording.

    Raises:
        UserError: `path` names no file (empty, `.`, a folder's trailing slash only).
    """
    if not Path(path).name:
        raise UserError(f"{terminal_safe(os.fspath(path))!r}: names no recording file")
    return Path(path).with_suffix(FORMATS[fmt])


FORCE_HINT = "--force replaces it"


def export_command(path: str, fmt: str, output: str | None, force: bool) -> int:
    """`memtui export PATH --format FMT [-o OUT] [--force]`, every format: the one place that
    decides whether the output may be written over; the exit code.

    An existing output is refused in one line unless `--force`, even one an earlier export
    wrote: nothing in a CSV or a trace proves it is still what memtui wrote (a user may have
    edited it, or saved their own work under that name), so it is the user's to replace.
    TensorBoard's format writes new event files into a folder and never replaces one; a file
    where its folder should be is refused, `--force` or not.
    """
    if fmt == "tensorboard":
        from memtui.reports import tensorboard_export

        if output != "-":
            folder = Path(output) if output else tensorboard_export.default_output(Path(path))
            if os.path.lexists(folder) and not folder.is_dir():
                raise UserError(
                    f"{folder}: exists and is not a folder; --format tensorboard writes a "
                    "folder of runs (choose another -o)"
                )
        return tensorboard_export.run_tensorboard_export(path, output)
    return run_export(path, fmt, output, force)


def _refuse_existing(target: Path, force: bool) -> None:
    """One line for an output name that holds something export may not write over."""
    reason = refusal(target)  # a link, a FIFO, a folder, another user's file: never
    if reason is not None:
        raise UserError(reason)
    if not force and os.path.lexists(target):
        raise UserError(f"{target}: exists; refusing to overwrite it ({FORCE_HINT})")


def run_export(path: str, fmt: str, output: str | None, force: bool = False) -> int:
    """`memtui export`: write the file (or stdout for `-o -`); returns the exit code.

    A damaged recording exports its valid prefix and exits 3 with a warning, like `report`.
    `force`: an existing regular file of ours at the output is replaced (`export_command`).
    """
    target = None
    if output != "-":
        target = Path(output) if output else default_output(path, fmt)
        if target.resolve() == Path(path).resolve():
            raise UserError(f"{target}: would overwrite the recording")
        _refuse_existing(target, force)
    recording = read_recording(path)
    text = render(recording, fmt)
    if target is None:
        sys.stdout.write(text)
    else:
        replaces = Replace.OWN_FILE if force else Replace.NOTHING
        try:  # never through a planted link, never blocked on a FIFO (safe_open)
            write_new(target, text.encode("utf-8"), replaces)
        except RefusedPath as exc:
            raise UserError(str(exc)) from None
        except OSError as exc:
            raise UserError(f"{target}: cannot write ({exc.strerror or exc})") from None
        print(
            f"memtui: wrote {terminal_safe(target)} ({len(recording.steps)} steps)", file=sys.stderr
        )
    if recording.warning:
        print(f"memtui: warning: {terminal_safe(f'{path}: {recording.warning}')}", file=sys.stderr)
        return EXIT_PARTIAL
    return 0
