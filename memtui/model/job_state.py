"""Where the viewed job is and how it ended, as data: the screen styles and words it, nothing
parses it back.

`how_it_ended` is the one derivation of a job's ending: the TUI's header and ranks table, `memtui
report` (JSON and text, one recording or a session folder) and `memtui run`'s closing summary all
call it, so they cannot disagree about whether a job was killed, stopped or is still running.
The ViewState carries a `JobState` and that ending, so a widget asks `status is JobState.ENDED`,
never `"ended" in text`.
"""

from __future__ import annotations

from memtui_protocol import schema
from memtui_protocol.schema import ExitStatus, TextEnum


class JobState(TextEnum):
    """The viewer's side of a job's life (replay is a separate flag: a recording is ENDED or,
    for a job still writing it, whatever its stream says)."""

    WAITING = "waiting for the job"
    LIVE = "live"
    PAUSED = "paused"
    ENDED = "ended"
    """The stream is over: the header's `ending` says how (None: no agent ever spoke)."""


class QuitChoice(TextEnum):
    """What to do with an agent `memtui attach` put into a job, when its viewer quits."""

    DETACH = "detach"
    """`memtui detach`: the agent writes its last frame and removes its hooks."""
    LEAVE = "leave"
    """The agent stays and keeps recording; `memtui detach PID` stops it later."""


Ending = ExitStatus | str
"""How a job ended: an `ExitStatus`, or the string of a status a newer agent wrote that this
version does not know (shown as written, never an error)."""


def exit_status_of(text: str) -> Ending:
    """`End.status` as read from the wire: the member, or the string when it is a newer one."""
    try:
        return ExitStatus(text)
    except ValueError:
        return text


def how_it_ended(
    end: schema.End | None,
    *,
    stopped: bool = False,
    running: bool = False,
    unrecorded: str | None = None,
) -> Ending:
    """How the job of a stream that has a hello ended (the one rule every reader applies).

    The agent's last word wins: its `End.status`. Without one, memtui may know more than the
    stream: it stopped the job itself (`stopped`: quit from the TUI, SIGTERM), or the caller saw
    the process still alive (`running`: a recording still being written); otherwise the process
    died without a final frame, which docs/report-format.md calls killed, unless the agent
    recorded that its recording stopped early (`unrecorded`: why, a full disk): then how the
    job ended is not known, and the stream says why.
    """
    if end is not None:
        return exit_status_of(end.status)
    if stopped:
        return ExitStatus.STOPPED
    if unrecorded is not None:  # the agent said why its recording stopped: not a kill
        return ExitStatus.UNRECORDED
    return ExitStatus.RUNNING if running else ExitStatus.KILLED


def ending_text(
    ending: Ending | None,
    end: schema.End | None,
    *,
    exit_code: int | None,
    disconnected: str | None,
    unrecorded: str | None = None,
    worst: str | None = None,
) -> str:
    """How the job ended, in one line for the header and the ranks table.

    `ending` is `how_it_ended`'s answer (None: no agent ever spoke, nothing to call killed);
    `end` gives the details the agent wrote with it. `worst`: the worst error the run raised
    (`KindSeen.words`, "NaN loss from step 31"): a job that exited cleanly after it did is not
    "ok", and the line says so in its place.
    """
    if end is None:
        code = f" (exit {exit_code})" if exit_code is not None else ""
        reason = f": {disconnected}" if disconnected else ""
        if ending is None:
            return f"ended{code}{reason}"
        if ending is ExitStatus.STOPPED:
            return f"stopped from memtui (SIGTERM){code}"
        if ending is ExitStatus.UNRECORDED:
            return f"{unrecorded_words(unrecorded)}{code}"
        return f"killed{code}, no final frame{reason}"
    code = f" (exit {end.code})" if end.code is not None else ""
    if ending is ExitStatus.DETACHED:  # `memtui detach`: the agent left, the job goes on
        return f"detached after step {end.step}; the job carries on"
    if ending is ExitStatus.OK:
        if worst is not None:
            exited = f"exit {end.code}, " if end.code is not None else ""
            return f"ended: {exited}{worst}"
        return f"ended: ok{code}"
    if ending is ExitStatus.STOPPED:
        at = f" at step {end.step}" if end.step is not None else ""
        return f"stopped from memtui (SIGTERM){code}{at}"
    detail = end.describe_error() or ""
    where = f" in {end.phase}" if end.phase else ""
    step = f" at step {end.step}" if end.step is not None else ""
    return f"ended: {ending}{code}{step}{where}: {detail}"


def unrecorded_words(reason: str | None) -> str:
    """What an `UNRECORDED` ending says: the recording stopped, and the agent's reason."""
    stopped = f"recording stopped: {reason}" if reason else "recording stopped"
    return f"{stopped}; how the job ended is not known"
