"""`memtui run`: start the job as a child with the agent injected, and exit with its code.

Scripts and modules go through `python -m memtui_agent.startup.runner` (exact exit codes and
exception phases); any other command gets the bootstrap `sitecustomize` on PYTHONPATH, which arms
the agent in every Python process of the command that imports torch. Scripts and modules get it
too, for the processes they start: a trainer a driver launches, a worker that trains
(`memtui_agent/startup/children.py`) is recorded once it trains. The job's stdin, stdout and
stderr are its own: in headless mode they pass through untouched.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from memtui import errors
from memtui.commands.earlier_run import replace_previous
from memtui.terminal_text import terminal_safe
from memtui_protocol import schema
from memtui_protocol.config import VARIABLES, AgentConfig
from memtui_protocol.metrics import TARGETS_FOLDER
from memtui_protocol.notes import NOTES_VARIABLE
from memtui_protocol.peak import PEAK_WORDS
from memtui_protocol.safe_open import folder_refusal, make_folder, refusal, session_folder_mode
from memtui_protocol.schema import ExitStatus  # already loaded by `config`
from memtui_protocol.units import format_bytes

if TYPE_CHECKING:  # the summary's imports stay off the launcher's path (see `outcome_of`)
    from memtui.model.alert_summary import AlertTally
    from memtui.model.job_state import Ending
    from memtui.model.recording import Recording


class UsageError(errors.UsageError):
    """A bad command line for `run` or `demo`; `str()` is the one line to show."""


@dataclass
class JobSpec:
    """What to run and how it is shown."""

    command: list[str]
    display: list[str]
    env: dict[str, str]
    recording: Path | None
    notes: Path | None = None
    """Where the command's interpreters leave what they could not say on their own stderr."""
    session: str = ""
    """This `memtui run`'s token (`AgentConfig.session`): ranks' sidecars carry it, so attach
    groups them and the TUI finds the socket of a job it runs without a recording."""
    force: bool = False
    """`--force`: `-o` may replace a file that is not a memtui recording."""


def bootstrap_dir() -> Path:
    """Folder holding the bootstrap `sitecustomize.py` (found without importing the agent)."""
    import importlib.util

    spec = importlib.util.find_spec("memtui_agent")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("the memtui_agent package is not installed next to memtui")
    return Path(next(iter(spec.submodule_search_locations))) / "startup" / "bootstrap"


def default_recording_name(target: str, now: _dt.datetime | None = None) -> Path:
    """`memtui-<stem>-<YYYYmmdd-HHMMSS>.memtui` in the working directory."""
    now = now or _dt.datetime.now()
    stem = Path(target).stem or "job"
    stem = stem.rsplit(".", 1)[-1]
    stem = re.sub(r"[^A-Za-z0-9_+=-]", "_", stem)[:64]  # a name from the command: no controls
    return Path.cwd() / f"memtui-{stem}-{now:%Y%m%d-%H%M%S}.memtui"


LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")


RUNNER = "memtui_agent.startup.runner"
"""What runs a script or `-m` module under memtui (`python -m RUNNER`)."""


def launches_ranks(target: list[str], module: str | None) -> bool:
    """Whether the command is a torch distributed launcher (torchrun), which starts ranks."""
    if module in LAUNCHER_MODULES:
        return True
    if not target:
        return False
    if Path(target[0]).name == "torchrun":
        return True
    return any(
        word == "-m" and following in LAUNCHER_MODULES
        for word, following in itertools.pairwise(target)
    )


def build_job(
    target: list[str],
    module: str | None,
    output: str | None,
    no_record: bool,
    config: AgentConfig | None = None,
    force: bool = False,
) -> JobSpec:
    """Turn the parsed command line into the child's argv and environment.

    `config` holds the agent's options; the recording, argv and session token are filled in
    here and the whole config goes to the job as `AgentConfig.to_env()`. `force`: `-o` may
    replace a file that is not a memtui recording (checked as the job starts,
    `earlier_run.replace_previous`).

    Raises:
        UsageError: nothing to run, a missing script, a command not found, a bad output path.
    """
    env = dict(os.environ)
    env.pop("MEMTUI_AGENT_OWNER", None)
    for variable in VARIABLES:  # a memtui run inside a monitored job starts afresh
        env.pop(variable, None)
    through_bootstrap = False
    if module is not None:
        command = [sys.executable, "-m", RUNNER, "--module", module, *target]
        display = ["python", "-m", module, *target]
        name = module
    else:
        if not target:
            raise UsageError("nothing to run: give a script.py, -m module, or -- COMMAND")
        first = target[0]
        if first.endswith(".py"):
            if not Path(first).is_file():
                raise UsageError(f"no such script: {first}")
            command = [sys.executable, "-m", RUNNER, *target]
            display = ["python", *target]
            name = first
        else:
            if shutil.which(first) is None:
                raise UsageError(not_runnable(first))
            command = list(target)
            display = list(target)
            name = first
            through_bootstrap = True
    # Every mode: the bootstrap arms the processes the job starts (a trainer a driver launches,
    # a spawned worker), which are recorded once they train; the runner arms itself.
    existing = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(bootstrap_dir()) + (os.pathsep + existing if existing else "")
    recording = None
    config = config or AgentConfig()
    if not no_record:
        recording = Path(output) if output else default_recording_name(name)
        try:
            recording = _session_or_file(
                recording,
                target,
                module,
                output,
                through_bootstrap,
                config.metrics_port is not None,
            )
            if config.metrics_port is not None:
                _say_if_unreachable(recording)
        except OSError as exc:  # a name too long, a folder we may not search: one line
            raise UsageError(f"-o {terminal_safe(recording)}: {exc.strerror or exc}") from None
    # One token per `memtui run`: every rank's sidecar carries it, so attach groups them.
    session = uuid.uuid4().hex
    config = config.replace(
        record=str(recording) if recording is not None else None,
        argv=tuple(display),
        session=session,
    )
    env.update(config.to_env())
    notes = make_notes_file()
    env[NOTES_VARIABLE] = str(notes)
    return JobSpec(
        command=command,
        display=display,
        env=env,
        recording=recording,
        notes=notes,
        session=config.session or "",
        force=force,
    )


def one_process(job: JobSpec) -> bool:
    """Whether the job is one monitored process (a script or `-m` module memtui's runner
    starts), not a launcher's ranks nor a `-- COMMAND` that may start several: then its one
    socket tells the whole run."""
    return RUNNER in job.command[:3] and not launches_ranks(job.display, None)


def not_runnable(first: str) -> str:
    """Why `memtui run FIRST` cannot start FIRST, in one line the user can act on: a folder, a
    file that is neither a Python script nor an executable, or no such command."""
    path = Path(first)
    shown = first  # made terminal-safe where the error is printed
    try:
        if path.is_dir():
            return f"{shown} is a directory: give the training script inside it"
        if path.is_file():
            if os.access(path, os.X_OK):  # `which` looks a bare name up on PATH only
                return f"{shown} is not on PATH: give it as ./{shown}"
            return (
                f"{shown} is neither a Python script (.py) nor an executable: give the training "
                f"script, or `memtui run python {shown}` for a script of another name"
            )
    except OSError:  # a name too long, a folder we may not search: the command is not found
        pass
    return f"command not found: {shown}"


def _say_if_unreachable(recording: Path) -> None:
    """`--metrics-port`: say once if a Prometheus running as its own user (Debian's
    `prometheus`) cannot reach the `prometheus/` folder the ranks' target files go into: the
    first folder on the way that other users may not pass through (memtui changes no folder's
    mode but the session folders it makes)."""
    folder = recording if recording.is_dir() else recording.parent
    for step in (folder, *folder.parents):
        info = os.stat(step)
        if not info.st_mode & stat.S_IXOTH:
            mode = stat.S_IMODE(info.st_mode)
            print(
                f"memtui: note: {terminal_safe(step)} (mode {mode:o}) cannot be passed "
                "through by other users: a Prometheus running as its own user will not read "
                f"{terminal_safe(folder / TARGETS_FOLDER)} (chmod o+x {terminal_safe(step)})",
                file=sys.stderr,
            )
            return


def _session_or_file(
    recording: Path,
    target: list[str],
    module: str | None,
    output: str | None,
    through_bootstrap: bool,
    metrics: bool = False,
) -> Path:
    """The recording's path, absolute; a session folder made where the job needs one.

    Raises:
        UsageError: a path the agent would refuse, a missing folder, a file for a folder.
        OSError: the path cannot be checked (too long, a folder we may not search).
    """
    _refuse_unsafe(recording)
    distributed = launches_ranks(target, module)
    # A launcher starts ranks; any other command may start several Python processes (in
    # turn or side by side): each records its own file in a session folder.
    per_process = distributed or through_bootstrap
    if per_process and not output:
        recording = recording.with_suffix("")
    if not recording.is_dir() and not recording.parent.exists():
        raise UsageError(f"-o {recording}: folder {recording.parent} does not exist")
    if per_process and not recording.is_dir():
        # The session folder must exist before the processes start.
        if os.path.lexists(recording):
            who, unit = (
                ("a distributed launcher", "rank") if distributed else ("-- COMMAND", "process")
            )
            raise UsageError(
                f"-o {recording}: is a file; {who} needs a session folder "
                f"(one recording per {unit})"
            )
        make_folder(recording, session_folder_mode(metrics))
    # Absolute, never resolved: a link planted at the name must reach the agent as a link,
    # which it refuses to follow (memtui_protocol.safe_open).
    return recording.absolute()


MAX_NOTES = 5


def make_notes_file() -> Path:
    """A private empty file the bootstrap appends to (mode 0600, a fresh name)."""
    return make_private_file("memtui-notes-")


def make_private_file(prefix: str) -> Path:
    """A fresh empty file (mode 0600) for the job to append to."""
    descriptor, name = tempfile.mkstemp(prefix=prefix, suffix=".txt")
    os.close(descriptor)
    return Path(name)


MAX_PRIVATE_TEXT = 1 << 20
"""What is read back of such a file (a traceback of a deep recursion is about 100 KiB)."""


def take_private_file(path: Path) -> str:
    """What the job wrote to a file of `make_private_file` (bounded); the file is removed."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(MAX_PRIVATE_TEXT)
    except OSError:
        return ""
    finally:
        try:
            path.unlink()
        except OSError:
            pass


def take_notes(job: JobSpec) -> list[str]:
    """What the command's interpreters noted (e.g. a Python without memtui), once each, as
    lines for memtui's own stderr; the notes file is removed."""
    if job.notes is None:
        return []
    text = take_private_file(job.notes)
    counts: dict[str, int] = {}
    for line in text.splitlines():
        if line.strip():
            counts[line] = counts.get(line, 0) + 1
    lines = [
        f"memtui: not monitored ({count} process{'es' if count > 1 else ''}): "
        + terminal_safe(note)
        for note, count in list(counts.items())[:MAX_NOTES]
    ]
    if len(counts) > MAX_NOTES:
        lines.append(f"memtui: ... and {len(counts) - MAX_NOTES} more such notes")
    return lines


def _refuse_unsafe(recording: Path) -> None:
    """Refuse, before the job starts, a recording or `.log` name the agent would not create.

    The agent creates both with O_EXCL|O_NOFOLLOW (memtui_protocol.safe_open); saying so here is
    one clear line instead of a job that runs unrecorded.
    """
    if recording.is_symlink():
        raise UsageError(refusal(recording) or f"{recording}: is a symbolic link")
    if recording.is_dir():
        problem = folder_refusal(recording, recording.lstat())
        if problem is not None:  # the agent would refuse every process's file there
            raise UsageError(problem)
        return
    for path in (recording, recording.with_name(recording.name + ".log")):
        reason = refusal(path)
        if reason is not None:
            raise UsageError(reason)


def exit_code_of(returncode: int) -> int:
    """A child killed by signal N exits the shell way: 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def run_headless(job: JobSpec) -> int:
    """Run the job with its own stdio; print where the recording is and a summary after."""
    if job.recording is not None:
        try:
            replace_previous(job.recording, job.force, writes_log=False)
        except errors.UsageError:
            take_notes(job)  # removes the notes file
            raise
        print(f"memtui: recording to {terminal_safe(job.recording)}", file=sys.stderr, flush=True)
    try:
        child = subprocess.Popen(job.command, env=job.env)
    except OSError as exc:
        take_notes(job)
        why = terminal_safe(f"{job.display[0]}: {exc.strerror or exc}")
        print(f"memtui: cannot start {why}", file=sys.stderr)
        return 127
    follower = None
    if job.recording is None and one_process(job):  # the summary reads its socket instead
        from memtui.commands.live_follow import LiveFollower

        follower = LiveFollower(job.session, lambda: child.poll() is not None)
    forwarded = {}

    def forward(signum: int, _frame: object) -> None:
        try:
            child.send_signal(signum)
        except OSError:
            pass

    # Ctrl-C reaches the child through the terminal's process group; the parent just waits for
    # the child to decide. SIGTERM/SIGHUP sent to memtui alone are passed on.
    forwarded[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        forwarded[signum] = signal.signal(signum, forward)
    try:
        returncode = child.wait()
    finally:
        for signum, previous in forwarded.items():
            signal.signal(signum, previous)
    code = exit_code_of(returncode)
    for line in take_notes(job):
        print(line, file=sys.stderr)
    followed = follower.finish() if follower is not None else None
    summary = summary_line(job, code, followed=followed)
    if follower is not None and follower.lost is not None and followed is not None:
        summary += f"\nmemtui: this covers what the job's socket delivered: {follower.lost}"
    print(terminal_safe(summary, keep_newlines=True), file=sys.stderr)
    return code


MAX_SUMMARY_RECORDINGS = 8
"""Recordings listed one per line at the end of a run of a session folder."""
FULL_BELOW = 1024 * 1024
"""Free bytes under which a folder counts as full (a frame or two would not fit)."""


def incomplete_reason(recording: Path | None) -> str:
    """Why a job that exited by itself left no final frame: a full disk, or the agent stopped.

    The agent cannot record that its own recording failed, so the folder's free space is the
    evidence: a full disk is the common cause (the agent says which on the job's stderr).
    """
    full = folder_full(recording)
    if full is None:
        return "no final frame (see the job's stderr)"
    if full:
        return "disk full"
    return "no final frame (the agent stopped writing or os._exit(); see the job's stderr)"


def folder_full(recording: Path | None) -> bool | None:
    """Whether the recording's folder has no room for another frame (None: cannot tell, or
    nothing was recorded)."""
    if recording is None:
        return None
    try:
        info = os.statvfs(recording.parent)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize < FULL_BELOW or info.f_favail == 0


STOPPED_BY_MEMTUI = "stopped from memtui (SIGTERM); the recording ends at the last closed step"


def summary_line(
    job: JobSpec, code: int, stopped: bool = False, followed: Recording | None = None
) -> str:
    """A few lines for the end of a run: how the job ended and where it was recorded.

    `stopped`: memtui itself ended the job (quit from the TUI), which the recording cannot
    say (the process dies without its final frame), so the summary does. `followed`: what
    memtui read from the job's socket (`--no-record`): the same summary, without a recording.
    """
    if job.recording is None and followed is not None and followed.hello is not None:
        outcome = outcome_from(followed, None, code, stopped)
        lines = [f"memtui: {outcome.headline(code)} (nothing recorded: --no-record)"]
        return "\n".join(lines + recording_lines(outcome, None))
    exited = (
        f"job {INTERRUPTED} (exit code {code})"
        if code == SIGINT_CODE
        else f"job exited with code {code}"
    )
    if job.recording is None:
        return f"memtui: {exited} (nothing recorded: --no-record)"
    if job.recording.is_dir():
        return _session_summary(job.recording, code)
    if not job.recording.exists():
        if code == SIGINT_CODE:
            return (
                f"memtui: {exited} before its first step; no recording was written (the job "
                "had not imported torch yet)"
            )
        return (
            f"memtui: {exited}; no recording was written (the job never imported torch, or the "
            "agent could not start)"
        )
    from memtui.input.recording_file import (
        RecordingError,  # after the job: not in its start-up path
    )

    try:
        outcome = outcome_of(job.recording, code, stopped)
    except RecordingError as exc:
        return f"memtui: job exited with code {code}; recording unreadable: {exc}"
    lines = [f"memtui: {outcome.headline(code)}"]
    lines += recording_lines(outcome, job.recording)
    others = Path(f"{job.recording}-ranks")
    if others.is_dir():  # ranks a launcher started itself (Lightning's DDP), after this one
        lines.append(
            f"memtui: the job's other ranks and processes recorded in {others}  "
            f"(memtui report {others})"
        )
    return "\n".join(lines)


def recording_lines(outcome: Outcome, path: Path | None) -> list[str]:
    """The alerts the run raised, named by kind with their first step, and where the
    recording is (`path` None: nothing was recorded): the closing lines of `memtui run`
    (headless or after its TUI) and `detach`; first, a run that ran out of memory or over its
    budget says why and what would fit."""
    explained = [f"memtui: {terminal_safe(line)}" for line in outcome.shortfall]
    alerts = outcome.alerts.line(path)
    if path is None:
        return [*explained, f"memtui: {alerts}"] if alerts is not None else explained
    if alerts is None:
        return [*explained, f"memtui: recording {path}  (memtui report {path})"]
    return [
        *explained,
        f"memtui: {alerts}",
        f"memtui: recording {path}",
    ]  # the alerts line says how to read


@dataclass(frozen=True)
class Outcome:
    """What the end of a run says about one recording."""

    status: str
    """How it ended, in the summary's words (`ending_words`)."""
    steps: int
    piles: str
    """The highest of each pile, formatted."""
    peak: str
    """The run's highest peak, as every view states it, with what it includes."""

    alerts: AlertTally
    last_step: int | None = None
    """The number of the last step recorded (None: none)."""
    shortfall: tuple[str, ...] = ()
    """Out of memory or over budget explained (`memtui.model.out_of_memory`); empty when
    neither happened."""

    def headline(self, code: int) -> str:
        """`job ok (exit code 0) after 12 steps; ...`; a job that exited 0 after an error says
        the error instead of "ok" (`job exited (exit code 0) with an error: NaN loss from step
        5; after 12 steps; ...`), as the report and the TUI's header do."""
        error = self.alerts.error_words() if self.status == ExitStatus.OK else None
        if error is None:
            return f"job {self.status} (exit code {code}) {self.so_far()}"
        return f"job exited (exit code {code}) with an error: {error}; {self.so_far()}"

    def so_far(self) -> str:
        """`after 12 steps; peak ...; highest piles: ...`; a run with no step has no figures
        worth a line (every pile would read 0): `after 0 steps`, or `before its first step`
        for a job Ctrl-C interrupted."""
        if not self.steps:
            return "before its first step" if self.status == INTERRUPTED else "after 0 steps"
        at = f" (the last: step {self.last_step})" if self.last_step != self.steps else ""
        return f"after {self.steps} steps{at}; {self.peak}; highest piles: {self.piles}"


def outcome_of(path: Path, code: int | None, stopped: bool = False) -> Outcome:
    """How one recording of a job that exited with `code` ended, its steps, highest piles and
    alerts (`stopped`: memtui stopped it, which a recording without its final frame cannot say).

    Raises:
        RecordingError: the recording cannot be read.
    """
    from memtui.model.recording import read_recording

    return outcome_from(read_recording(path), path, code, stopped)


def outcome_from(
    recording: Recording, path: Path | None, code: int | None, stopped: bool = False
) -> Outcome:
    """`outcome_of` for a recording already read (or followed live: `path` None, nothing
    was recorded)."""
    from memtui.model.alert_summary import alert_tally
    from memtui.model.out_of_memory import explain, shortfall_lines
    from memtui.model.step_rows import NOT_KNOWN
    from memtui.reports.report import highest_peak, pile_peaks

    peaks = pile_peaks(recording)
    piles = ", ".join(
        f"{pile} {format_bytes(value, missing=NOT_KNOWN)}" for pile, value in peaks.items()
    )
    status = ending_words(
        recording.how_it_ended(stopped), path, code, recording.end, recording.recording_stopped
    )
    shortfall = explain(recording)
    explained = tuple(shortfall_lines(shortfall)) if shortfall is not None else ()
    peak = highest_peak(recording.steps)
    peak_words = f"peak {format_bytes(peak, missing=NOT_KNOWN)} ({PEAK_WORDS})"
    last = recording.steps[-1].step if recording.steps else None
    return Outcome(
        status,
        len(recording.steps),
        piles,
        peak_words,
        alert_tally(recording),
        last_step=last,
        shortfall=explained,
    )


INTERRUPTED = "interrupted by Ctrl-C"
SIGINT_CODE = 130
"""The shell's exit code for a process that SIGINT ended (128 + 2), which Python's own exit on
an uncaught KeyboardInterrupt reproduces."""


def ending_words(
    ending: Ending,
    path: Path | None,
    code: int | None,
    end: schema.End | None = None,
    unrecorded: str | None = None,
) -> str:
    """`how_it_ended`'s answer as the summary words it: stopped from memtui in full, Ctrl-C as
    interrupted (the agent's `End` says KeyboardInterrupt, or no final frame and exit 130); a
    recording the agent said it stopped (`unrecorded`: a full disk) with the agent's reason;
    a job that exited by itself (`code` under 128), or one process of a session (`code`
    unknown) in a full folder, without a final frame is not called killed."""
    if ending is ExitStatus.STOPPED:
        return STOPPED_BY_MEMTUI
    if (end is not None and end.interrupted) or (
        ending is ExitStatus.KILLED and code == SIGINT_CODE
    ):
        return INTERRUPTED
    if ending is ExitStatus.UNRECORDED:
        from memtui.model.job_state import unrecorded_words

        words = terminal_safe(unrecorded_words(unrecorded))
        return f"exited, {words}" if code is not None and code < 128 else words
    if ending is ExitStatus.KILLED and code is not None and code < 128:
        return f"exited, recording incomplete: {incomplete_reason(path)}"
    if ending is ExitStatus.KILLED and code is None and folder_full(path):
        return "recording incomplete: disk full (ENOSPC); how the process ended is not known"
    return terminal_safe(ending)  # a status this memtui does not know is recorded text


def _session_summary(folder: Path, code: int) -> str:
    """A session folder: one line per recording (every rank, every Python process), so a
    process that ran no step is seen beside the one that trained."""
    from memtui.input.recording_file import RecordingError
    from memtui.reports.rank_report import session_files

    files = session_files(folder)
    lines = [
        f"memtui: job exited with code {code}; {len(files)} recording(s) in {folder}  "
        f"(memtui report {folder})"
    ]
    if not files:
        lines[0] += "; none written (no Python process imported torch, or no agent started)"
    for label, path in files[:MAX_SUMMARY_RECORDINGS]:
        name = f"rank {label}" if label.isdigit() else terminal_safe(label)
        try:
            outcome = outcome_of(path, None)  # each process's own code is unknown
        except RecordingError as exc:
            lines.append(f"memtui:   {name}: unreadable: {terminal_safe(exc)}")
            continue
        alerts = outcome.alerts.line(None)
        lines.append(
            f"memtui:   {name}: {outcome.status} {outcome.so_far()}"
            + (f"; {alerts}" if alerts else "")
        )
    if len(files) > MAX_SUMMARY_RECORDINGS:
        lines.append(f"memtui:   ... and {len(files) - MAX_SUMMARY_RECORDINGS} more")
    return "\n".join(lines)
