"""Reports over a session folder: one recording per rank (`memtui run -o DIR -- torchrun ...`).

`memtui report DIR --json` prints `{"ranks": {"0": <report>, ...}}`, each a report as in
docs/report-format.md; the text form adds a per-rank table and the imbalance (max/min per pile
across ranks), which is where a rank that holds more (a bigger shard, an unbalanced pipeline
stage) shows up.
"""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Any

from memtui.input.recording_file import RecordingError
from memtui.model.rank_rows import spread
from memtui.model.recording import Recording, read_recording
from memtui.model.step_rows import NOT_KNOWN, distributed_notes
from memtui.reports.report import build_report, pile_peaks, render_text
from memtui_protocol.schema import Pile
from memtui_protocol.units import format_bytes

_RANK_FILE = re.compile(r"^(?:rank-(\d+)|(proc|pid)-(\d+))\.memtui$")
"""`rank-N` (a rank), `proc-N` (the Nth process of a `-- COMMAND`), `pid-N` (older folders)."""
NO_RECORDINGS = "is a directory with no rank-N.memtui or proc-N.memtui recordings"


def session_files(folder: Path) -> list[tuple[str, Path]]:
    """(label, path) for every recording in a session folder: ranks in numeric order ("0",
    "1", ...), then processes in the order they started ("proc-0", "proc-1", ...)."""
    found = []
    for path in folder.iterdir():
        match = _RANK_FILE.match(path.name)
        if match is None:
            continue
        if match.group(1) is not None:
            found.append(((0, "", int(match.group(1))), match.group(1), path))
        else:
            kind, number = match.group(2), int(match.group(3))
            found.append(((1, kind, number), f"{kind}-{number}", path))
    return [(label, path) for _, label, path in sorted(found)]


def read_session(folder: Path) -> tuple[dict[str, Recording], list[str]]:
    """Every readable rank recording, plus one warning line per unreadable or damaged one.

    Raises:
        RecordingError: the folder holds no rank recordings at all.
    """
    files = session_files(folder)
    if not files:
        raise RecordingError(f"{folder}: {NO_RECORDINGS}")
    recordings: dict[str, Recording] = {}
    warnings = []
    for label, path in files:
        try:
            recordings[label] = read_recording(path)
        except RecordingError as exc:
            warnings.append(str(exc))
            continue
        if recordings[label].warning:
            warnings.append(f"{path}: {recordings[label].warning}")
    if not recordings:
        raise RecordingError(f"{folder}: no readable rank recordings ({warnings[0]})")
    return recordings, warnings


def imbalance(recordings: dict[str, Recording]) -> dict[Pile, dict[str, Any]]:
    """Per pile: the highest value on each rank (null where the rank does not know it), max/min
    across the ranks that do, and the heaviest rank."""
    peaks = {label: pile_peaks(recording) for label, recording in recordings.items()}
    result: dict[Pile, dict[str, Any]] = {}
    for pile in Pile:
        per_rank = {label: peaks[label][pile] for label in peaks}
        known = {label: value for label, value in per_rank.items() if value is not None}
        # A pile no rank knows (activations under `--activations off`) has no spread: nulls.
        pile_spread = spread(known) if known else None
        result[pile] = {
            "per_rank": per_rank,
            "max": pile_spread.high if pile_spread else None,
            "min": pile_spread.low if pile_spread else None,
            "ratio": pile_spread.ratio if pile_spread else None,
            "heaviest_rank": pile_spread.heaviest if pile_spread else None,
        }
    return result


def build_session_report(recordings: dict[str, Recording]) -> dict[str, Any]:
    """The JSON document: every rank's report, plus the imbalance."""
    return {
        "ranks": {label: build_report(recording) for label, recording in recordings.items()},
        "imbalance": imbalance(recordings),
    }


def render_session_text(recordings: dict[str, Recording], binary: bool = True) -> str:
    """A table of each rank's highest piles and how it ended, then the imbalance.

    A `-- COMMAND` folder holds processes, not ranks (`proc-N`): one process is that
    recording's own report; several are the table without an imbalance, which compares
    ranks doing the same work, not a launcher and its workers.
    """
    ranks = all(label.isdigit() for label in recordings)
    if not ranks and len(recordings) == 1:
        label, only = next(iter(recordings.items()))
        return f"one process recorded ({label}.memtui)\n" + render_text(only, binary)
    size = partial(format_bytes, binary=binary)
    what = "rank" if ranks else "process"
    count = len(recordings)
    lines = [f"session of {count} rank(s)" if ranks else f"{count} processes of one command"]
    header = f"{what:<8}{'steps':>7}  " + "".join(f"{p:>17}" for p in Pile) + "  ending"
    lines.append(header)
    for label, recording in recordings.items():
        peaks = pile_peaks(recording)
        ending = recording.how_it_ended()
        lines.append(
            f"{label:<8}{len(recording.steps):>7}  "
            + "".join(f"{size(peaks[p], missing=NOT_KNOWN):>17}" for p in Pile)
            + f"  {ending}"
        )
    if not ranks:
        return "\n".join(lines)
    lines.append("imbalance (max/min across ranks):")
    for pile, entry in imbalance(recordings).items():
        if entry["max"] is None:
            lines.append(f"  {pile:<16} {NOT_KNOWN} on every rank")
            continue
        ratio = f"{entry['ratio']:.2f}x" if entry["ratio"] is not None else "n/a"
        if entry["max"] == entry["min"]:
            lines.append(f"  {pile:<16} {ratio:>8}  equal ({size(entry['max'])})")
            continue
        lines.append(
            f"  {pile:<16} {ratio:>8}  heaviest rank {entry['heaviest_rank']} "
            f"({size(entry['max'])})"
        )
    label, first = next(iter(recordings.items()))
    if first.steps:
        lines.extend(f"rank {label}: {note}" for note in distributed_notes(first.steps[-1], binary))
    return "\n".join(lines)
