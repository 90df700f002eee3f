"""What an earlier run left under `memtui run`'s `-o`, and what of it this run may remove.

A rerun with the same `-o` whose job never writes a recording (it fails before importing torch,
or the agent cannot start) used to show the earlier run as this one ("job ok (exit code 3)"), so
the earlier recording goes before the job starts. But only what memtui can prove it wrote, and
only when no process still writes it (`memtui_protocol.written`):

- `-o FILE`: an earlier recording no process still writes is removed. A recording still being
  written is refused (two jobs cannot share one file). A file that is not a memtui recording is
  refused unless `--force`. The file the shell sends memtui's own output to is never touched.
- `<recording>.log`: removed only when it begins with memtui's own first line and nobody writes
  it. A shell redirect (`memtui run --headless -o run.memtui train.py > run.memtui.log`) or a
  user's notes there are left alone; only the TUI writes that log, so only the TUI refuses a
  file there it cannot prove is its own (unless `--force`).
- a session folder (`-o DIR` for `-- COMMAND` and ranks, or `<recording>-ranks/`): tasks that a
  scheduler starts one at a time share it, each with its own `memtui run`. When any recording in
  it is still written, or one was written by the same launch as this run (`Hello.launch`: the
  same `srun` step), this run is a sibling: it records beside them and removes nothing. Else it is
  a rerun: the earlier recordings (and their proven logs) are removed. The process counter is
  kept, so a process of this run never takes a number an earlier one had.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from memtui import errors
from memtui.terminal_text import terminal_safe
from memtui_protocol.launch import launch_identity
from memtui_protocol.safe_open import (
    RefusedPath,
    Replace,
    open_existing,
    open_folder,
    refusal,
    remove_written,
)
from memtui_protocol.written import Head, marked_log, recording_head, still_written

FORCE_HINT = "--force replaces it"


class Standing(Enum):
    """What a name under `-o` holds, as far as removing it goes."""

    ABSENT = "absent"
    FOREIGN = "foreign"
    """A link, a non-regular file, another user's file, or one that cannot be read."""
    UNPROVEN = "unproven"
    """A regular file of ours that memtui cannot prove it wrote."""
    LIVE = "live"
    """Proven memtui's, and a process still writes it."""
    DONE = "done"
    """Proven memtui's, and nobody writes it: a rerun may remove it."""


@dataclass(frozen=True)
class Found:
    """One name's standing, with the recording's head where it is one."""

    standing: Standing
    reason: str | None = None
    head: Head | None = None


class RerunError(errors.UsageError):
    """The earlier run's files cannot be replaced; `str()` is the one line."""


def shell_outputs() -> set[tuple[int, int]]:
    """(st_dev, st_ino) of memtui's own stdin, stdout and stderr: a file the shell opened for
    this command (a redirect) is never removed or replaced by it."""
    found = set()
    for descriptor in (0, 1, 2):
        try:
            info = os.fstat(descriptor)
        except OSError:
            continue
        if stat.S_ISREG(info.st_mode):
            found.add((info.st_dev, info.st_ino))
    return found


def examine(path: Path, kind: Replace) -> Found:
    """What `path` holds (never through a link, never blocking on a FIFO)."""
    reason = refusal(path)
    if reason is not None:
        return Found(Standing.FOREIGN, reason)
    try:
        folder = open_folder(path.parent)
    except RefusedPath as exc:
        return Found(Standing.FOREIGN, str(exc))
    except OSError as exc:
        return Found(Standing.FOREIGN, f"{path.parent}: {exc.strerror or exc}")
    try:
        descriptor = open_existing(folder, path.name)
    except FileNotFoundError:
        return Found(Standing.ABSENT)
    except OSError as exc:
        return Found(Standing.FOREIGN, f"{path}: cannot check ({exc.strerror or exc})")
    finally:
        os.close(folder)
    try:
        if kind is Replace.RECORDING:
            head = recording_head(descriptor)
            proven = head is not None
        else:
            head, proven = None, marked_log(descriptor)
        if not proven:
            return Found(Standing.UNPROVEN)
        return Found(
            Standing.LIVE if still_written(descriptor, head) else Standing.DONE, None, head
        )
    except OSError as exc:
        return Found(Standing.FOREIGN, f"{path}: cannot read ({exc.strerror or exc})")
    finally:
        os.close(descriptor)  # the writer's lock, if we took it, goes with it


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


@dataclass
class Plan:
    """What the rerun removes, decided before anything is removed (a refusal removes nothing)."""

    remove: list[tuple[Path, Replace]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def replace_previous(recording: Path, force: bool = False, writes_log: bool = False) -> None:
    """Remove what an earlier run left under this run's `-o`, before the job starts (see the
    module's docstring); print a line when this run joins a session folder's live tasks.

    `force`: `-o` may replace a file that is not a memtui recording (and, with `writes_log`, a
    `.log` memtui did not write). `writes_log`: this run writes `<recording>.log` (the TUI).

    Raises:
        RerunError: something under `-o` may not be replaced; nothing was removed.
    """
    plan = Plan()
    outputs = shell_outputs()
    joined = False
    if recording.is_dir():
        joined = _plan_session(recording, plan)
    else:
        _plan_file(recording, force, outputs, plan)
        ranks = Path(f"{recording}-ranks")  # the ranks a launcher started beside the file
        if ranks.is_dir() and not ranks.is_symlink():
            _plan_session(ranks, plan)
    log = recording.with_name(recording.name + ".log")
    _plan_log(log, force, writes_log, outputs, plan, keep_earlier=joined)
    for path, kind in plan.remove:
        try:
            reason = remove_written(path, kind)
        except OSError as exc:
            raise RerunError(
                f"-o {recording}: cannot replace the earlier {path.name} ({exc.strerror or exc})"
            ) from None
        if reason is not None and kind is Replace.OWN_FILE:
            raise RerunError(reason)
        # A recording that a process began writing since it was examined is live: it stays.
    for note in plan.notes:
        print(f"memtui: {terminal_safe(note)}", file=sys.stderr)


def _plan_file(recording: Path, force: bool, outputs: set[tuple[int, int]], plan: Plan) -> None:
    if _identity(recording) in outputs:
        raise RerunError(
            f"-o {recording}: is where memtui's own output goes (a shell redirect); "
            "choose another -o"
        )
    found = examine(recording, Replace.RECORDING)
    if found.standing is Standing.FOREIGN:
        raise RerunError(found.reason or f"{recording}: refusing to overwrite it")
    if found.standing is Standing.LIVE:
        hello = found.head.hello if found.head is not None else None
        ours = launch_identity(os.environ)
        if ours is not None and hello is not None and hello.launch == ours:
            # A sibling task of this launch (`srun memtui run -o FILE ...`): the job runs, and
            # its agent records beside the file (`<recording>-ranks/`), never into it.
            plan.notes.append(
                f"{recording}: a task of this launch ({ours}) records there; this task "
                f"records beside it in {recording.name}-ranks/"
            )
            return
        who = f" (pid {hello.pid} on {hello.hostname or 'this host'})" if hello else ""
        raise RerunError(
            f"-o {recording}: a running job{who} still records there; choose another -o"
        )
    if found.standing is Standing.UNPROVEN:
        if not force:
            raise RerunError(
                f"-o {recording}: exists and is not a memtui recording; refusing to overwrite "
                f"it ({FORCE_HINT})"
            )
        plan.remove.append((recording, Replace.OWN_FILE))
    elif found.standing is Standing.DONE:
        plan.remove.append((recording, Replace.RECORDING))


def _plan_log(
    log: Path,
    force: bool,
    writes_log: bool,
    outputs: set[tuple[int, int]],
    plan: Plan,
    keep_earlier: bool,
) -> None:
    """The job log beside the recording: the TUI writes it, a headless run never does.
    `keep_earlier`: this run joined a session folder's tasks, whose log is theirs."""
    if _identity(log) in outputs:
        if writes_log:
            raise RerunError(
                f"{log}: is where memtui's own output goes (a shell redirect); the job's "
                "output would be written there too: choose another -o"
            )
        return  # the shell's redirect: the job's output goes there, as the user asked
    found = examine(log, Replace.JOB_LOG)
    if found.standing is Standing.DONE and not keep_earlier:
        plan.remove.append((log, Replace.JOB_LOG))
    elif not writes_log or found.standing is Standing.DONE:
        return  # not ours to touch and not written by this run; or the TUI's create replaces it
    elif found.standing is Standing.FOREIGN:
        raise RerunError(found.reason or f"{log}: refusing to overwrite it")
    elif found.standing is Standing.LIVE:
        raise RerunError(f"{log}: a running memtui still writes it; choose another -o")
    elif found.standing is Standing.UNPROVEN:
        if not force:
            raise RerunError(
                f"{log}: exists and is not a log memtui wrote; refusing to overwrite it "
                f"({FORCE_HINT})"
            )
        plan.remove.append((log, Replace.OWN_FILE))


def _plan_session(folder: Path, plan: Plan) -> bool:
    """A session folder: a sibling task joins it as it is (True), a rerun removes the earlier
    run's recordings and their proven logs (False)."""
    from memtui.reports.rank_report import session_files

    recordings = [path for _label, path in session_files(folder)]
    found = {path: examine(path, Replace.RECORDING) for path in recordings}
    live = [path for path, item in found.items() if item.standing is Standing.LIVE]
    if live:
        plan.notes.append(
            f"{folder}: {len(live)} recording(s) there are still being written (tasks started "
            "before this one); this run records beside them and removes nothing"
        )
        return True
    ours = launch_identity(os.environ)
    if ours is not None and any(
        item.head is not None and item.head.hello is not None and item.head.hello.launch == ours
        for item in found.values()
    ):
        plan.notes.append(
            f"{folder}: holds recordings of this launch ({ours}); this run records beside "
            "them and removes nothing"
        )
        return True
    for path, item in found.items():
        if item.standing is Standing.DONE:
            plan.remove.append((path, Replace.RECORDING))
            plan.remove.append((path.with_name(path.name + ".log"), Replace.JOB_LOG))
    return False
