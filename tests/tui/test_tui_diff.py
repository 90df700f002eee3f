"""`memtui diff A B --tui` (issue 38, item 4): the diff's rows in a DataTable under the runs'
names, the same rows the text diff prints; `u` switches the units. One SVG snapshot
(`pytest tests/tui/test_tui_diff.py --snapshot-update` regenerates it; look at it first)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from recording_files import hello
from textual.widgets import DataTable, Static

from memtui.model.recording import Recording, apply
from memtui.model.run_diff import RunDiff, diff_runs
from memtui.reports.diff_report import RunName, diff_rows
from memtui.tui.diff_app import DiffApp
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind

KIB = 1024
NAMES = (RunName("runs/fp32-batch4", "0", 2), RunName("runs/bf16-batch8.memtui"))


def run(activations: int, dtype: str, steps: range, alerts: list[schema.Alert]) -> Recording:
    """A run of `steps` whose activations peak at `activations` bytes of `dtype`, in two
    modules (`fc1` a quarter, `act` the rest), with `alerts` at its first step."""
    recording = Recording(path=Path("run.memtui"), hello=hello())
    apply(recording, schema.Names("module", 0, ["fc1", "act"]))
    weights = 72 * KIB
    for number in steps:
        high = schema.Piles(weights, weights, 2 * weights, activations)
        apply(
            recording,
            schema.Step(
                number,
                float(number),
                number + 0.5,
                end=schema.Piles(weights, weights, 2 * weights, 0),
                max=high,
                peak=high,
                dtypes={
                    "weights": {"float32": schema.DtypeStat(weights, 4)},
                    "activations": {dtype: schema.DtypeStat(activations, 3)},
                },
                top_activations=[
                    schema.ModuleBytes(1, activations * 3 // 4),
                    schema.ModuleBytes(0, activations // 4),
                ],
                alerts=alerts if number == steps[0] else [],
            ),
        )
    return recording


def the_diff() -> RunDiff:
    a = run(8 * KIB, "float32", range(1, 7), [])
    nan = schema.Alert(AlertKind.NONFINITE_LOSS.value, "the loss is NaN", where="fc1")
    b = run(16 * KIB, "bfloat16", range(3, 11), [nan])
    return diff_runs(a, b)


def cells(table: DataTable[Any], key: str) -> list[str]:
    return [str(cell) for cell in table.get_row(key)]


def test_the_table_holds_the_diffs_rows_under_the_runs_names() -> None:
    asyncio.run(_the_table_holds_the_diffs_rows())


async def _the_table_holds_the_diffs_rows() -> None:
    diff = the_diff()
    app = DiffApp(diff, NAMES)
    async with app.run_test(size=(140, 40)) as pilot:
        header = str(app.query_one("#runs", Static).render())
        assert "A: runs/fp32-batch4 (rank 0; 2 recordings in the folder)" in header
        assert "B: runs/bf16-batch8.memtui" in header
        table = app.query_one("#diff", DataTable)
        rows = diff_rows(diff)
        sections = {row.section for row in rows}
        assert table.row_count == len(rows) + len(sections)
        assert cells(table, "pile-activations-peak") == [
            "  activations: highest",
            "8.00 KiB (8,192 B)",
            "16.00 KiB (16,384 B)",
            "+8.00 KiB (+8,192 B, +100.00%)",
        ]
        assert cells(table, "steps")[1:] == ["6 (1-6)", "8 (3-10)", "4 in common: steps 3-6"]
        dtypes = [cells(table, row.key) for row in rows if row.key.startswith("dtype-")]
        assert ["  activations: bfloat16", "appeared in B"] in [[c[0], c[3]] for c in dtypes]
        assert ["  activations: float32", "vanished in B"] in [[c[0], c[3]] for c in dtypes]
        new = [cells(table, row.key) for row in rows if row.key.startswith("new-")]
        assert new == [["  error nonfinite_loss [fc1]", "none", "1 from step 3", "new in B"]]
        await pilot.press("u")
        assert cells(table, "pile-activations-peak")[2] == "16.38 kB (16,384 B)"


def test_paths_are_shown_literally_never_as_markup() -> None:
    async def scenario() -> str:
        app = DiffApp(the_diff(), (RunName("runs/[bold]a[/bold]"), RunName("b")))
        async with app.run_test(size=(120, 30)):
            return str(app.query_one("#runs", Static).render())

    assert "A: runs/[bold]a[/bold]" in asyncio.run(scenario())


def test_the_diff_screen(snap_compare: Any) -> None:
    assert snap_compare(DiffApp(the_diff(), NAMES), terminal_size=(160, 40))
