"""Many ranks: `memtui run -o DIR -- torchrun ...` records every rank, not the launcher."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI
from rich.text import Text

from memtui_agent.startup.autostart import is_launcher, record_path_for_rank

pytestmark = pytest.mark.slow  # every test here starts a torch job in a fresh interpreter

DDP_JOB = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
ddp = DDP(model)
opt = torch.optim.AdamW(ddp.parameters())
for step in range(3):
    opt.zero_grad()
    ddp(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()
dist.destroy_process_group()
"""


def test_launcher_detection_and_per_rank_names(tmp_path: Path) -> None:
    assert is_launcher(["/venv/bin/torchrun", "--nproc-per-node", "2", "x.py"])
    assert is_launcher(["/site-packages/torch/distributed/run.py", "x.py"])
    assert not is_launcher(["train.py"])
    assert record_path_for_rank(str(tmp_path), {"RANK": "3"}) == str(tmp_path / "rank-3.memtui")
    assert record_path_for_rank(str(tmp_path / "a.memtui"), {"RANK": "3"}) == str(
        tmp_path / "a.memtui"
    )


def test_torchrun_ddp_session_has_one_exact_recording_per_rank(
    tmp_path: Path, torchrun_session: Any
) -> None:
    ranks, _ = torchrun_session(DDP_JOB, folder_exists=True)
    weights = (64 * 128 + 128 + 128 * 8 + 8) * 4
    for label in ("0", "1"):
        rank = ranks[label]
        assert [step["step"] for step in rank["steps"]] == [1, 2, 3]
        end = rank["steps"][-1]["end"]
        assert end["weights"] == weights
        assert end["gradients"] == weights  # DDP's gradients counted once
        assert end["optimizer_state"] == 2 * weights + 4 * 4  # AdamW: 2 moments, 4 step tensors
        assert rank["exit"]["status"] == "ok"
    text = subprocess.run(
        [*MEMTUI, "report", str(tmp_path / "session")],
        capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert "session of 2 rank(s)" in text and "imbalance" in text


def test_replay_of_a_session_switches_ranks_with_r(tmp_path: Path) -> None:
    """Two rank recordings (the second holding twice the weights): `r` moves between them and
    the imbalance line names the heaviest rank."""
    import asyncio

    from memtui.commands.tui_commands import session_sources
    from memtui.tui.app import MemtuiApp
    from memtui.tui.ranks import RanksTable
    from memtui.tui.widgets import NotesLine, PilesPanel
    from memtui_protocol import schema, wire
    from memtui_protocol.schema import Pile

    for rank, weights in (("0", 1000), ("1", 2000)):
        piles = schema.Piles(weights, 0, 0, 0)
        messages: list[schema.Message] = [
            schema.Hello(
                format_version=schema.FORMAT_VERSION,
                agent_version="t",
                pid=1,
                argv=["train.py"],
                started="2026-11-29T09:00:00+00:00",
                started_unix=0.0,
                rank=int(rank),
            ),
            schema.Step(step=1, t_start=0, t_end=1, end=piles, max=piles, peak=piles),
            schema.End(time=2.0, status="ok", code=0),
        ]
        (tmp_path / f"rank-{rank}.memtui").write_bytes(
            wire.preamble() + b"".join(wire.encode(m) for m in messages)
        )
    ranks = session_sources(tmp_path)
    app = MemtuiApp(next(iter(ranks.values())), ranks=ranks)

    async def scenario() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            for _ in range(8):
                await pilot.pause(0.05)
                app.refresh_view()
            panel = app.query_one(PilesPanel)
            assert app.selected == "0" and panel.view is not None
            assert panel.view.rows[0].at_peak == 1000
            notes = app.query_one(NotesLine).view
            assert notes is not None
            assert "weights 2.00x (heaviest rank 1)" in " ".join(notes.notes)
            assert "gradients equal" in " ".join(notes.notes)
            table = app.query_one(RanksTable)
            assert table.display and table.row_count == 2
            assert table.view is not None and table.view.shown == "0"
            entries = table.view.rows
            assert [row.piles[0] for row in entries] == [
                (Pile.WEIGHTS, 1000),
                (Pile.WEIGHTS, 2000),
            ]
            assert Pile.WEIGHTS in entries[1].heaviest  # marked as the heaviest rank
            assert Pile.WEIGHTS not in entries[0].heaviest
            assert str(table.get_row_at(0)[0]).startswith("▶")
            await pilot.press("r")
            assert app.selected == "1"
            shown = app.query_one(PilesPanel).view
            assert shown is not None and shown.rows[0].at_peak == 2000
            await pilot.pause(0.3)
            assert str(table.get_row_at(1)[0]).startswith("▶")
            assert not str(table.get_row_at(0)[0]).startswith("▶")

    asyncio.run(scenario())


def test_the_view_model_owns_every_rank_and_emits_one_view_state() -> None:
    """No widget or app state: ranks, the shown rank, the job's exit all live in the model."""
    from memtui.model.job_state import JobState
    from memtui.model.view_model import ViewModel
    from memtui_protocol import schema
    from memtui_protocol.schema import ExitStatus

    model = ViewModel({"0": ("rank-0", True), "1": ("rank-1", True)})
    for rank, weights in (("0", 1000), ("1", 3000)):
        piles = schema.Piles(weights, 0, 0, 0)
        hello = schema.Hello(
            format_version=schema.FORMAT_VERSION,
            agent_version="t",
            pid=1,
            argv=["train.py"],
            started="2026-11-29T09:00:00+00:00",
            started_unix=0.0,
            rank=int(rank),
        )
        step = schema.Step(step=1, t_start=0, t_end=1, end=piles, max=piles, peak=piles)
        model.ingest(rank, [hello, step])
    before = model.version
    view = model.view_state(timeline_width=40)
    assert view.ranks.shown == "0" and [row.label for row in view.ranks.rows] == ["0", "1"]
    assert "weights 3.00x (heaviest rank 1)" in " ".join(view.notes.notes)
    model.next_rank()
    assert model.version != before
    assert model.view_state(timeline_width=40).ranks.shown == "1"
    model.source_ended("0", None)
    model.job_exited(143, stopped=True)
    rows = model.view_state(timeline_width=40).ranks.rows
    assert rows[0].state == "stopped from memtui (SIGTERM) (exit 143)"
    shown = model.view_state(timeline_width=40).header
    assert (shown.status, shown.ending) == (JobState.LIVE, None)  # rank 1 still streams
    model.source_ended("1", "the job closed its socket")
    shown = model.view_state(timeline_width=40).header
    assert (shown.status, shown.ending) == (JobState.ENDED, ExitStatus.STOPPED)


def test_attach_groups_the_ranks_of_one_job() -> None:
    """Sidecars of one `memtui run` session (same token, with ranks) become one attach entry."""
    from memtui.commands.tui_commands import group_ranks

    sidecars: list[dict[str, Any]] = [
        {"pid": 11, "rank": 1, "session": "s1", "socket": "/r/11.sock", "started_unix": 5.0},
        {"pid": 10, "rank": 0, "session": "s1", "socket": "/r/10.sock", "started_unix": 5.0},
        {"pid": 20, "rank": None, "session": "s2", "socket": "/r/20.sock", "started_unix": 1.0},
    ]
    jobs = group_ranks(sidecars)
    assert [job["pid"] for job in jobs] == [20, 10]
    assert [member["pid"] for member in jobs[1]["ranks"]] == [10, 11]
    assert "ranks" not in jobs[0]


def test_launchers_get_a_session_folder_and_ranks_never_share_a_file(tmp_path: Path) -> None:
    from memtui.commands.run_command import UsageError, build_job, launches_ranks
    from memtui.commands.tui_commands import local_ranks

    assert launches_ranks(["torchrun", "--nproc-per-node", "2", "t.py"], None)
    assert launches_ranks(["python", "-m", "torch.distributed.run", "t.py"], None)
    assert launches_ranks([], "torch.distributed.run")
    assert not launches_ranks(["python", "t.py"], None)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    job = build_job([torchrun, "x.py"], None, str(tmp_path / "new"), False, None)
    assert job.recording == (tmp_path / "new").resolve() and job.recording.is_dir()
    (tmp_path / "old.memtui").write_bytes(b"")
    try:
        build_job([torchrun, "x.py"], None, str(tmp_path / "old.memtui"), False, None)
    except UsageError as exc:
        assert "needs a session folder" in str(exc)
    else:
        raise AssertionError("a file given to a launcher must be refused")
    assert list(local_ranks(["torchrun", "--nproc-per-node", "4", "t.py"])) == [0, 1, 2, 3]
    assert list(local_ranks(["torchrun", "--nproc_per_node=2", "--node_rank=1", "t.py"])) == [2, 3]
    assert list(local_ranks(["torchrun", "--nproc-per-node=gpu", "t.py"])) == [0]
    # A launcher memtui did not recognise: ranks still make a folder rather than share a file.
    env = {"RANK": "1", "WORLD_SIZE": "2"}
    assert record_path_for_rank(str(tmp_path / "r.memtui"), env) == str(
        tmp_path / "r.memtui" / "rank-1.memtui"
    )
    assert record_path_for_rank(str(tmp_path / "old.memtui"), env) == str(
        tmp_path / "old.memtui-ranks" / "rank-1.memtui"
    )


def test_ranks_a_launcher_starts_itself_are_armed_but_helper_processes_are_not(
    tmp_path: Path,
) -> None:
    """Lightning's DDP launcher re-runs the script per rank with LOCAL_RANK set; those inherit
    the monitored parent's environment yet are ranks of their own. DataLoader workers keep
    their parent's LOCAL_RANK (or carry --multiprocessing-fork) and stay unmonitored."""
    from memtui_agent.startup.autostart import OWNER_RANK_VARIABLE, is_launched_rank

    owner_rank_0 = {"MEMTUI_AGENT_OWNER": "100", OWNER_RANK_VARIABLE: "0"}
    assert is_launched_rank(["train.py"], {**owner_rank_0, "LOCAL_RANK": "1"})
    assert not is_launched_rank(["train.py"], {**owner_rank_0, "LOCAL_RANK": "0"})
    assert not is_launched_rank(["train.py"], owner_rank_0)  # a plain child process
    spawned = ["-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"]
    assert not is_launched_rank(spawned, {**owner_rank_0, "LOCAL_RANK": "1"})
    owner_rank_1 = {"MEMTUI_AGENT_OWNER": "101", OWNER_RANK_VARIABLE: "1"}
    assert not is_launched_rank(["train.py"], {**owner_rank_1, "LOCAL_RANK": "1"})
    # Rank 0 already writes the file: a rank that only has LOCAL_RANK records beside it.
    (tmp_path / "run.memtui").write_bytes(b"")
    env = {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    assert record_path_for_rank(str(tmp_path / "run.memtui"), env) == str(
        tmp_path / "run.memtui-ranks" / "rank-1.memtui"
    )


def test_table_columns_grow_when_live_values_widen() -> None:
    """Rows first shown before any step ("-") must not truncate the sizes that follow."""
    import asyncio

    from textual.app import App, ComposeResult
    from textual.widgets import DataTable

    from memtui.tui.widgets import sync_rows

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield DataTable()

    async def scenario() -> None:
        app = One()
        async with app.run_test(size=(80, 10)) as pilot:
            table = app.query_one(DataTable)
            table.add_columns("rank", "weights")
            sync_rows(table, [("0", (Text("0"), Text("-")))])
            await pilot.pause()
            sync_rows(table, [("0", (Text("0"), Text("1023.99 MiB")))])
            await pilot.pause()
            assert table.ordered_columns[1].content_width >= len("1023.99 MiB")

    asyncio.run(scenario())


def test_processes_in_a_session_folder_get_their_own_index(tmp_path: Path) -> None:
    """Non-rank processes of one session folder (a `-- COMMAND`'s interpreters) are numbered in
    the order their agents start; an index is never handed out twice (issue 14, D2)."""
    from memtui.reports.rank_report import session_files

    paths = [record_path_for_rank(str(tmp_path), {}) for _ in range(3)]
    assert paths == [str(tmp_path / f"proc-{index}.memtui") for index in range(3)]
    for path in paths:
        assert path is not None
        Path(path).write_bytes(b"")
    (tmp_path / "rank-1.memtui").write_bytes(b"")
    labels = [label for label, _ in session_files(tmp_path)]
    assert labels == ["1", "proc-0", "proc-1", "proc-2"]
