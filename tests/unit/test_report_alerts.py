"""`memtui report`'s text lists the alerts folded as the screen folds them, and says how many it
left out; `--json` keeps every alert.

The job: the fixture run over `--budget` on every step from step 2 (23 alerts, none a follow-on),
and non-finite from step 20, whose alerts on steps 21-24 follow from step 20's (grouped).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import msgspec

from memtui.model.recording import read_recording
from memtui.model.session import Session
from memtui.reports.report import MAX_ALERT_LINES, build_report, render_text
from memtui_protocol import schema
from memtui_protocol.schema import Severity

NAN_FROM = 20


def messages(builder: ModuleType, budget_from: int) -> list[schema.Message]:
    out: list[schema.Message] = []
    for message in builder.demo_messages():
        if isinstance(message, schema.Step):
            alerts = list(message.alerts)
            if message.step >= budget_from:
                alerts.append(schema.Alert(kind="over_budget", message="over --budget by 1 MiB"))
            if message.step >= NAN_FROM:
                group = NAN_FROM if message.step > NAN_FROM else None
                alerts += [
                    schema.Alert(kind="nonfinite_loss", message="the loss is NaN", group=group),
                    schema.Alert(kind="nonfinite_gradient", message="2 NaN", group=group),
                ]
            message = msgspec.structs.replace(message, alerts=alerts)
        out.append(message)
    return out


def alert_section(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("alerts: "))
    section = [lines[start]]
    section += [line for line in lines[start + 1 :] if line.startswith("  ")]
    return section


def test_follow_on_alerts_are_one_line_as_on_screen(tmp_path: Path, builder: ModuleType) -> None:
    path = tmp_path / "job.memtui"
    path.write_bytes(builder.encode_recording(messages(builder, budget_from=24)))
    recording = read_recording(path)
    section = alert_section(render_text(recording))
    # 4 fixture alerts, 2 at step 20, 8 grouped on steps 21-24, 1 over budget at step 24.
    # Counted by alert: the 8 folded into one line are errors too.
    assert section[0] == "alerts: 15 (13 errors, 1 warning, 1 note)"
    assert "  error   step 20: nonfinite_loss: the loss is NaN" in section
    assert "  error   step 20: nonfinite_gradient: 2 NaN" in section
    folded = [line for line in section if ": grouped: " in line]
    assert folded == [
        "  error   step 20: grouped: 8 more alerts on steps 21-24: they follow from step 20 "
        "(the weights were poisoned by its update)"
    ]
    # The screen folds the same alerts into the same row.
    session = Session(live=False)
    session.ingest(messages(builder, budget_from=24))
    session.toggle_notes()  # the folded row is a note: listed with `o`
    rows = session.view_state().alerts.rows
    assert [row.message for row in rows if row.kind == "grouped"] == [folded[0].split(": ", 2)[2]]
    assert not any("and " in line and " more (" in line for line in section)  # none left out
    assert len(build_report(recording)["alerts"]) == 15  # the JSON keeps every one


def test_the_text_says_how_many_alerts_it_left_out(tmp_path: Path, builder: ModuleType) -> None:
    path = tmp_path / "job.memtui"
    path.write_bytes(builder.encode_recording(messages(builder, budget_from=2)))
    section = alert_section(render_text(read_recording(path)))
    # 4 fixture alerts + 23 over budget + 2 at step 20 + 8 grouped = 37 alerts in 30 lines.
    assert section[0] == "alerts: 37 (35 errors, 1 warning, 1 note)"
    listed = section[1:-1]
    assert len(listed) == MAX_ALERT_LINES
    assert listed[0].startswith("  error   step 2: over_budget")  # errors lead, by step
    left_out = 37 - len(listed)  # no group among the 20 lines shown: one alert each
    assert section[-1] == (
        f"  and {left_out} more (memtui report --json lists every alert; "
        "memtui replay shows them by step)"
    )


def test_errors_lead_the_text_and_the_json_says_each_severity(
    tmp_path: Path, builder: ModuleType
) -> None:
    """The text lists errors, then warnings, then notes (so `MAX_ALERT_LINES` drops notes
    first); each JSON alert carries its kind's severity, a newer agent's kind a warning."""
    path = tmp_path / "job.memtui"
    extra = schema.AlertNow(time=0.0, step=3, alert=schema.Alert(kind="hbm_ecc", message="z"))
    path.write_bytes(builder.encode_recording([*messages(builder, budget_from=24), extra]))
    recording = read_recording(path)
    listed = alert_section(render_text(recording))[1:]
    severities = [line.split()[0] for line in listed]
    assert severities == sorted(severities, key=lambda word: Severity(word).rank)
    assert severities[0] == "error" and severities[-1] == "note"
    alerts = build_report(recording)["alerts"]
    assert {(alert["kind"], alert["severity"]) for alert in alerts} >= {
        ("nonfinite_loss", "error"),
        ("over_budget", "error"),
        ("hbm_ecc", "warning"),
        ("first_step_growth", "note"),
    }
    assert all(
        alert["severity"] == "error"
        for step in build_report(recording)["steps"]
        for alert in step["alerts"]
        if alert["kind"] == "nonfinite_loss"
    )
