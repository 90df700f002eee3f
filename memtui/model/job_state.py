"""Where the viewed job is, as data: the screen styles and words it, nothing parses it back.

The ViewState carries a `JobState` (and, once the stream is over, an `ExitStatus`), so a widget
asks `view.status is JobState.ENDED`, never `"ended" in view.state`.
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
    """The stream is over: `exit_status` says how (None: no agent ever spoke)."""


def exit_status(
    end: schema.End | None, hello: schema.Hello | None, stopped: bool
) -> ExitStatus | None:
    """How an ended stream ended: the agent's last word, else stopped by memtui, else killed."""
    if end is not None:
        return ExitStatus(end.status) if end.status in ExitStatus._value2member_map_ else None
    if hello is None:
        return None
    return ExitStatus.STOPPED if stopped else ExitStatus.KILLED


def ending_text(
    end: schema.End | None,
    hello: schema.Hello | None,
    *,
    exit_code: int | None,
    disconnected: str | None,
    stopped: bool = False,
) -> str:
    """How the job ended, in one line for the header and the ranks table."""
    if end is None:
        code = f" (exit {exit_code})" if exit_code is not None else ""
        reason = f": {disconnected}" if disconnected else ""
        status = exit_status(end, hello, stopped)
        if status is None:  # no agent ever spoke: nothing to call killed
            return f"ended{code}{reason}"
        if status is ExitStatus.STOPPED:
            return f"stopped from memtui (SIGTERM){code}"
        return f"killed{code}, no final frame{reason}"
    code = f" (exit {end.code})" if end.code is not None else ""
    if end.status == ExitStatus.DETACHED:  # `memtui detach`: the agent left, the job goes on
        return f"detached after step {end.step}; the job carries on"
    if end.status == ExitStatus.OK:
        return f"ended: ok{code}"
    if end.status == ExitStatus.STOPPED:
        at = f" at step {end.step}" if end.step is not None else ""
        return f"stopped from memtui (SIGTERM){code}{at}"
    detail = end.describe_error() or ""
    where = f" in {end.phase}" if end.phase else ""
    step = f" at step {end.step}" if end.step is not None else ""
    return f"ended: {end.status}{code}{step}{where}: {detail}"
