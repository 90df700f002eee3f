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
    assert section[0] == "alerts: 15"
    assert "  step 20: nonfinite_loss: the loss is NaN" in section
    assert "  step 20: nonfinite_gradient: 2 NaN" in section
    folded = [line for line in section if ": grouped: " in line]
    assert folded == [
        "  step 20: grouped: 8 more alerts on steps 21-24: they follow from step 20 "
        "(the weights were poisoned by its update)"
    ]
    # The screen folds the same alerts into the same row.
    session = Session(live=False)
    session.ingest(messages(builder, budget_from=24))
    rows = session.view_state().alerts.rows
    assert [row.message for row in rows if row.kind == "grouped"] == [folded[0].split(": ", 2)[2]]
    assert not any("and " in line and " more (" in line for line in section)  # none left out
    assert len(build_report(recording)["alerts"]) == 15  # the JSON keeps every one


def test_the_text_says_how_many_alerts_it_left_out(tmp_path: Path, builder: ModuleType) -> None:
    path = tmp_path / "job.memtui"
    path.write_bytes(builder.encode_recording(messages(builder, budget_from=2)))
    section = alert_section(render_text(read_recording(path)))
    # 4 fixture alerts + 23 over budget + 2 at step 20 + 8 grouped = 37 alerts in 30 lines.
    assert section[0] == "alerts: 37"
    listed = section[1:-1]
    assert len(listed) == MAX_ALERT_LINES
    assert listed[0].startswith("  step 1: ")
    left_out = 37 - len(listed)  # no group among the 20 lines shown: one alert each
    assert section[-1] == (
        f"  and {left_out} more (memtui report --json lists every alert; "
        "memtui replay shows them by step)"
    )
