"""Quitting a viewer of a job `memtui attach` put the agent into: detach it, or leave it
recording to its file, said out loud; and the header names that file, not only the socket.

gdb cannot inject into a process on this machine, so the viewer is fed the stream an attached
agent sends (its first frame carries the `attached` alert) by a fake source, as the other pilot
tests are, and `memtui detach` is stood in for where the choice reaches it.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import msgspec
import pytest
from textual.pilot import Pilot
from textual.widgets import Static

import memtui.commands.attach_command as attach_command
from memtui.commands.tui_commands import after_attached_quit
from memtui.model.job_state import QuitChoice
from memtui.tui.app import MemtuiApp
from memtui.tui.screens import ConfirmDetach
from memtui.tui.widgets import JobHeader
from memtui_protocol import schema

RECORDING = "/jobs/memtui-train-20261201-101500.memtui"
SOCKET = "/run/user/1000/memtui/4242.sock"


def attached_stream(builder: ModuleType, attached_alert: bool = True) -> list[schema.Message]:
    """What the socket of an agent injected into the fixture job sends, the job still running:
    its hello names the recording, its first step carries the `attached` alert."""
    messages: list[schema.Message] = builder.demo_messages(with_end=False)
    messages[0] = msgspec.structs.replace(messages[0], recording=RECORDING)
    if attached_alert:
        first = messages[2]
        assert isinstance(first, schema.Step)
        alert = schema.Alert(kind="attached", message="attached at step 1")
        messages[2] = msgspec.structs.replace(first, alerts=[alert, *first.alerts])
    return messages


def viewer(tui: Any, messages: list[schema.Message], **options: Any) -> MemtuiApp:
    return MemtuiApp(tui.source(messages, live=True, label=SOCKET), attached=True, **options)


def test_the_header_names_the_recording_not_only_the_socket(tui: Any, builder: ModuleType) -> None:
    app = viewer(tui, attached_stream(builder), injected=True)

    async def body(pilot: Pilot[Any]) -> None:
        header = app.query_one(JobHeader).view
        assert header is not None
        assert header.source == f"recording to {RECORDING} · {SOCKET}"

    tui.drive(app, body)


@pytest.mark.parametrize("key", ["q", "ctrl+c"])
@pytest.mark.parametrize(("answer", "choice"), [("d", QuitChoice.DETACH), ("l", QuitChoice.LEAVE)])
def test_quitting_asks_detach_or_leave_it_recording(
    tui: Any, builder: ModuleType, key: str, answer: str, choice: QuitChoice
) -> None:
    app = viewer(tui, attached_stream(builder), injected=True)

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press(key)
        assert isinstance(app.screen, ConfirmDetach)
        question = str(app.screen.query_one("#detach-question", Static).content)
        assert "etach the agent from pid 4242" in question
        assert f"eave the agent recording to {RECORDING}?" in question
        await pilot.press("escape")  # keep watching
        assert not isinstance(app.screen, ConfirmDetach) and app.is_running
        assert app.quit_choice is None
        await pilot.press(key, answer)
        await pilot.pause()
        assert not app.is_running

    tui.drive(app, body)
    assert app.quit_choice is choice


def test_an_agent_an_earlier_attach_left_is_asked_about_too(tui: Any, builder: ModuleType) -> None:
    """`memtui attach PID` again, to the agent left recording: the stream says it was
    attached, so quitting asks again."""
    app = viewer(tui, attached_stream(builder), injected=False)

    async def body(pilot: Pilot[Any]) -> None:
        await pilot.press("q")
        assert isinstance(app.screen, ConfirmDetach)
        await pilot.press("escape")

    tui.drive(app, body)


def test_no_question_for_an_agent_the_job_started_with_or_a_job_that_ended(
    tui: Any, builder: ModuleType
) -> None:
    """A `memtui run` job's agent belongs to that run: quitting the viewer just leaves. Nor
    is there an agent left to ask about once the stream has ended."""
    for messages, injected in (
        (attached_stream(builder, attached_alert=False), False),
        ([*attached_stream(builder), builder.demo_messages()[-1]], True),
    ):
        app = viewer(tui, messages, injected=injected)

        async def body(pilot: Pilot[Any], app: MemtuiApp = app) -> None:
            await pilot.press("q")
            await pilot.pause()
            assert not app.is_running

        tui.drive(app, body)
        assert app.quit_choice is None


def test_the_choice_reaches_the_agent(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    detached: list[int] = []

    def detach(pid: int) -> int:
        detached.append(pid)
        return 0

    monkeypatch.setattr(attach_command, "detach", detach)
    assert after_attached_quit(QuitChoice.DETACH, 4242, RECORDING) == 0
    assert detached == [4242]
    assert after_attached_quit(QuitChoice.LEAVE, 4242, RECORDING) == 0
    assert detached == [4242]
    assert capsys.readouterr().err == (
        f"memtui: the agent in pid 4242 keeps recording to {RECORDING}; memtui detach 4242 "
        "stops it\n"
    )


def test_ctrl_c_quits_a_replay(tui: Any, builder: ModuleType) -> None:
    """Textual's own Ctrl+C only says "press ctrl+q"; in memtui it quits, as q does."""
    app = MemtuiApp(tui.source(builder.demo_messages(), live=False))

    async def scenario() -> None:
        async with app.run_test() as pilot:
            await tui.settle(pilot, screen=False)
            await pilot.press("ctrl+c")
            await pilot.pause()
            assert not app.is_running

    asyncio.run(scenario())
    assert app.return_value == 0
