"""The text report says how many steps' activations were measured and how many carried."""

from __future__ import annotations

from types import ModuleType

import msgspec

from memtui.model.session import Session
from memtui.reports.report import render_text
from memtui_protocol import schema


def _report(messages: list[schema.Message]) -> str:
    session = Session(live=False)
    session.ingest(messages)
    assert session.recording is not None
    return render_text(session.recording)


def test_the_report_counts_measured_and_carried_steps(builder: ModuleType) -> None:
    messages = builder.demo_messages()
    assert "activations:" not in _report(messages)  # every step measured: nothing to say

    def carried(message: schema.Message) -> schema.Message:
        if isinstance(message, schema.Step) and message.step > 4:
            source = 4 if message.step < 24 else None
            return msgspec.structs.replace(
                message, activations_measured=False, activations_from=source
            )
        return message

    text = _report([carried(m) for m in messages])
    assert (
        "activations: measured on 4 steps, carried on 19 (each repeats a measured step's "
        "figures), not known on 1 (no activation figures are shown for them)"
    ) in text


def test_the_report_names_each_step_not_known_and_where_it_was_said_why(
    builder: ModuleType,
) -> None:
    """Each reason is said once, as an alert; every step it holds for points at that alert."""
    messages = builder.demo_messages()

    def unknown(message: schema.Message) -> schema.Message:
        if isinstance(message, schema.Step) and message.step in (5, 9, 12):
            why_at = 5 if message.step < 12 else None
            return msgspec.structs.replace(
                message,
                activations_measured=False,
                activations_from=None,
                activations_why_at=why_at,
            )
        return message

    text = _report([unknown(m) for m in messages])
    assert (
        "not known on 3 (no activation figures are shown for them); steps 5, 9 (why: the alert "
        "of step 5); step 12 (why not recorded: --activations off, or an older recording)"
    ) in text
