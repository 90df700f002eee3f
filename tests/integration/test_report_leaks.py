"""Leaks in the one fold: `report --json`'s `leaks` (and each step's own), the text report's
"Leaks" section, and the screen's leaks as of the cursor step, all read from `recording.leaks`.

The recording is the fixture run with censuses at steps 8, 12 and 20 and a final count in the
End (`make_fixture.leaking_messages`); one test runs a growing job for real.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
from cli_harness import MEMTUI
from repo_paths import FIXTURES

from memtui.input.sources import ReplaySource
from memtui.model.leaks import MAX_HISTORY, MAX_HOLDERS, LeakRow, leak_holding
from memtui.model.recording import Recording, read_recording
from memtui.model.session import Session
from memtui.reports.report import build_report, render_text
from memtui.reports.report_format import strict_json
from memtui_protocol import schema
from memtui_protocol.schema import LeakKind

KiB = 1024
GROWING = FIXTURES / "growing"


def _recording(messages: list[schema.Message]) -> Recording:
    session = Session(source_label="fixture", live=False)
    session.ingest(messages)
    assert session.recording is not None
    return session.recording


def _leaks(document: dict[str, Any]) -> list[tuple[str, str, int, int, int, int]]:
    return [
        (
            leak["holder"],
            leak["kind"],
            leak["bytes"],
            leak["tensors"],
            leak["per_step"],
            leak["first_step"],
        )
        for leak in document["leaks"]
    ]


def test_the_report_lists_each_holder_once_with_the_jobs_last_count(builder: ModuleType) -> None:
    """`leaks`: the End's count of each holder, largest first; a step's own `leaks` and
    `census` only on the steps whose close took one."""
    document = json.loads(strict_json(build_report(_recording(builder.leaking_messages()))))
    assert _leaks(document) == [
        (builder.GRAPH_HOLDER, "retained_graph", 9 * 32768, 1, 32768, 5),
        ("history", "tensors", 22 * 4096, 22, 4096, 3),
    ]
    steps = {entry["step"]: entry for entry in document["steps"]}
    assert "leaks" not in steps[8] and steps[8]["census"] == {
        "seconds": builder.CENSUS_SECONDS,
        "objects": 608,
        "complete": True,
        "stopped": None,
    }
    assert [leak["holder"] for leak in steps[12]["leaks"]] == ["history", builder.GRAPH_HOLDER]
    assert steps[20]["leaks"] == [
        {"holder": "history", "kind": "tensors", "bytes": 18 * 4096, "tensors": 18,
         "per_step": 4096, "first_step": 3, "graphs_not_known": 0, "fix": builder.LIST_FIX,
         "every": None, "nodes": 0, "nodes_per_step": 0},
    ]  # fmt: skip
    assert [leak["fix"] for leak in document["leaks"]] == [builder.GRAPH_FIX, builder.LIST_FIX]
    assert not any("leaks" in steps[n] or "census" in steps[n] for n in (1, 11, 13, 24))
    assert document["censuses"] == {
        "count": 3,
        "seconds": 0.15,  # rounded: a sum of floats
        "longest": builder.CENSUS_SECONDS,
        "objects": 620,
        "incomplete": 0,
        "errors": 0,
        "bounded": 0,
    }


def test_without_a_final_count_each_holder_is_its_latest_census(builder: ModuleType) -> None:
    """A job killed before its End: the list as step 20 counted it, the graphs as step 12 did."""
    document = build_report(_recording(builder.leaking_messages(with_end=False)))
    assert _leaks(document) == [
        (builder.GRAPH_HOLDER, "retained_graph", 8 * 32768, 1, 32768, 5),
        ("history", "tensors", 18 * 4096, 18, 4096, 3),
    ]


def test_a_job_without_leaks_reports_an_empty_list(builder: ModuleType) -> None:
    document = build_report(_recording(builder.demo_messages()))
    assert document["leaks"] == [] and document["censuses"] is None
    assert not any("leaks" in step or "census" in step for step in document["steps"])


def test_the_text_report_leads_with_the_leaks(builder: ModuleType) -> None:
    """After the exit line: each holder, its kind, bytes, tensors, growth, since when, the fix;
    then what the censuses cost (2.5% of the steps' time here: notable)."""
    lines = render_text(_recording(builder.leaking_messages())).splitlines()
    # Exit 0, but the job leaked: the exit line says its first error.
    assert lines[0] == "job exited (exit code 0) with an error: leak in history at step 12"
    assert lines[1:7] == [
        "Leaks (as the job ended): memory no pile holds, growing step after step",
        f"  {builder.GRAPH_HOLDER} (autograd graphs kept alive): 288.00 KiB in 1 tensor, "
        "growing 32.00 KiB per step since step 5",
        f"    fix: {builder.GRAPH_FIX}",
        "  history (tensors kept): 88.00 KiB in 22 tensors, growing 4.00 KiB per step since step 3",
        f"    fix: {builder.LIST_FIX}",
        "  censuses of live tensors: 3, 0.150 s in all (2.5% of the steps' time), the longest "
        "0.050 s; up to 620 objects visited",
    ]
    decimal = render_text(_recording(builder.leaking_messages()), binary=False)
    assert "history (tensors kept): 90.11 kB in 22 tensors, growing 4.10 kB per step" in decimal


def test_censuses_that_ended_early_say_why(builder: ModuleType) -> None:
    """A bound, an error inside the census: each step's `census` says which, and the text
    report counts them apart."""
    messages = builder.leaking_messages()
    ended = {
        8: schema.CensusCost(seconds=2.0, objects=1_000_000, complete=False, stopped="objects"),
        12: schema.CensusCost(seconds=0.01, objects=40, complete=False, stopped="error"),
    }
    messages = [
        msgspec.structs.replace(message, census=ended[message.step])
        if isinstance(message, schema.Step) and message.step in ended
        else message
        for message in messages
    ]
    recording = _recording(messages)
    document = json.loads(strict_json(build_report(recording)))
    steps = {entry["step"]: entry for entry in document["steps"]}
    assert steps[8]["census"]["stopped"] == "objects" and not steps[8]["census"]["complete"]
    assert steps[12]["census"]["stopped"] == "error"
    assert (document["censuses"]["incomplete"], document["censuses"]["errors"]) == (2, 1)
    assert document["censuses"]["bounded"] == 1
    line = next(line for line in render_text(recording).splitlines() if "censuses" in line)
    assert "1 stopped at their bound, 1 at an error inside them" in line


def test_a_holder_whose_graphs_are_partly_not_known_says_so(builder: ModuleType) -> None:
    """Graphs built while the agent's hooks were off: their saved bytes are not in `bytes`, and
    every reader says so rather than show that figure as the whole."""
    messages = builder.leaking_messages(with_end=False)
    partial = schema.Leak("val_total", "retained_graph", 8192, 1, 1024, 4, graphs_not_known=2)
    messages.append(msgspec.structs.replace(builder.make_step(25), leaks=[partial]))
    recording = _recording(messages)
    document = json.loads(strict_json(build_report(recording)))
    (entry,) = [e for e in document["leaks"] if e["holder"] == "val_total"]
    assert entry["graphs_not_known"] == 2 and entry["bytes"] == 8192
    text = render_text(recording)
    assert (
        "val_total (autograd graphs kept alive): 8.00 KiB in 1 tensor and 2 graphs whose saved "
        "tensors are not known (built while memtui's hooks were off), growing" in text
    )
    (row,) = [row for row in recording.leaks.latest() if row.holder == "val_total"]
    assert leak_holding(row) == "1 tensor + graph, 2 not known"


def test_the_fix_is_the_leaks_own_field_never_read_out_of_an_alert(builder: ModuleType) -> None:
    """The report shows `Leak.fix` whatever the alerts say: without any `leak` alert the fix is
    still there; a recording of an agent before the field (a fix only inside the alert's
    message) shows none, and `fix` is null, rather than text parsed out of a message."""
    without_alerts = [
        msgspec.structs.replace(
            message, alerts=[a for a in message.alerts if a.kind != schema.AlertKind.LEAK]
        )
        if isinstance(message, schema.Step)
        else message
        for message in builder.leaking_messages()
    ]
    text = render_text(_recording(without_alerts))
    assert f"    fix: {builder.GRAPH_FIX}" in text and f"    fix: {builder.LIST_FIX}" in text

    def unfixed(message: schema.Message) -> schema.Message:
        if isinstance(message, schema.Step | schema.End) and message.leaks:
            leaks = [msgspec.structs.replace(leak, fix=None) for leak in message.leaks]
            return msgspec.structs.replace(message, leaks=leaks)
        return message

    older = _recording([unfixed(message) for message in builder.leaking_messages()])
    assert any(item.kind == schema.AlertKind.LEAK for item in older.alerts)  # fix in its message
    assert "fix:" not in render_text(older)
    assert [entry["fix"] for entry in build_report(older)["leaks"]] == [None, None]


def test_no_leaks_no_section(builder: ModuleType) -> None:
    text = render_text(_recording(builder.demo_messages()))
    assert "Leaks" not in text and "census" not in text


def test_the_screen_shows_the_leaks_as_of_the_cursor_step(builder: ModuleType) -> None:
    """Before the first census that named them: none. Then each holder's latest census at or
    before the cursor; on the last step of a job that ended, the End's count, which is the
    report's."""
    session = Session(source_label="fixture", live=False)
    session.ingest(builder.leaking_messages())

    def shown(step: int) -> tuple[tuple[str, int, int | None], ...]:
        session.jump_to_step(step)
        gap = session.view_state().gap
        return tuple((row.holder, row.bytes, row.counted_at) for row in gap.leaks)

    assert shown(11) == ()
    assert shown(12) == ((builder.GRAPH_HOLDER, 8 * 32768, 12), ("history", 10 * 4096, 12))
    assert shown(23) == ((builder.GRAPH_HOLDER, 8 * 32768, 12), ("history", 18 * 4096, 20))
    assert not session.view_state().gap.leaks_final
    assert shown(24) == ((builder.GRAPH_HOLDER, 9 * 32768, None), ("history", 22 * 4096, None))
    assert session.view_state().gap.leaks_final
    assert session.recording is not None
    reported = build_report(session.recording)["leaks"]
    on_screen = [
        (row.holder, row.bytes, row.per_step, row.first_step)
        for row in session.view_state().gap.leaks
    ]
    assert on_screen == [
        (e["holder"], e["bytes"], e["per_step"], e["first_step"]) for e in reported
    ]


def test_leak_kinds_are_the_enum_and_a_newer_kind_is_kept(builder: ModuleType) -> None:
    newer = schema.Leak("cache", "pinned_host", 4096, 1, 4096, 2)
    messages = builder.leaking_messages(with_end=False)
    messages.append(msgspec.structs.replace(builder.make_step(25), leaks=[newer]))
    recording = _recording(messages)
    kinds = {row.holder: row.kind for row in recording.leaks.latest()}
    assert kinds["history"] is LeakKind.TENSORS
    assert kinds[builder.GRAPH_HOLDER] is LeakKind.RETAINED_GRAPH
    assert kinds["cache"] == "pinned_host"
    assert "cache (pinned_host): 4.00 KiB in 1 tensor" in render_text(recording)


def test_a_hostile_stream_of_leaks_stays_bounded(builder: ModuleType) -> None:
    """Every step names the schema's most leaks, new holders each time, and one holder on every
    step: the book keeps `MAX_HOLDERS` holders and `MAX_HISTORY` censuses of each."""
    messages: list[schema.Message] = [builder.hello()]
    for number in range(1, 3 * MAX_HISTORY // 2):
        holders = (
            [f"h{number}-{index}" for index in range(schema.MAX_ITEMS - 1)] if number <= 3 else []
        )
        found = [schema.Leak(holder, "tensors", 1, 1, 1, 1) for holder in ["kept", *holders]]
        messages.append(msgspec.structs.replace(builder.make_step(number), leaks=found))
    recording = _recording(messages)
    book = recording.leaks
    assert len(book.trails) == MAX_HOLDERS
    assert book.holders_dropped == 3 * (schema.MAX_ITEMS - 1) - (MAX_HOLDERS - 1)
    assert len(book.trails["kept"].rows) <= MAX_HISTORY
    last = 3 * MAX_HISTORY // 2 - 1
    shown = {row.holder: row for row in book.as_of(last, final=False)}
    assert shown["kept"] == LeakRow("kept", LeakKind.TENSORS, 1, 1, 1, 1, last)
    assert len(build_report(recording)["leaks"]) == MAX_HOLDERS


def test_a_dropped_holder_is_a_warning_of_the_reader(tmp_path: Path, builder: ModuleType) -> None:
    found = [schema.Leak(f"h{index}", "tensors", 1, 1, 1, 1) for index in range(schema.MAX_ITEMS)]
    messages = [builder.hello(), builder.make_step(1)]
    messages.append(
        msgspec.structs.replace(
            builder.make_step(2),
            leaks=[*found, schema.Leak("x", "tensors", 1, 1, 1, 1)][: schema.MAX_ITEMS],
        )
    )
    messages.append(
        msgspec.structs.replace(
            builder.make_step(3), leaks=[schema.Leak("late", "tensors", 1, 1, 1, 1)]
        )
    )
    path = tmp_path / "run.memtui"
    path.write_bytes(builder.encode_recording(messages))
    recording = read_recording(path)
    assert recording.warning == f"1 leak entries beyond {MAX_HOLDERS} holders not kept"


@pytest.mark.slow
def test_a_real_leaking_job_reads_the_same_in_the_report_and_on_screen(tmp_path: Path) -> None:
    """`memtui run --headless` of a job that keeps its logits in a list, in a fresh interpreter:
    the report names the list with the job's own count (within 10%), the text report leads with
    it, and the screen's last step shows exactly the report's figures."""
    output = tmp_path / "run.memtui"
    memtui = list(MEMTUI)
    run = subprocess.run(
        [*memtui, "run", "--headless", "-o", str(output), "logits_list.py", "40"],
        cwd=GROWING, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    counted = json.loads(
        next(line[4:] for line in run.stdout.splitlines() if line.startswith("JOB "))
    )
    report = subprocess.run(
        [*memtui, "report", str(output), "--json"], capture_output=True, text=True, timeout=60
    )
    assert report.returncode == 0, report.stderr
    document = json.loads(report.stdout)
    [found] = document["leaks"]
    assert (found["holder"], found["kind"]) == ("history", "tensors")
    assert abs(found["bytes"] - counted["bytes"]) <= 0.1 * counted["bytes"]
    assert found["first_step"] <= counted["first_step"] + 1 and found["per_step"] > 0
    text = subprocess.run(
        [*memtui, "report", str(output)], capture_output=True, text=True, timeout=60
    ).stdout.splitlines()
    assert text[1].startswith("Leaks (as the job ended)") and text[2].startswith(
        "  history (tensors kept): "
    )
    session = Session(source_label=str(output), live=False)
    batches: list[list[schema.Message]] = []
    assert ReplaySource(output).run(batches.append, threading.Event()) is None
    for batch in batches:  # what `memtui replay` feeds the screen
        session.ingest(batch)
    gap = session.view_state().gap
    assert gap.leaks_final
    on_screen = [
        (r.holder, str(r.kind), r.bytes, r.tensors, r.per_step, r.first_step) for r in gap.leaks
    ]
    assert on_screen == _leaks(document)


def _with_kept(
    messages: list[schema.Message], kept: dict[int, schema.Kept]
) -> list[schema.Message]:
    return [
        msgspec.structs.replace(message, kept=kept[message.step])
        if isinstance(message, schema.Step) and message.step in kept
        else message
        for message in messages
    ]


def test_a_steps_kept_figure_is_in_its_json_entry_and_the_last_one_in_the_text(
    builder: ModuleType,
) -> None:
    """`kept` only on the steps that took a census, as recorded; the text report names the last
    one's total and largest holders with its step; a total not known says so."""
    holders = [schema.KeptHolder("ema_list", 88104, 6), schema.KeptHolder("inputs", 2048, 1)]
    first = schema.Kept(bytes=90152, tensors=7, holders=holders)
    later = schema.Kept(bytes=None, tensors=7, holders=holders)
    document = build_report(_recording(_with_kept(builder.demo_messages(), {3: first})))
    steps = {entry["step"]: entry for entry in json.loads(strict_json(document))["steps"]}
    assert steps[3]["kept"] == {
        "bytes": 90152,
        "tensors": 7,
        "holders": [
            {"holder": "ema_list", "bytes": 88104, "tensors": 6},
            {"holder": "inputs", "bytes": 2048, "tensors": 1},
        ],
    }
    assert not any("kept" in entry for number, entry in steps.items() if number != 3)
    text = render_text(_recording(_with_kept(builder.demo_messages(), {3: first})))
    assert (
        "kept outside the piles at step 3 (its census): 88.04 KiB in 7 tensors; "
        "ema_list 86.04 KiB, inputs 2.00 KiB"
    ) in text.splitlines()
    text = render_text(_recording(_with_kept(builder.demo_messages(), {3: first, 9: later})))
    assert "kept outside the piles at step 9 (its census): a total not known" in text
    assert "kept outside" not in render_text(_recording(builder.demo_messages()))
