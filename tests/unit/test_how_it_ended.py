"""One `how_it_ended`: the TUI's header, `memtui report` (JSON, text, session folder) and `memtui
run`'s summary all derive a job's ending with `memtui.model.job_state.how_it_ended`, so they
cannot disagree. The rule is tested directly; the readers are checked to agree on each case.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from memtui.commands.run_command import STOPPED_BY_MEMTUI, outcome_of
from memtui.model.job_state import ending_text, exit_status_of, how_it_ended
from memtui.model.recording import read_recording
from memtui.model.session import Session
from memtui.reports.rank_report import render_session_text
from memtui.reports.report import build_report, render_text
from memtui_protocol import schema
from memtui_protocol.schema import ExitStatus


def end(status: str, **fields: object) -> schema.End:
    return schema.End(time=0.0, status=status, **fields)  # type: ignore[arg-type]


# ----- the rule -----------------------------------------------------------------------------


@pytest.mark.parametrize("status", list(ExitStatus))
def test_the_agents_last_word_wins(status: ExitStatus) -> None:
    assert how_it_ended(end(status.value)) is status
    assert how_it_ended(end(status.value), stopped=True, running=True) is status


def test_without_a_final_frame_memtui_may_know_more() -> None:
    assert how_it_ended(None) is ExitStatus.KILLED
    assert how_it_ended(None, running=True) is ExitStatus.RUNNING
    assert how_it_ended(None, stopped=True) is ExitStatus.STOPPED
    assert how_it_ended(None, stopped=True, running=True) is ExitStatus.STOPPED


def test_a_newer_agents_status_is_kept_as_written() -> None:
    assert exit_status_of("ok") is ExitStatus.OK
    assert how_it_ended(end("suspended")) == "suspended"
    final = end("suspended", code=3)
    line = ending_text(how_it_ended(final), final, exit_code=None, disconnected=None)
    assert line == "ended: suspended (exit 3): "


@pytest.mark.parametrize(
    ("final", "stopped", "words"),
    [
        (None, False, "killed (exit 137), no final frame: gone"),
        (None, True, "stopped from memtui (SIGTERM) (exit 137)"),
        (end("ok", code=0), False, "ended: ok (exit 0)"),
        (end("detached", step=7), False, "detached after step 7; the job carries on"),
        (
            end("stopped", code=143, step=9),
            True,
            "stopped from memtui (SIGTERM) (exit 143) at step 9",
        ),
        (
            end("error", code=1, step=3, phase="backward", error_type="OSError", error="disk"),
            False,
            "ended: error (exit 1) at step 3 in backward: OSError: disk",
        ),
    ],
)
def test_ending_text_words_each_ending(final: schema.End | None, stopped: bool, words: str) -> None:
    ending = how_it_ended(final, stopped=stopped)
    assert ending_text(ending, final, exit_code=137, disconnected="gone") == words


def test_no_agent_ever_spoke_is_no_ending() -> None:
    session = Session(live=True)
    session.mark_disconnected("refused")
    assert session.ending() is None
    assert session.status_text() == "ended: refused"


# ----- every reader agrees --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("final", "expected"),
    [
        (end("ok", code=0, step=24), ExitStatus.OK),
        (end("error", code=1, step=25, error_type="RuntimeError", error="boom"), ExitStatus.ERROR),
        (end("stopped", code=143, step=25), ExitStatus.STOPPED),
        (end("detached", step=24), ExitStatus.DETACHED),
        (None, ExitStatus.KILLED),
        (end("suspended", step=24), "suspended"),
    ],
    ids=["ok", "error", "stopped", "detached", "killed", "newer"],
)
def test_the_screen_the_reports_and_the_summary_agree(
    tmp_path: Path,
    builder: ModuleType,
    final: schema.End | None,
    expected: ExitStatus | str,
) -> None:
    messages = builder.demo_messages(with_end=False) + ([final] if final is not None else [])
    path = tmp_path / "rank-0.memtui"
    path.write_bytes(builder.encode_recording(messages))
    recording = read_recording(path)

    session = Session(source_label=str(path), live=False)
    session.ingest(messages)
    assert session.view_state().header.ending == expected
    assert recording.how_it_ended() == expected
    assert build_report(recording)["exit"]["status"] == expected
    text = render_text(recording)
    if expected is ExitStatus.OK:  # the demo's NaN of step 17: the headline says it, not "ok"
        assert text.startswith("job exited (exit code 0) with an error: NaN loss at step 17")
    else:
        assert text.startswith(f"job {expected}")
    assert render_session_text({"0": recording}).splitlines()[2].endswith(f"  {expected}")
    summary = STOPPED_BY_MEMTUI if expected is ExitStatus.STOPPED else str(expected)
    assert outcome_of(path, None).status == summary


def test_the_summary_of_a_job_memtui_stopped(tmp_path: Path, builder: ModuleType) -> None:
    """No final frame, but memtui sent the SIGTERM: stopped, in the summary and on screen."""
    path = tmp_path / "run.memtui"
    path.write_bytes(builder.encode_recording(builder.demo_messages(with_end=False)))
    assert outcome_of(path, 143, stopped=True).status == STOPPED_BY_MEMTUI
    assert outcome_of(path, 143).status == "killed"
    assert outcome_of(path, 0).status.startswith("exited, recording incomplete")
