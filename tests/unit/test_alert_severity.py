"""Every alert kind has exactly one severity, and every reader orders and words alerts by it:
the screen's table (errors first, notes counted, not listed), the header of an ended run, the
end-of-run line."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import msgspec

from memtui.model.alert_summary import alert_tally
from memtui.model.job_state import ending_text, how_it_ended
from memtui.model.recording import read_recording
from memtui.model.session import Session
from memtui.model.step_rows import AlertRow
from memtui.model.view_state import alerts_view
from memtui_protocol import schema
from memtui_protocol.schema import (
    ALERT_SEVERITY,
    UNKNOWN_KIND_SEVERITY,
    AlertKind,
    Severity,
    alert_severity,
)


def test_every_alert_kind_has_one_severity() -> None:
    assert set(ALERT_SEVERITY) == set(AlertKind)
    assert all(isinstance(severity, Severity) for severity in ALERT_SEVERITY.values())
    errors = {kind for kind, severity in ALERT_SEVERITY.items() if severity is Severity.ERROR}
    assert errors == {
        AlertKind.NONFINITE_LOSS,
        AlertKind.NONFINITE_ACTIVATION,
        AlertKind.NONFINITE_GRADIENT,
        AlertKind.OOM,
        AlertKind.OVER_BUDGET,
        AlertKind.LEAK,
        AlertKind.GROUPED,  # folded follow-ons of a non-finite alert
    }
    assert alert_severity("divergence") is Severity.WARNING
    assert alert_severity("activations_vary") is Severity.NOTE


def test_a_kind_this_version_does_not_know_is_a_warning() -> None:
    """A newer agent's kind: shown among the warnings, never hidden as a note, never called an
    error it may not be."""
    assert UNKNOWN_KIND_SEVERITY is Severity.WARNING
    assert alert_severity("hbm_ecc") is Severity.WARNING
    assert AlertRow(1, "hbm_ecc", "m", None).severity is Severity.WARNING


def test_severities_rank_worst_first() -> None:
    assert [severity.rank for severity in Severity] == [0, 1, 2]
    assert Severity.ERROR.rank < Severity.WARNING.rank < Severity.NOTE.rank


def rows(*kinds: tuple[int, str]) -> tuple[AlertRow, ...]:
    """Folded rows as the screen gets them: newest first."""
    listed = [
        AlertRow(step, kind, kind, None, key=f"alert-{i}") for i, (step, kind) in enumerate(kinds)
    ]
    return tuple(reversed(listed))


def test_the_table_lists_errors_first_and_counts_the_notes() -> None:
    folded = rows(
        (1, "first_step_forecast"),
        (1, "activations_vary"),
        (3, "skipped_step"),
        (5, "nonfinite_loss"),
        (6, "skipped_step"),
    )
    view = alerts_view(folded, notes_shown=False)
    assert [(row.step, str(row.kind)) for row in view.rows] == [
        (5, "nonfinite_loss"),
        (6, "skipped_step"),
        (3, "skipped_step"),
    ]
    assert (view.errors, view.warnings, view.notes) == (1, 2, 2)
    assert view.title() == "Alerts: 1 error · 2 warnings · notes: 2 (o: list)"
    shown = alerts_view(folded, notes_shown=True)
    assert [row.severity for row in shown.rows][-2:] == [Severity.NOTE, Severity.NOTE]
    assert shown.title().endswith("notes: 2 (o: hide)")


def test_a_healthy_run_lists_no_alert_row() -> None:
    view = alerts_view(rows((1, "first_step_forecast"), (1, "step_rule")), notes_shown=False)
    assert view.rows == ()
    assert view.title() == "Alerts: notes: 2 (o: list)"


def test_the_end_of_run_line_leads_with_errors(tmp_path: Path, builder: ModuleType) -> None:
    """A skipped step at step 2 came before the NaN of step 9: the error is named first."""
    out: list[schema.Message] = []
    for message in builder.demo_messages():
        if isinstance(message, schema.Step) and message.step in (2, 9):
            kind = "skipped_step" if message.step == 2 else "nonfinite_gradient"
            alert = schema.Alert(kind=kind, message="m")
            message = msgspec.structs.replace(message, alerts=[*message.alerts, alert])
        out.append(message)
    path = tmp_path / "job.memtui"
    path.write_bytes(builder.encode_recording(out))
    tally = alert_tally(read_recording(path))
    severities = [seen.severity for seen in tally.kinds]
    assert severities == sorted(severities, key=lambda severity: severity.rank)
    assert tally.worst is not None and tally.worst.severity is Severity.ERROR
    line = tally.line(path)
    assert line is not None
    assert line.index("NaN/Inf gradients at step 9") < line.index("skipped step from step 2")
    assert "first-step growth" not in line  # a note: counted, not named


def test_an_ended_run_says_its_worst_error_not_ok() -> None:
    end = schema.End(time=0.0, status="ok", code=0, step=40)
    ending = how_it_ended(end)
    words = ending_text(ending, end, exit_code=0, disconnected=None, worst="NaN loss from step 31")
    assert words == "ended: exit 0, NaN loss from step 31"
    assert ending_text(ending, end, exit_code=0, disconnected=None) == "ended: ok (exit 0)"


def test_a_replay_header_never_says_recording_to(demo_messages: list[schema.Message]) -> None:
    """A recording read back is its own source; "recording to" is the live agent's file."""
    hello = next(message for message in demo_messages if isinstance(message, schema.Hello))
    moved = [
        msgspec.structs.replace(message, recording="/elsewhere/run.memtui")
        if message is hello
        else message
        for message in demo_messages
    ]
    replay = Session(source_label="copy.memtui", live=False)
    replay.ingest(moved)
    assert "recording to" not in replay.view_state().header.source
    live = Session(source_label="socket", live=True)
    live.ingest(moved[:3])
    assert live.view_state().header.source.startswith("recording to /elsewhere/run.memtui")
