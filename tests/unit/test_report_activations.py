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
        "figures), not known on 1 (step 24, why not recorded: --activations off, or an older "
        "recording); no activation figures are shown for them"
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
        "not known on 3 (steps 5, 9, why: the alert of step 5; step 12, why not recorded: "
        "--activations off, or an older recording); no activation figures are shown for them"
    ) in text


def test_the_steps_not_known_are_named_as_ranges(builder: ModuleType) -> None:
    """`not known on 2` names its steps; a long list folds runs into ranges and counts the
    rest: steps 2, 5-7, 12 and 3 more."""
    messages = builder.demo_messages()
    unknown_steps = {2, 5, 6, 7, 9, 12, 14, 16, 18, 20, 22, 23, 24}

    def unknown(message: schema.Message) -> schema.Message:
        if isinstance(message, schema.Step) and message.step in unknown_steps:
            return msgspec.structs.replace(
                message, activations_measured=False, activations_from=None, activations_why_at=2
            )
        return message

    text = _report([unknown(m) for m in messages])
    assert (
        "not known on 13 (steps 2, 5-7, 9, 12, 14, 16, 18, 20 and 3 more, why: the alert of step 2)"
    ) in text


def test_step_ranges_fold_runs_and_count_the_rest() -> None:
    from memtui.model.step_ranges import step_ranges, steps_words

    assert step_ranges([12, 2, 5, 6, 7, 7]) == "2, 5-7, 12"
    assert step_ranges([2, 5, 6, 7, 12, 20, 21, 30], limit=3) == "2, 5-7, 12 and 3 more"
    assert steps_words([4]) == "step 4" and steps_words([3, 4]) == "steps 3-4"
    assert step_ranges([]) == ""
