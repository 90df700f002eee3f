"""The commands that open the TUI: `run` (without --headless), `demo`, `attach`, `replay`.

Textual is imported here, lazily, so `memtui report` and headless runs never pay for it.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memtui.commands.earlier_run import replace_previous
from memtui.commands.run_command import (
    JobSpec,
    launches_ranks,
    make_private_file,
    summary_line,
    take_notes,
    take_private_file,
)
from memtui.errors import UsageError, UserError
from memtui.exit_codes import EXIT_PARTIAL
from memtui.input.sources import LiveSource, SourceError, TailSource, replay_source
from memtui.model.job_state import QuitChoice
from memtui.model.step_rows import format_age
from memtui.terminal_text import terminal_safe
from memtui_protocol.config import AgentConfig
from memtui_protocol.runtime_dir import RuntimeDirError, live_sidecars, runtime_dir

HEADLESS_HINT = "use --headless for a summary"


def _need_terminal(command: str, hint: str = HEADLESS_HINT) -> str | None:
    """Why the UI cannot open here, with what to run instead (None: there is a terminal)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return f"memtui {command} needs a terminal for its UI ({hint})"
    return None


def _attach_hint(job: dict[str, Any] | None) -> str:
    """What to run without a terminal for a job that already has its agent (`--headless`
    injects one, so it is no answer here): read its recording, or forward its socket."""
    if job is None:
        return "run it where there is one"
    recording = job.get("recording")
    if recording:
        return f"pid {job['pid']} records to {recording}: memtui report {recording} reads it so far"
    return (
        f"pid {job['pid']} records nothing; from a terminal elsewhere, memtui attach --socket "
        f"{job['socket']} (forwarded over SSH)"
    )


class SessionSocketSource(LiveSource):
    """The socket of the job `memtui run --no-record` started, found by its session token."""

    def __init__(self, token: str, job_exited: Any) -> None:
        super().__init__(Path("/nonexistent"), label="live socket")
        self.token = token
        self._job_exited = job_exited

    def check(self) -> None:
        """The socket appears only once the job imports torch; `run` waits for it."""

    def run(self, sink: Any, stop: threading.Event) -> str | None:
        while not stop.is_set():
            try:
                jobs = live_sidecars()
            except RuntimeDirError as exc:
                return f"{exc}; refusing to use it"
            for job in jobs:
                if job.get("session") == self.token:
                    self.socket_path = Path(str(job["socket"]))
                    self.label = str(self.socket_path)
                    try:
                        LiveSource.check(self)
                    except SourceError as exc:
                        return str(exc)
                    return LiveSource.run(self, sink, stop)
            if self._job_exited():
                return "the job ended before its agent started (did it import torch?)"
            stop.wait(0.1)
        return None


class FirstRecordingTail(TailSource):
    """The first recording to appear in a `-- COMMAND` session folder, followed as it grows.

    The command's other Python processes record beside it; `report` and `replay` on the
    folder show them all.
    """

    def __init__(self, folder: Path, job_exited: Any) -> None:
        super().__init__(folder / "proc-0.memtui", job_exited)
        self.folder = folder

    def run(self, sink: Any, stop: threading.Event) -> str | None:
        from memtui.reports.rank_report import session_files

        while not stop.is_set():
            files = session_files(self.folder)
            if files:
                self.path = files[0][1]
                self.label = str(self.path)
                return TailSource.run(self, sink, stop)
            if self._job_exited():
                return "the job ended before its agent started (did it import torch?)"
            stop.wait(self._poll)
        return None


def run_tui(job_spec: JobSpec, command: str = "run") -> int:
    """`memtui run` with the TUI: the job as a child, its output in a pane and a log file.

    The screen opens once the job's agent has started (`job_start`): a job that fails before it
    imports torch leaves Python's error and its exit code on the terminal, not an empty screen.
    A job that fails under the screen gets its error printed again once the screen closes, as
    Python printed it (the runner copies it to `error_file`).
    """
    problem = _need_terminal(command)
    if problem:
        take_notes(job_spec)
        raise UsageError(problem)
    from memtui.commands.job_start import AgentStart, wait_for_agent
    from memtui.input.job_process import JobProcess, recording_log_path

    if job_spec.recording is not None:
        try:
            replace_previous(job_spec.recording, job_spec.force, writes_log=True)
        except UsageError:
            take_notes(job_spec)  # removes the notes file
            raise
    log_path = recording_log_path(job_spec.recording)
    error_file = make_private_file("memtui-error-")
    config = AgentConfig.from_env(job_spec.env).replace(error_file=str(error_file))
    start = AgentStart(job_spec)
    try:
        job = JobProcess(job_spec.command, {**job_spec.env, **config.to_env()}, log_path)
    except OSError as exc:
        take_notes(job_spec)
        take_private_file(error_file)
        why = terminal_safe(f"{job_spec.display[0]}: {exc.strerror or exc}")
        print(f"memtui: cannot start {why}", file=sys.stderr)
        return 127
    shown = False
    try:
        # Textual is imported while the job starts: its import (about 0.2 s) overlaps the
        # job's own start instead of delaying the screen. Anything failing from here stops the job.
        with ctrl_c_deferred():
            from memtui.tui.app import MemtuiApp, run_app

        if wait_for_agent(start, job, notice=_waiting_notice(job_spec, job.pid)):
            source, ranks = _live_source(job_spec, job)
            shown = True
            run_app(MemtuiApp(source, job=job, ranks=ranks))
    except KeyboardInterrupt:  # Ctrl-C before the screen (or outside it): the job's Ctrl-C
        try:
            job.interrupt()
        except KeyboardInterrupt:  # a second Ctrl-C: stop it now
            job.terminate(grace=0.0)
    finally:
        if job.poll() is None:
            job.terminate()
    # Without the screen, what the job printed last (its KeyboardInterrupt) is still to show.
    code = job.wait(drain=2.0 if shown else 10.0)
    if not shown:  # what the job printed after the last echo (its KeyboardInterrupt)
        for line in job.lines_after(start.echoed):
            print(terminal_safe(line), file=sys.stderr)
    job.discard_empty_log()  # a log of memtui's first line alone says nothing
    if job.stopped:  # memtui sent the SIGTERM: the recordings say so (the job could not)
        from memtui.commands.stop_record import record_stop

        record_stop(job_spec.recording, code)
    error = take_private_file(error_file)
    if shown and error:  # without the screen it is on the terminal already
        print(terminal_safe(error.rstrip("\n"), keep_newlines=True), file=sys.stderr)
    for line in take_notes(job_spec):
        print(line, file=sys.stderr)
    summary = summary_line(job_spec, code, stopped=job.stopped)
    print(terminal_safe(summary, keep_newlines=True), file=sys.stderr)
    if log_path is not None and log_path.exists():
        print(f"memtui: job output kept in {terminal_safe(log_path)}", file=sys.stderr)
    return code


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C until the block ends, then raise it. An import runs code from strings
    (`dataclasses`, `namedtuple`): a KeyboardInterrupt out of one marks it unhandled in CPython
    3.11 for good, and the interpreter then exits by SIGINT (-2) instead of memtui's 130."""
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _waiting_notice(job_spec: JobSpec, pid: int) -> str:
    return (
        f"memtui: {terminal_safe(' '.join(job_spec.display))} (pid {pid}) started; the screen "
        "opens when it imports torch (Ctrl-C stops it)"
    )


def _live_source(job_spec: JobSpec, job: Any) -> tuple[Any, dict[str, Any] | None]:
    """What the TUI follows for a job it started, and each rank's source for a session folder."""

    def exited() -> bool:
        return job.poll() is not None

    folder = job_spec.recording
    if folder is not None and folder.is_dir() and not launches_ranks(job_spec.display, None):
        # `-- COMMAND`: one recording per Python process; the screen follows the first.
        return FirstRecordingTail(folder, exited), None
    if folder is not None and folder.is_dir():
        # A session folder: follow each rank's recording as the ranks write them.
        ranks = {
            str(rank): TailSource(folder / f"rank-{rank}.memtui", exited)
            for rank in local_ranks(job_spec.display)
        }
        return next(iter(ranks.values())), ranks
    if folder is not None:
        return TailSource(folder, exited), None
    return SessionSocketSource(job_spec.session, exited), None


def local_ranks(argv: list[str]) -> range:
    """The global ranks a torchrun command starts on this node (`--nproc-per-node N`, and
    `--node-rank K` on several nodes); rank 0 alone when the count is not a number."""
    options: dict[str, str] = {}
    for index, word in enumerate(argv):
        name, _, value = word.partition("=")
        name = name.replace("_", "-")
        if name in ("--nproc-per-node", "--node-rank"):
            options[name] = value or (argv[index + 1] if index + 1 < len(argv) else "")
    count = options.get("--nproc-per-node", "1")
    node = options.get("--node-rank", "0")
    per_node = int(count) if count.isdigit() else 1
    first = int(node) * per_node if node.isdigit() else 0
    return range(first, first + per_node)


def session_sources(folder: Path) -> dict[str, Any]:
    """One replay source per rank recording of a session folder.

    Raises:
        SourceError: the folder holds no rank recordings, or one of them is unreadable.
    """
    from memtui.reports.rank_report import NO_RECORDINGS, session_files

    files = session_files(folder)
    if not files:
        raise SourceError(f"{folder}: {NO_RECORDINGS}")
    sources = {}
    for label, file in files:
        source = replay_source(file)  # a rank still writing its recording is followed
        source.check()
        source.label = source.label.replace(str(file), f"{folder}/{file.name}", 1)
        sources[label] = source
    return sources


def replay(path: str) -> int:
    """`memtui replay PATH`: the recording at its last step, the cursor free; a session
    folder opens every rank (`r` switches)."""
    ranks = None
    if Path(path).is_dir():
        ranks = session_sources(Path(path))
        source = next(iter(ranks.values()))
    else:
        source = replay_source(Path(path))
        source.check()
    hint = f"memtui report {path} prints its summary"
    return _open_app("replay", source, hint, ranks=ranks, warning=source.warning)


def _open_app(command: str, source: Any, hint: str, **options: Any) -> int:
    """Show a checked source in the TUI (after making sure there is a terminal to show it on).

    A recording damaged on the way exits `EXIT_PARTIAL` (3) after the app, as `report` and
    `export` do, with the whole warning on stderr (the screen's notes line may cut it short).
    Quitting a viewer of an attached agent does what the user chose for the agent.
    """
    problem = _need_terminal(command, hint)
    if problem:
        raise UsageError(problem)
    from memtui.tui.app import MemtuiApp, run_app

    app = MemtuiApp(source, **options)
    code = run_app(app)
    hello = app.session.hello
    if app.quit_choice is not None and hello is not None:
        return after_attached_quit(app.quit_choice, hello.pid, hello.recording) or code
    return replay_outcome(app.sessions, code)


def after_attached_quit(choice: QuitChoice, pid: int, recording: str | None) -> int:
    """What the user chose for an attached agent when quitting its viewer: detach it now
    (`memtui detach`, which prints how it went), or leave it recording, said out loud."""
    if choice is QuitChoice.DETACH:
        from memtui.commands.attach_command import detach

        return detach(pid)
    where = terminal_safe(recording) if recording else "its socket only (no recording)"
    print(
        f"memtui: the agent in pid {pid} keeps recording to {where}; memtui detach {pid} stops it",
        file=sys.stderr,
    )
    return 0


def replay_outcome(sessions: dict[str, Any], code: int) -> int:
    """The exit code after a TUI over recordings: each recording's damage warning printed in
    full, and `EXIT_PARTIAL` where there was one (a crash's non-zero code wins)."""
    warnings = [
        (label, session.warning)
        for label, session in sessions.items()
        if not session.live and session.warning
    ]
    for label, warning in warnings:
        where = f"rank {label}: " if label else ""
        print(f"memtui: warning: {terminal_safe(where + warning)}", file=sys.stderr)
    return code or (EXIT_PARTIAL if warnings else 0)


def list_jobs_text(jobs: list[dict[str, Any]], now: float | None = None) -> str:
    """The live jobs as lines: pid, age, command, recording."""
    now = now if now is not None else time.time()
    lines = []
    for job in jobs:
        age = format_age(max(0.0, now - float(job.get("started_unix") or now)))
        command = " ".join(job.get("argv") or [])
        if "ranks" in job:
            command += f"  [{len(job['ranks'])} ranks]"
        recording = job.get("recording") or "-"
        lines.append(terminal_safe(f"{job['pid']:>8}  {age:>7}  {command}  ->  {recording}"))
    return "\n".join(lines)


def group_ranks(sidecars: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per job: the ranks of a distributed job (same `memtui run` session) together.

    A grouped entry is its rank 0's sidecar (or lowest rank's) with `ranks` listing every
    member, so the attach list shows one line per job and attaching opens all its ranks.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    single = []
    for job in sidecars:
        if job.get("rank") is not None and job.get("session"):
            groups.setdefault(str(job["session"]), []).append(job)
        else:
            single.append(job)
    grouped = []
    for members in groups.values():
        members.sort(key=lambda job: int(job["rank"]))
        if len(members) == 1:
            single.append(members[0])
            continue
        grouped.append(dict(members[0], ranks=members))
    return sorted(single + grouped, key=lambda job: float(job.get("started_unix") or 0))


def trusted_live_jobs() -> list[dict[str, Any]]:
    """The live jobs, grouped. A sidecar skipped as untrustworthy is one warning line each.

    Raises:
        UserError: the runtime directory is not ours alone.
    """
    problems: list[str] = []
    try:
        jobs = group_ranks(live_sidecars(problems=problems))
    except RuntimeDirError as exc:
        raise UserError(f"{exc}; refusing to use it") from None
    for problem in problems:
        print(f"memtui: warning: {terminal_safe(problem)}", file=sys.stderr)
    return jobs


def _no_jobs_line() -> str:
    return f"no live memtui jobs (looked in {terminal_safe(str(runtime_dir()))})"


def list_live_jobs() -> int:
    """`memtui attach --list`: each live job, then one socket path per rank (what to forward
    with `ssh -L LOCAL.sock:REMOTE.sock` and open with `memtui attach --socket`)."""
    jobs = trusted_live_jobs()
    if not jobs:  # an answer, not a failure: scripts loop on `attach --list` until a job starts
        print(_no_jobs_line())
        return 0
    for job in jobs:
        print(terminal_safe(list_jobs_text([job])))
        for member in job.get("ranks", [job]):
            rank = member.get("rank")
            label = f"rank {rank}" if rank is not None else "socket"
            print(f"          {label}: {terminal_safe(member['socket'])}")
    return 0


def attach(pid: int | None, socket_path: str | None = None, injected: bool = False) -> int:
    """`memtui attach [PID]`: one job attaches at once; several are listed to choose from; a
    distributed job attaches with all its ranks (`r` switches). `injected`: this attach just
    put the agent into the job (quitting asks whether to detach it)."""
    ranks = None
    chosen: dict[str, Any] | None = None
    if socket_path is not None:
        source = LiveSource(Path(socket_path))
    else:
        jobs = trusted_live_jobs()
        if pid is not None:
            jobs = [
                job
                for job in jobs
                if pid in {int(member["pid"]) for member in job.get("ranks", [job])}
            ]
            if not jobs:
                raise UserError(f"no live memtui job with pid {pid}")
        if not jobs:
            raise UserError(_no_jobs_line())
        chosen = jobs[0] if len(jobs) == 1 else None
        if chosen is None:
            problem = _need_terminal("attach", "give one PID")
            if problem:
                print(terminal_safe(list_jobs_text(jobs), keep_newlines=True))
                print("memtui: several jobs: give a PID", file=sys.stderr)
                return 2
            chosen = _choose_job(jobs)
            if chosen is None:
                return 0
        source = LiveSource(Path(str(chosen["socket"])), label=f"attached to pid {chosen['pid']}")
        if "ranks" in chosen:
            ranks = {
                str(member["rank"]): LiveSource(
                    Path(str(member["socket"])),
                    label=f"attached to rank {member['rank']} (pid {member['pid']})",
                )
                for member in chosen["ranks"]
            }
            source = next(iter(ranks.values()))
    for member in (ranks or {"": source}).values():
        member.check()  # a SourceError is the user's one line (cli.main)
    return _open_app(
        "attach", source, _attach_hint(chosen), ranks=ranks, attached=True, injected=injected
    )


def _choose_job(jobs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A small app showing only the attach list; the chosen job's sidecar, or None."""
    from textual.app import App

    from memtui.tui.screens import AttachScreen

    class Chooser(App[dict[str, Any] | None]):
        CSS_PATH = str(Path(__file__).parent.parent / "tui" / "app.tcss")

        def on_mount(self) -> None:
            self.push_screen(AttachScreen(jobs), self.exit)

    return Chooser().run()
