"""`memtui diff A B`: two runs compared, as text, JSON or a TUI table.

Each side is a recording, or a folder: a session folder of ranks (`rank-N.memtui`) or of a
command's processes (`proc-N.memtui`), of which `--rank` picks one (rank 0 by default, else
the folder's first), or a folder holding one recording. Every file is read by the recording
reader (`read_recording`: regular files only, opened without blocking), so a missing, corrupt,
non-recording or FIFO path is one line and exit code 1, as for `memtui report`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from memtui.errors import UsageError
from memtui.exit_codes import EXIT_PARTIAL
from memtui.input.recording_file import RecordingError
from memtui.model.recording import Recording, read_recording
from memtui.model.run_diff import RunDiff, diff_runs
from memtui.reports.diff_report import RunName, diff_document, render_diff_text
from memtui.reports.rank_report import session_files
from memtui.reports.report_format import strict_json
from memtui.terminal_text import terminal_safe

RECORDING_SUFFIX = ".memtui"


def read_run(path: str, rank: str | None) -> tuple[Recording, RunName]:
    """The recording a side names, and how to name it (see the module).

    Raises:
        RecordingError: unreadable, not a recording, a folder without one (or with several
            that are no session), or a `--rank` the folder does not hold.
    """
    if not path:  # Path("") is the working directory: never what the user meant
        raise RecordingError("an empty path names no recording")
    folder = Path(path)
    if not folder.is_dir():
        return read_recording(folder), RunName(path)
    files = session_files(folder)
    if files:
        labels = [label for label, _ in files]
        wanted = rank if rank is not None else ("0" if "0" in labels else labels[0])
        chosen = dict(files).get(wanted)
        if chosen is None:
            raise RecordingError(
                f"{path}: no recording for rank {wanted} (it holds {', '.join(labels[:8])}"
                + (f" and {len(labels) - 8} more" if len(labels) > 8 else "")
                + ")"
            )
        return read_recording(chosen), RunName(path, wanted, len(files))
    single = sorted(entry for entry in folder.iterdir() if entry.name.endswith(RECORDING_SUFFIX))
    if len(single) == 1:
        return read_recording(single[0]), RunName(path)
    if not single:
        raise RecordingError(f"{path}: is a directory with no memtui recording in it")
    raise RecordingError(
        f"{path}: holds {len(single)} recordings and is no session folder: name one of them"
    )


def open_diff(diff: RunDiff, names: tuple[RunName, RunName], binary: bool) -> int:
    """The diff's table in the TUI (`--tui`); without a terminal, one line saying so."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(
            "memtui diff --tui needs a terminal for its UI (without --tui it prints the diff)"
        )
    from memtui.tui.diff_app import DiffApp

    app = DiffApp(diff, names, binary)
    app.run()
    return app.return_code or 0


def diff_command(a: str, b: str, rank: str | None, as_json: bool, tui: bool, binary: bool) -> int:
    """Read both runs, then print the diff (or open it in the TUI); `EXIT_PARTIAL` after a
    damaged recording's warning, as `memtui report` does."""
    run_a, name_a = read_run(a, rank)
    run_b, name_b = read_run(b, rank)
    diff = diff_runs(run_a, run_b)
    names = (name_a, name_b)
    if tui:
        code = open_diff(diff, names, binary)
    elif as_json:
        print(strict_json(diff_document(diff, names)))
        code = 0
    else:
        print(terminal_safe(render_diff_text(diff, names, binary), keep_newlines=True))
        code = 0
    warned = False
    for name, run in ((name_a, run_a), (name_b, run_b)):
        if run.warning:
            warning = terminal_safe(f"{name.shown}: {run.warning}")
            print(f"memtui: warning: {warning}", file=sys.stderr)
            warned = True
    return code or (EXIT_PARTIAL if warned else 0)
