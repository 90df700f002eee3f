"""Two modules of one name (two root models of one class: a GAN's two `Net`s, a teacher and its
student, an EMA copy) on one step: every view keys them by module id, never by the label.

Before issue 24 the top-activations table keyed its rows by the module's label, and `memtui
replay` of such a job exited with Textual's `DuplicateKey` on its first step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.pilot import Pilot

from memtui.input.sources import ReplaySource
from memtui.tui.app import MemtuiApp
from memtui.tui.widgets import TopActivations


def test_replay_of_two_models_of_one_class_stays_up_through_every_step(
    tmp_path: Path, tui: Any, builder: Any
) -> None:
    """`memtui replay` of the recording, from the last step back to the first and forward
    again: every step shows both `fc1`s, each in its own row."""
    recording = tmp_path / "two-models.memtui"
    recording.write_bytes(builder.encode_recording(builder.two_models_messages()))
    source = ReplaySource(recording)
    source.check()
    app = MemtuiApp(source)
    seen: list[int] = []

    async def body(pilot: Pilot[Any]) -> None:
        table = app.query_one(TopActivations)
        await pilot.press("home")
        for _ in range(builder.STEPS):
            step = app.session.steps[app.session.cursor or 0]
            labels = [str(table.get_row_at(row)[0]) for row in range(table.row_count)]
            assert sorted(labels) == ["Net", "Net", "fc1", "fc1", "fc2", "fc2"], labels
            keys = {key.value for key in table.rows}
            assert keys == {f"module-{item.module}" for item in step.top_activations}
            seen.append(step.step)
            await pilot.press("right")
        assert app.is_running

    tui.drive(app, body, size=(80, 24))  # the crash needs no room; a small screen redraws fast
    assert seen == list(range(1, builder.STEPS + 1))
