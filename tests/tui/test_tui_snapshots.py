"""SVG snapshots of the main screen, replay and live, at a small and a large terminal.

Everything on screen comes from the committed fixture: the header's times, rates and names are
the fixture's own, the source label is set to a fixed string, and the live job's output is
fixed text. Regenerate with `pytest tests/tui/test_tui_snapshots.py --snapshot-update` and look at
the SVGs before committing them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from repo_paths import FIXTURES, REPO
from textual.pilot import Pilot

from memtui.input.sources import ReplaySource
from memtui.tui.app import MemtuiApp
from memtui_protocol import schema

SIZES = [pytest.param((80, 24), id="80x24"), pytest.param((160, 48), id="160x48")]
FIXTURE = "tests/fixtures/demo.memtui"
JOB_OUTPUT = [
    "loading data from /data/tiny-shakespeare (fixture)",
    "step 12 | loss 2.6228 | 4.0 it/s",
    "switching to bfloat16 autocast",
    "step 24 | loss 1.4142 | 4.0 it/s",
]


def replay_app() -> MemtuiApp:
    """`memtui replay tests/fixtures/demo.memtui`, whatever directory pytest runs in."""
    source = ReplaySource(FIXTURES / "demo.memtui")
    source.label = FIXTURE  # the absolute path would differ between checkouts
    return MemtuiApp(source)


def live_app(tui: Any, messages: list[schema.Message]) -> MemtuiApp:
    """`memtui run` on a job still running: live frames, no End, output in its pane."""
    app: MemtuiApp | None = None
    source = tui.source(
        messages,
        live=True,
        label="live socket",
        # snap_compare runs the app itself; end the fake once the screenshot is taken.
        until=lambda: app is not None and app.return_value is not None,
    )
    app = MemtuiApp(source, job=tui.FakeJob(JOB_OUTPUT))
    return app


def settled(tui: Any) -> Callable[[Pilot[Any]], Any]:
    async def run_before(pilot: Pilot[Any]) -> None:
        await tui.settle(pilot)

    return run_before


@pytest.mark.parametrize("size", SIZES)
def test_replay_main_screen(snap_compare: Any, tui: Any, size: tuple[int, int]) -> None:
    assert snap_compare(replay_app(), terminal_size=size, run_before=settled(tui))


@pytest.mark.parametrize("size", SIZES)
def test_live_main_screen(
    snap_compare: Any, tui: Any, live_messages: list[schema.Message], size: tuple[int, int]
) -> None:
    assert snap_compare(live_app(tui, live_messages), terminal_size=size, run_before=settled(tui))


def carried_messages(messages: list[schema.Message]) -> list[schema.Message]:
    """The fixture run as `--activations auto` records it: steps 13-24 repeat step 12's
    shapes and carry its activation figures."""
    import msgspec

    return [
        msgspec.structs.replace(m, activations_measured=False, activations_from=12)
        if isinstance(m, schema.Step) and m.step > 12
        else m
        for m in messages
    ]


def test_replay_with_carried_activations(
    snap_compare: Any, tui: Any, demo_messages: list[schema.Message]
) -> None:
    """Carried steps: "≈ from step 12" by the activations row, a lighter green in the chart."""
    source = tui.source(carried_messages(demo_messages), live=False, label=FIXTURE)
    app = MemtuiApp(source)
    assert snap_compare(app, terminal_size=(160, 48), run_before=settled(tui))


def test_replay_with_leaks(snap_compare: Any, tui: Any, builder: Any) -> None:
    """A job that leaks, on its last step: "Where the bytes are" lists the End's count of each
    holder; the alert under the table's cursor is whole under it; step 23's activations are
    not known (a ? in the chart where they would stack)."""
    import msgspec

    messages = [
        msgspec.structs.replace(m, activations_measured=False, activations_from=None)
        if isinstance(m, schema.Step) and m.step == 23
        else m
        for m in builder.leaking_messages()
    ]
    source = tui.source(messages, live=False, label=FIXTURE)
    app = MemtuiApp(source)
    assert snap_compare(app, terminal_size=(160, 48), run_before=settled(tui))


def test_snapshots_hold_nothing_from_this_machine() -> None:
    """No checkout path, home directory or host name in the committed SVGs."""
    snapshots = sorted(
        (Path(__file__).parent / "__snapshots__" / Path(__file__).stem).glob("*.svg")
    )
    assert len(snapshots) == 6
    leaks = {str(REPO), os.path.expanduser("~"), os.uname().nodename}
    for svg in snapshots:
        text = svg.read_text()
        found = [leak for leak in leaks if len(leak) > 3 and leak in text]
        assert not found, f"{svg.name} shows {found}"
