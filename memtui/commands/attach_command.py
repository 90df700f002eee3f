"""`memtui attach PID` into a job started without memtui, `attach --headless -o OUT`, `detach`.

Each refusal is one line on stderr and exit code 1, decided before anything touches the job
where it can be (`attach_target`), otherwise answered by the job's bootstrap.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memtui.commands.attach_inject import ANSWER_SECONDS, Injection
from memtui.commands.attach_target import (
    AttachRefused,
    Target,
    check_delivery,
    check_target,
    descendants,
    imported_torch,
)
from memtui.commands.bytecode import write_bytecode
from memtui.terminal_text import terminal_safe
from memtui_protocol.attach import Action, Answer
from memtui_protocol.runtime_dir import (
    RuntimeDirError,
    check_private_dir,
    ensure_private_dir,
    live_sidecars,
    process_create_time,
    runtime_dir,
)
from memtui_protocol.safe_open import Replace, open_own, refusal, write_new
from memtui_protocol.schema import NanCheck

EXIT_REFUSED = 1
STARTED_SECONDS = 120.0
"""Default wait for the job's next step boundary, where the agent starts."""


def refuse(message: str) -> int:
    print(f"memtui: cannot attach: {terminal_safe(message)}", file=sys.stderr)
    return EXIT_REFUSED


def running_agent(pid: int) -> dict[str, Any] | None:
    """The sidecar of an agent already running in `pid`, if any."""
    try:
        jobs = live_sidecars()
    except RuntimeDirError:
        return None
    return next((job for job in jobs if int(job["pid"]) == pid), None)


@dataclass(frozen=True)
class JobBelow:
    """The process that trains, below one that does not: `memtui run`'s launcher (the job is
    its child), torchrun, a shell script."""

    pid: int
    agent: dict[str, Any] | None
    """Its agent's sidecar, where one runs (a `memtui run` job); None: torch only."""


def job_below(pid: int) -> JobBelow | None:
    """Where `pid` has not imported torch itself: the first process below it that runs a
    memtui agent, else the first that has imported torch (None: neither, or `pid` trains)."""
    if imported_torch(pid) is not False:
        return None
    below = descendants(pid)
    for child in below:
        agent = running_agent(child)
        if agent is not None:
            return JobBelow(child, agent)
    for child in below:
        if imported_torch(child):
            return JobBelow(child, None)
    return None


def launcher_refusal(pid: int, below: JobBelow, headless: bool) -> str:
    """Why `pid` itself is not the job, and the command for the one that is."""
    if below.agent is None:
        again = f"memtui attach {below.pid}" + (" --headless -o OUT" if headless else "")
        return f"pid {pid} has not imported torch; its child pid {below.pid} has: {again}"
    recording = below.agent.get("recording")
    where = f"recording to {recording}" if recording else "recording nothing (--no-record)"
    return (
        f"pid {pid} is the launcher of its child pid {below.pid}, which already runs a memtui "
        f"agent, {where}: memtui attach {below.pid}"
    )


PENDING_SUFFIX = ".attach"
"""`<pid>.attach` in the runtime folder: an attach that is waiting for the job's next step.
There is no sidecar before the agent starts, and `memtui detach` must still find it."""


def mark_pending(pid: int) -> None:
    """Remember that `pid` holds a waiting attach (with its start time: pids are reused)."""
    created = process_create_time(pid)
    if created is None:
        return
    try:
        path = ensure_private_dir() / f"{pid}{PENDING_SUFFIX}"
        write_new(path, f"{created!r}\n".encode("ascii"), Replace.OWN_FILE)
    except OSError:
        pass  # detach then refuses as before; nothing else depends on it


def attach_pending(pid: int) -> bool:
    """Whether `pid` (the same process, not a reuse) holds an attach still waiting."""
    path = runtime_dir() / f"{pid}{PENDING_SUFFIX}"
    try:
        check_private_dir(path.parent)
        descriptor = open_own(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        text = os.read(descriptor, 64).decode("ascii", "replace").strip()
    finally:
        os.close(descriptor)
    try:
        created = float(text)
    except ValueError:
        return False
    now = process_create_time(pid)
    return now is not None and abs(now - created) < 1.0


def clear_pending(pid: int) -> None:
    try:
        (runtime_dir() / f"{pid}{PENDING_SUFFIX}").unlink()
    except OSError:
        pass


def job_name(argv: list[str]) -> str:
    """What the job runs: its script, its `-m` module, or its program."""
    for index, word in enumerate(argv[1:], start=1):
        if word == "-m" and index + 1 < len(argv):
            return argv[index + 1]
        if word.endswith(".py"):
            return Path(word).name
    return Path(argv[0]).name if argv else "job"


def recording_path(target: Target, output: str | None) -> Path:
    """`-o OUT`, or the name `memtui run` would give, absolute (the job has its own cwd).

    Raises:
        AttachRefused: the name holds a link, a non-regular file or another user's file.
    """
    from memtui.commands.earlier_run import Standing, examine
    from memtui.commands.run_command import default_recording_name

    path = Path(output) if output else default_recording_name(job_name(target.argv))
    path = path.absolute()
    problem = refusal(path)
    if problem is not None:
        raise AttachRefused(problem)
    if not path.parent.is_dir():
        raise AttachRefused(f"{path.parent}: no such folder")
    # The injected agent replaces only an earlier recording no process still writes: say so
    # here, before anything touches the job (memtui never overwrites a file it did not write).
    found = examine(path, Replace.RECORDING)
    if found.standing is Standing.UNPROVEN:
        raise AttachRefused(f"{path}: exists and is not a memtui recording; choose another -o")
    if found.standing is Standing.LIVE:
        raise AttachRefused(f"{path}: a running job still records there; choose another -o")
    return path


def inject_agent(
    pid: int,
    output: str | None,
    *,
    budget: int | None = None,
    nan_check: NanCheck = NanCheck.DEFAULT,
    seconds: float = STARTED_SECONDS,
    metrics_port: int | None = None,
    metrics_addr: str | None = None,
) -> dict[str, Any]:
    """Inject the agent into `pid` and wait until it records (or, after `seconds`, is armed).

    Raises:
        AttachRefused: any refusal, in one line; the job was left as it was.
    """
    target = check_target(pid)
    method = check_delivery(target)
    record = recording_path(target, output)
    write_bytecode()  # the job imports the agent while it trains: no compiling in its step
    metrics = {"metrics_port": metrics_port, "metrics_addr": metrics_addr}
    injection = Injection(
        target,
        method,
        Action.ATTACH,
        record=str(record),
        budget=budget,
        nan_check=nan_check,
        **{key: value for key, value in metrics.items() if value is not None},
    )
    try:
        injection.deliver()
        answer = injection.wait({Answer.ARMED, Answer.STARTED, Answer.RUNNING}, ANSWER_SECONDS)
        if answer is None:
            raise AttachRefused(
                f"pid {pid}'s main thread ran no Python for {ANSWER_SECONDS:.0f} s (busy in C "
                "code, or waiting while another thread trains); nothing was started"
            )
        if answer["state"] is Answer.ARMED:
            answer = injection.wait({Answer.STARTED}, seconds) or answer
        if answer["state"] is Answer.REFUSED:
            raise AttachRefused(str(answer.get("message")))
        answer.setdefault("recording", str(record))
        return answer
    finally:
        injection.close()


def attach_headless(pid: int, output: str | None, seconds: float, **options: Any) -> int:
    """`memtui attach PID --headless -o OUT`: inject, print the path, return once it records."""
    existing = running_agent(pid)
    if existing is not None:
        where = existing.get("recording") or "nothing (no recording)"
        return refuse(f"pid {pid} already runs a memtui agent, recording to {where}")
    below = job_below(pid)
    if below is not None:
        return refuse(launcher_refusal(pid, below, headless=True))
    try:
        answer = inject_agent(pid, output, seconds=seconds, **options)
    except AttachRefused as exc:
        return refuse(str(exc))
    recording = terminal_safe(str(answer.get("recording")))
    if answer["state"] is Answer.ARMED:
        mark_pending(pid)
        print(
            f"memtui: pid {pid}: the agent is in place and starts recording to {recording} at "
            f"the end of the job's next optimizer step (memtui detach {pid} cancels it)",
            file=sys.stderr,
        )
    elif answer["state"] is Answer.RUNNING:
        return refuse(f"pid {pid} already runs a memtui agent, recording to {recording}")
    else:
        print(f"memtui: attached to pid {pid}; recording to {recording}", file=sys.stderr)
    print(recording)
    return 0


def attach_for_viewer(pid: int, output: str | None, seconds: float, **options: Any) -> int | str:
    """Before the TUI opens on a job without an agent: inject one.

    Returns:
        The injected agent's socket (the job's runtime folder may not be ours: its own
        environment chose it), or an exit code after saying why not.
    """
    try:
        answer = inject_agent(pid, output, seconds=seconds, **options)
    except AttachRefused as exc:
        return refuse(str(exc))
    if answer["state"] is Answer.ARMED:
        mark_pending(pid)
        return refuse(
            f"pid {pid} ran no step within {seconds:.0f} s; the agent starts at its next step "
            "(memtui attach again then, or memtui detach to cancel)"
        )
    if not answer.get("socket"):
        return refuse(f"the agent in pid {pid} serves no socket (see the job's stderr)")
    return str(answer["socket"])


def detach(pid: int, seconds: float = STARTED_SECONDS) -> int:
    """`memtui detach PID`: the agent writes its last frame and removes every hook."""
    try:
        target = check_target(pid, need_torch=False)
        agent = running_agent(pid)
        if agent is None and not attach_pending(pid):
            below = job_below(pid)
            if below is not None and below.agent is not None:
                raise AttachRefused(
                    f"no memtui agent runs in pid {pid}; its child pid {below.pid} runs one: "
                    f"memtui detach {below.pid}"
                )
            raise AttachRefused(f"no memtui agent runs in pid {pid}")
        injection = Injection(target, check_delivery(target), Action.DETACH)
    except AttachRefused as exc:
        print(f"memtui: cannot detach: {terminal_safe(str(exc))}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        injection.deliver()
        answer = injection.wait({Answer.DETACHED}, ANSWER_SECONDS + seconds)
    except AttachRefused as exc:
        print(f"memtui: cannot detach: {terminal_safe(str(exc))}", file=sys.stderr)
        return EXIT_REFUSED
    finally:
        injection.close()
    if answer is None:
        print(f"memtui: cannot detach: pid {pid} did not answer", file=sys.stderr)
        return EXIT_REFUSED
    clear_pending(pid)  # detached, cancelled or refused: no attach waits there any more
    message = terminal_safe(str(answer.get("message")))
    if answer["state"] is Answer.REFUSED:
        print(f"memtui: cannot detach: {message}", file=sys.stderr)
        return EXIT_REFUSED
    if answer["state"] is Answer.DETACHING:
        print(f"memtui: pid {pid}: the agent stops at the job's next forward", file=sys.stderr)
        return 0
    recording = agent.get("recording") if agent is not None else None  # None: a waiting attach
    if not recording:
        print(f"memtui: detached from pid {pid} ({message}); the job carries on", file=sys.stderr)
        return 0
    # The steps as the recording holds them (what `report` counts), not the agent's own count.
    print(f"memtui: detached from pid {pid}; the job carries on", file=sys.stderr)
    for line in detached_lines(Path(str(recording))):
        print(line, file=sys.stderr)
    return 0


def detached_lines(path: Path) -> list[str]:
    """What the detached agent recorded: the steps, the alerts by kind with their first step
    and where the recording is, read from the recording as `report` reads it."""
    from memtui.commands.run_command import outcome_of, recording_lines
    from memtui.input.recording_file import RecordingError

    try:
        outcome = outcome_of(path, None)
    except RecordingError as exc:
        return [f"memtui: recording unreadable: {terminal_safe(str(exc))}"]
    return [
        f"memtui: recorded {outcome.steps} steps; {outcome.peak}; highest piles: {outcome.piles}",
        *recording_lines(outcome, path),
    ]
