"""`memtui diff`'s model and renderers (issue 38, item 4), on recordings built in memory: the
piles' highs and ends with a pile not known, the peak as the report states it, the modules that
moved, dtypes that appeared or vanished, alerts and leaks matched by what they name (never by
step), and runs with no steps in common."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from recording_files import hello

from memtui.model.recording import Recording, apply
from memtui.model.run_diff import (
    Change,
    DtypeShift,
    ModuleKey,
    ModuleShift,
    Side,
    diff_runs,
)
from memtui.reports.diff_report import (
    NOT_LISTED,
    RunName,
    change_cell,
    diff_document,
    diff_rows,
    render_diff_text,
)
from memtui.reports.report import build_report
from memtui.reports.report_format import strict_json
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, LeakKind, Pile

KIB = 1024
NAMES = (RunName("a.memtui"), RunName("b.memtui"))


def piles(activations: int | None, weights: int = 100 * KIB) -> schema.Piles:
    return schema.Piles(weights, weights, 2 * weights, activations)


def step(
    number: int,
    activations: int | None = 10 * KIB,
    weights: int = 100 * KIB,
    **fields: object,
) -> schema.Step:
    """A step whose activations peak at `activations` (None: not known) and are freed by its
    close; fp32 throughout unless `fields` say otherwise."""
    known = activations is not None
    defaults: dict[str, object] = {
        "dtypes": {
            "weights": {"float32": schema.DtypeStat(weights, 4)},
            "activations": {"float32": schema.DtypeStat(activations or 0, 3)} if known else {},
        },
        "top_activations": [schema.ModuleBytes(0, (activations or 0) // 2)] if known else [],
        "activations_measured": known,
    }
    return schema.Step(
        number,
        float(number),
        number + 0.5,
        end=piles(0 if known else None, weights),
        max=piles(activations, weights),
        peak=piles(activations, weights),
        **(defaults | fields),  # type: ignore[arg-type]
    )


def recording(*messages: schema.Message, names: list[str] | None = None) -> Recording:
    """The fold of `messages` after a hello and the module names (`encoder`, `decoder`)."""
    folded = Recording(path=Path("run.memtui"), hello=hello())
    apply(folded, schema.Names("module", 0, names or ["encoder", "decoder"]))
    for message in messages:
        apply(folded, message)
    return folded


def test_a_pile_not_known_in_one_run_is_not_known_never_a_change_from_zero() -> None:
    a = recording(step(1), step(2, activations=12 * KIB))
    b = recording(step(1, activations=None), step(2, activations=None))
    diff = diff_runs(a, b)
    activations = next(p for p in diff.piles if p.pile is Pile.ACTIVATIONS)
    assert activations.peak == Change(12 * KIB, None)
    assert activations.peak.delta is None and activations.peak.percent is None
    assert activations.end == Change(0, None)
    weights = next(p for p in diff.piles if p.pile is Pile.WEIGHTS)
    assert weights.peak == Change(100 * KIB, 100 * KIB) and weights.peak.delta == 0
    text = render_diff_text(diff, NAMES)
    line = next(line for line in text.splitlines() if "activations: highest" in line)
    assert line.split()[-2:] == ["not", "known"] and "12.00 KiB (12,288 B)" in line
    document = json.loads(strict_json(diff_document(diff, NAMES)))
    assert document["piles"]["activations"]["peak"] == {
        "a": 12 * KIB, "b": None, "change": None, "percent": None
    }  # fmt: skip
    # B's peak is not known either (a total without its activations is none), nor its modules.
    assert diff.peak.bytes.b is None and document["peak"]["change"] is None
    assert diff.modules_known == {Side.A: True, Side.B: False} and diff.modules == ()


def test_the_peaks_and_piles_are_the_reports_own_figures() -> None:
    ddp = schema.Distributed(ddp_buckets=64 * KIB)  # the peak holds DDP's buckets too
    a = recording(step(1), step(2, activations=30 * KIB), step(3))
    b = recording(step(1, distributed=ddp), step(2, activations=20 * KIB), step(3))
    diff = diff_runs(a, b)
    for run, side in ((a, diff.peak.bytes.a), (b, diff.peak.bytes.b)):
        report = build_report(run)
        assert side == max(entry["peak"]["held"] for entry in report["steps"])
    assert (diff.peak.a_step, diff.peak.b_step) == (2, 1)
    assert diff.peak.bytes.delta == (400 + 10 + 64 - 400 - 30) * KIB
    activations = next(p for p in diff.piles if p.pile is Pile.ACTIVATIONS)
    assert activations.peak == Change(30 * KIB, 20 * KIB)
    assert activations.peak.percent is not None and round(activations.peak.percent, 2) == -33.33
    assert "-10.00 KiB (-10,240 B, -33.33%)" in render_diff_text(diff, NAMES)


def test_a_change_from_zero_has_no_percentage() -> None:
    assert Change(0, 5 * KIB).percent is None
    assert change_cell(Change(0, 5 * KIB)) == "+5.00 KiB (+5,120 B, from 0)"
    assert change_cell(Change(None, 5 * KIB)) == "not known"
    assert change_cell(Change(3, 3)) == "no change"


def test_modules_that_moved_beyond_the_threshold_and_those_in_one_run_only() -> None:
    def modules(*sizes: tuple[int, int]) -> list[schema.ModuleBytes]:
        return [schema.ModuleBytes(m, size) for m, size in sizes]

    a = recording(
        step(1, top_activations=modules((0, 8 * KIB), (1, 1000), (2, 4 * KIB))),
        names=["enc", "dec", "head"],
    )
    b = recording(
        step(1, top_activations=modules((0, 16 * KIB), (1, 1005), (3, 2 * KIB))),
        names=["enc", "dec", "head", "pool"],
    )
    changes = diff_runs(a, b).modules
    assert [(c.module.shown, c.shift, c.bytes) for c in changes] == [
        ("enc", ModuleShift.MOVED, Change(8 * KIB, 16 * KIB)),  # dec moved 0.5%: not listed
        ("head", ModuleShift.ONLY_A, Change(4 * KIB, None)),
        ("pool", ModuleShift.ONLY_B, Change(None, 2 * KIB)),
    ]
    rows = {row.what: row for row in diff_rows(diff_runs(a, b))}
    assert rows["module head"].b == NOT_LISTED and rows["module pool"].a == NOT_LISTED


def test_two_modules_of_one_name_are_told_apart_by_their_order() -> None:
    # Two root models of one class name their trees alike; ids differ between runs.
    a = recording(
        step(1, top_activations=[schema.ModuleBytes(0, KIB), schema.ModuleBytes(1, 9 * KIB)]),
        names=["fc", "fc"],
    )
    b = recording(
        step(1, top_activations=[schema.ModuleBytes(5, KIB), schema.ModuleBytes(9, 3 * KIB)]),
        names=[*"abcde", "fc", "g", "h", "i", "fc"],
    )
    changes = diff_runs(a, b).modules
    assert [(c.module, c.bytes) for c in changes] == [
        (ModuleKey("fc", 2), Change(9 * KIB, 3 * KIB))
    ]
    assert changes[0].module.shown == "fc#2"


def test_dtypes_that_appeared_or_vanished_per_pile() -> None:
    bf16 = {
        "weights": {"float32": schema.DtypeStat(100 * KIB, 4)},
        "activations": {
            "bfloat16": schema.DtypeStat(6 * KIB, 2),
            "float32": schema.DtypeStat(KIB, 1),
        },
    }
    a = recording(step(1), step(2))
    b = recording(step(1, dtypes=bf16), step(2))
    changes = diff_runs(a, b).dtypes
    assert [(c.pile, c.dtype, c.shift, c.bytes) for c in changes] == [
        (Pile.ACTIVATIONS, "bfloat16", DtypeShift.APPEARED, 6 * KIB)
    ]
    back = diff_runs(b, a).dtypes
    assert [(c.dtype, c.shift) for c in back] == [("bfloat16", DtypeShift.VANISHED)]


def test_a_pile_a_run_never_states_has_its_dtypes_not_compared() -> None:
    a = recording(step(1))
    b = recording(step(1, activations=None))
    diff = diff_runs(a, b)
    # B lists no activation dtype: not known, so nothing "vanished".
    assert diff.dtypes == () and diff.dtypes_not_known == {Pile.ACTIVATIONS: (Side.B,)}
    document = json.loads(strict_json(diff_document(diff, NAMES)))
    assert document["dtypes_not_known"] == {"activations": ["b"]}


def test_alerts_are_matched_by_kind_and_what_they_name_not_by_step() -> None:
    def alert(kind: AlertKind, where: str | None = None) -> schema.Alert:
        return schema.Alert(kind.value, "message", where=where)

    a = recording(
        step(7, alerts=[alert(AlertKind.NONFINITE_LOSS), alert(AlertKind.DIVERGENCE)]),
    )
    b = recording(
        step(9, alerts=[alert(AlertKind.NONFINITE_LOSS)]),
        step(10, alerts=[alert(AlertKind.LEAK, "history"), alert(AlertKind.LEAK, "history")]),
        step(11, alerts=[alert(AlertKind.NONFINITE_GRADIENT, "encoder.weight")]),
    )
    diff = diff_runs(a, b)
    assert [(c.key.kind, c.key.names, c.count, c.first_step) for c in diff.alerts_new] == [
        (AlertKind.LEAK, "history", 2, 10),
        (AlertKind.NONFINITE_GRADIENT, "encoder.weight", 1, 11),
    ]
    assert [(c.key.kind, c.first_step) for c in diff.alerts_gone] == [(AlertKind.DIVERGENCE, 7)]
    document = json.loads(strict_json(diff_document(diff, NAMES)))
    assert document["alerts"]["new_in_b"][0] == {
        "kind": "leak", "severity": "error", "names": "history", "count": 2, "first_step": 10
    }  # fmt: skip


def test_leaks_new_in_b_by_holder_and_kind() -> None:
    def leak(holder: str, kind: LeakKind, size: int) -> schema.Leak:
        return schema.Leak(holder, kind.value, size, 4, size // 4, 2)

    census = schema.CensusCost(seconds=0.01, objects=100)
    a = recording(step(5, leaks=[leak("cache", LeakKind.TENSORS, KIB)], census=census))
    b = recording(
        step(5, leaks=[leak("cache", LeakKind.TENSORS, 2 * KIB)], census=census),
        step(6, leaks=[leak("history", LeakKind.RETAINED_GRAPH, 40 * KIB)], census=census),
    )
    diff = diff_runs(a, b)
    assert [(leak.holder, leak.kind, leak.bytes) for leak in diff.leaks_new] == [
        ("history", LeakKind.RETAINED_GRAPH, 40 * KIB)
    ]
    assert diff.leaks_gone == ()
    assert "leak history (retained_graph)" in render_diff_text(diff, NAMES)


def test_steps_are_matched_by_the_jobs_step_numbers() -> None:
    a = recording(*(step(n) for n in range(1, 6)))
    b = recording(*(step(n, activations=20 * KIB if n == 4 else 10 * KIB) for n in range(3, 9)))
    steps = diff_runs(a, b).steps
    assert (steps.a, steps.b, steps.common) == ((1, 2, 3, 4, 5), tuple(range(3, 9)), (3, 4, 5))
    assert steps.largest_peak_change == (4, Change(410 * KIB, 420 * KIB))
    text = render_diff_text(diff_runs(a, b), NAMES)
    assert "3 in common: steps 3-5" in text and "peak at step 4 (moved most)" in text


def test_runs_with_no_steps_in_common_say_so() -> None:
    a = recording(*(step(n) for n in range(1, 4)))
    b = recording(*(step(n) for n in range(500, 503)))  # an agent attached at step 500
    diff = diff_runs(a, b)
    assert diff.steps.common == () and diff.steps.largest_peak_change is None
    assert "no steps in common" in render_diff_text(diff, NAMES)
    document = json.loads(strict_json(diff_document(diff, NAMES)))
    assert document["steps"] | {"largest_peak_change": None} == {
        "a": 3, "b": 3, "common": 0, "common_first": None, "common_last": None,
        "common_ranges": "", "largest_peak_change": None,
    }  # fmt: skip
    assert document["runs"]["b"]["first_step"] == 500


def test_a_run_without_steps_knows_no_figure() -> None:
    diff = diff_runs(recording(step(1)), recording())
    assert all(p.peak.b is None and p.end.b is None for p in diff.piles)
    assert diff.peak.bytes == Change(410 * KIB, None)


def test_the_json_names_every_section_with_its_format() -> None:
    diff = diff_runs(recording(step(1)), recording(step(1, activations=20 * KIB)))
    document = msgspec.to_builtins(diff_document(diff, (RunName("runs/a", "0", 2), NAMES[1])))
    assert document["format"] == "memtui-diff" and document["version"] == 1
    assert set(document) == {
        "format", "version", "runs", "steps", "peak", "piles", "modules", "dtypes",
        "dtypes_not_known", "alerts", "leaks",
    }  # fmt: skip
    assert set(document["piles"]) == {pile.value for pile in Pile}
    assert document["runs"]["a"]["rank"] == "0"
    assert RunName("runs/a", "0", 2).shown == "runs/a (rank 0; 2 recordings in the folder)"


def test_every_key_of_the_json_is_in_its_contract() -> None:
    """docs/diff.md's JSON block names every key `memtui diff --json` writes (a key added
    without its line there fails this test)."""
    from repo_paths import REPO

    from memtui.reports import diff_report

    contract = (REPO / "docs" / "diff.md").read_text().split("## `memtui diff A B --json`")[1]
    structs = [
        value
        for value in vars(diff_report).values()
        if isinstance(value, type)
        and issubclass(value, msgspec.Struct)
        and value.__module__ == diff_report.__name__
    ]
    assert len(structs) >= 10
    missing = {
        f"{struct.__name__}.{name}"
        for struct in structs
        for name in struct.__struct_fields__
        if f'"{name}"' not in contract
    }
    assert missing == set()
