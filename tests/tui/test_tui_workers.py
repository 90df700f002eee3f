"""The screen, driven through Textual's pilot: the DataLoader workers in "Where the bytes are"
(a row beside the host levels, their growth as its gap) and their leak among the leak rows.

The recording is the demo run (`make_fixture.demo_messages`) with workers sampled at each step,
growing 8 MiB a step, and a `workers` leak named at step 12.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import msgspec
from textual.pilot import Pilot

from memtui.tui.app import MemtuiApp
from memtui.tui.widgets import GapPanel
from memtui_protocol import schema
from memtui_protocol.schema import LeakKind

MiB = 1024 * 1024
NAMED_AT = 12


def _messages(builder: ModuleType) -> list[schema.Message]:
    out: list[schema.Message] = []
    for message in builder.demo_messages():
        if isinstance(message, schema.Step):
            growth = (message.step - 1) * 8 * MiB
            workers = schema.Workers(count=2, uss=20 * MiB + growth, growth=growth)
            leaks = (
                [
                    schema.Leak(
                        holder="dataset.items",
                        kind=LeakKind.WORKERS.value,
                        bytes=growth,
                        tensors=0,
                        per_step=8 * MiB,
                        first_step=1,
                        fix="keep the samples in one numpy array",
                    )
                ]
                if message.step == NAMED_AT
                else []
            )
            message = msgspec.structs.replace(message, workers=workers, leaks=leaks)
        out.append(message)
    return out


def test_the_gap_panel_shows_the_workers_and_their_leak(tui: Any, builder: ModuleType) -> None:
    app = MemtuiApp(tui.source(_messages(builder), live=False))

    async def body(pilot: Pilot[Any]) -> None:
        app.session.jump_to_step(NAMED_AT)
        app.refresh_view()
        await pilot.pause()
        lines = [" ".join(line.split()) for line in tui.plain(app.query_one(GapPanel)).splitlines()]
        row = next(line for line in lines if line.startswith("DataLoader workers"))
        assert row.startswith("DataLoader workers 108.00 MiB +88.00 MiB USS of 2 worker")
        assert any(
            line == "dataset.items 88.00 MiB +8.00 MiB step 1 workers' USS" for line in lines
        ), "\n".join(lines)

    tui.drive(app, body)
