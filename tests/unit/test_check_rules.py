"""`memtui check`'s rules, pure: a recording model in, each rule's result and violations out
(memtui/reports/check_rules.py, docs/check.md).

The recordings are folded from frames written here, with the figures chosen so the truth is
known: a step's peak is its four piles at the peak (plus DDP's buckets), a pile's figure its
high in the step, and a step whose activations are not known has no peak."""

from __future__ import annotations

from pathlib import Path

import pytest
from recording_files import hello

from memtui.model.recording import Recording, apply
from memtui.model.step_rows import step_peak
from memtui.reports.check_rules import (
    Breach,
    CheckRule,
    Limits,
    SizeLimit,
    check,
    check_lines,
)
from memtui.reports.report import build_report
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, LeakKind, Pile
from memtui_protocol.units import parse_size

MIB = 2**20


def limit(text: str) -> SizeLimit:
    return SizeLimit(parse_size(text), text)


def piles(weights: int, activations: int | None) -> schema.Piles:
    return schema.Piles(weights, weights, 2 * weights, activations)


def step(
    number: int, weights: int, activations: int | None, known: bool = True, **fields: object
) -> schema.Step:
    """A step holding `weights` of weights and of gradients, twice that of optimizer state and
    `activations` at its peak and high; `known=False`: its activations are not known."""
    shown = activations if known else None
    extra: dict[str, object] = {} if known else {"activations_measured": False}
    return schema.Step(
        number,
        float(number),
        number + 0.5,
        piles(weights, 0),
        piles(weights, shown),
        piles(weights, shown),
        **(extra | fields),  # type: ignore[arg-type]
    )


def recording(*messages: schema.Message) -> Recording:
    folded = Recording(path=Path("run.memtui"), hello=hello())
    for message in messages:
        apply(folded, message)
    return folded


def test_a_peak_over_its_limit_names_the_figure_the_step_and_the_limit() -> None:
    # Peaks 5 MiB, 6 MiB (step 2), 5.5 MiB: only steps 2 and 3 are over 5.25 MiB.
    run = recording(step(1, MIB, MIB), step(2, MIB, 2 * MIB), step(3, MIB, MIB + MIB // 2))
    result = check(run, Limits(max_peak=limit("5.25MiB")))
    assert not result.ok
    (violation,) = result.violations
    assert (violation.rule, violation.breach) == (CheckRule.MAX_PEAK, Breach.OVER_LIMIT)
    assert (violation.measured, violation.limit) == (6 * MIB, int(5.25 * MIB))
    assert (violation.step, violation.first_step, violation.steps) == (2, 2, 2)
    assert violation.message == (
        "peak 6.00 MiB (6,291,456 B) at step 2 is over --max-peak 5.25MiB (5,505,024 B); "
        "over on 2 of 3 steps, first at step 2"
    )
    assert check(run, Limits(max_peak=limit("6MiB"))).ok


def test_the_peak_is_the_reports_peak_ddp_buckets_included() -> None:
    buckets = schema.Distributed(ddp_buckets=MIB, ddp_bucket_view=False, ddp_in_gradients=0)
    run = recording(step(1, MIB, MIB, distributed=buckets))
    report_peak = build_report(run)["steps"][0]["peak"]["held"]
    assert report_peak == step_peak(run.steps[0]) == 6 * MIB
    (rule,) = check(run, Limits(max_peak=limit("100MiB"))).rules
    assert rule.highest == report_peak
    assert not check(run, Limits(max_peak=limit("5.5MiB"))).ok  # over only with the buckets


@pytest.mark.parametrize(
    ("written", "shown"),
    [("1GB", "1.20 GB (1,200,000,000 B)"), ("1GiB", "1.12 GiB (1,200,000,000 B)")],
)
def test_the_figure_is_said_in_the_limits_unit_system(written: str, shown: str) -> None:
    run = recording(step(1, 200_000_000, 400_000_000))  # 1.2e9 B at the peak
    (violation,) = check(run, Limits(max_peak=limit(written))).violations
    assert violation.message.startswith(f"peak {shown} at step 1 is over --max-peak {written} ")


def test_gb_and_gib_limits_differ() -> None:
    run = recording(step(1, 200_000_000, 250_000_000))  # 1,050,000,000 B
    assert not check(run, Limits(max_peak=limit("1GB"))).ok
    assert check(run, Limits(max_peak=limit("1GiB"))).ok  # 1,073,741,824 B


def test_a_pile_limit_reads_the_piles_high_in_each_step() -> None:
    run = recording(step(1, MIB, 3 * MIB), step(2, MIB, MIB))
    limits = Limits(max_piles=((Pile.ACTIVATIONS, limit("2MiB")), (Pile.WEIGHTS, limit("1MiB"))))
    result = check(run, limits)
    (violation,) = result.violations
    assert (violation.pile, violation.measured, violation.step) == (Pile.ACTIVATIONS, 3 * MIB, 1)
    assert violation.message.startswith("activations 3.00 MiB (3,145,728 B) at step 1 is over ")
    assert "--max activations=2MiB (2,097,152 B)" in violation.message
    assert [rule.ok for rule in result.rules] == [False, True]
    assert result.rules[1].message == "weights 1.00 MiB at step 1 is within --max weights=1MiB"


def test_steps_not_known_break_a_size_rule_unless_allowed() -> None:
    run = recording(
        step(1, MIB, MIB), step(2, MIB, 9 * MIB, known=False), step(3, MIB, MIB), step(4, MIB, MIB)
    )
    strict = check(run, Limits(max_piles=((Pile.ACTIVATIONS, limit("2MiB")),)))
    (violation,) = strict.violations
    assert (violation.breach, violation.step, violation.steps) == (Breach.NOT_KNOWN, 2, 1)
    assert violation.measured == 25.0
    assert violation.message.startswith(
        "activations not known on 1 of 4 steps (25%: step 2), over --max-not-known 0%"
    )
    loose = check(run, Limits(max_piles=((Pile.ACTIVATIONS, limit("2MiB")),), max_not_known=25))
    assert loose.ok
    (rule,) = loose.rules
    assert rule.not_known_steps == 1
    assert "not known on 1 of 4 steps, 25%, within --max-not-known 25%" in rule.message
    # The peak of a step whose activations are not known is not known either.
    (peak,) = check(run, Limits(max_peak=limit("1GiB"))).violations
    assert peak.breach == Breach.NOT_KNOWN and peak.message.startswith("peak not known on 1 of 4")


def test_an_over_limit_line_says_how_many_steps_were_not_known() -> None:
    run = recording(step(1, MIB, 3 * MIB), step(2, MIB, MIB, known=False))
    result = check(run, Limits(max_peak=limit("1MiB"), max_not_known=100))
    (violation,) = result.violations
    assert violation.breach == Breach.OVER_LIMIT
    assert violation.message.endswith("; not known on 1 step")


def test_nothing_known_never_passes_whatever_the_allowance() -> None:
    unknown = recording(step(1, MIB, MIB, known=False), step(2, MIB, MIB, known=False))
    result = check(unknown, Limits(max_peak=limit("1GiB"), max_not_known=100))
    (violation,) = result.violations
    assert violation.breach == Breach.NOT_KNOWN
    assert violation.message.startswith("peak not known on all 2 steps: --max-peak 1GiB could")
    empty = check(
        recording(), Limits(max_peak=limit("1GiB"), no_leak=True, no_nan=True, max_not_known=100)
    )
    assert not empty.ok
    assert [violation.breach for violation in empty.violations] == [Breach.NOT_KNOWN] * 3
    assert "the recording has no step" in empty.violations[0].message


def test_no_leak_names_each_leak_with_where_it_was_named() -> None:
    leak = schema.Leak(
        holder="history", kind=LeakKind.TENSORS.value, bytes=48, tensors=12, per_step=4,
        first_step=2,
    )  # fmt: skip
    alert = schema.Alert(AlertKind.LEAK.value, "history keeps 48 B alive", where="history")
    run = recording(step(1, MIB, MIB), step(13, MIB, MIB, leaks=[leak], alerts=[alert]))
    result = check(run, Limits(no_leak=True))
    (violation,) = result.violations
    assert (violation.breach, violation.holder, violation.step) == (Breach.LEAK, "history", 13)
    assert (violation.measured, violation.first_step) == (48, 2)
    assert violation.message == (
        "leak: history keeps 48 B (48 B) in 12 tensors, +4 B per step since step 2, named at "
        "step 13: --no-leak allows none"
    )
    clean = check(recording(step(1, MIB, MIB), step(2, MIB, MIB)), Limits(no_leak=True))
    assert clean.ok
    assert clean.rules[0].message == "no leak named in 2 steps (0 censuses of live tensors)"


def test_no_nan_fails_on_each_non_finite_kind_and_nothing_else() -> None:
    def alert(kind: AlertKind) -> schema.Alert:
        return schema.Alert(kind.value, f"{kind} here")

    run = recording(
        step(1, MIB, MIB, alerts=[alert(AlertKind.OVER_BUDGET)]),
        step(2, MIB, MIB, alerts=[alert(AlertKind.NONFINITE_LOSS)]),
        step(3, MIB, MIB, alerts=[alert(AlertKind.NONFINITE_LOSS), alert(AlertKind.DIVERGENCE)]),
        step(4, MIB, MIB, alerts=[alert(AlertKind.NONFINITE_GRADIENT)]),
    )
    result = check(run, Limits(no_nan=True))
    assert [(v.holder, v.step, v.measured) for v in result.violations] == [
        ("nonfinite_loss", 2, 2),
        ("nonfinite_gradient", 4, 1),
    ]
    assert result.violations[0].message == (
        "NaN/Inf loss at step 2 (2 alerts, steps 2-3): nonfinite_loss here; --no-nan allows none"
    )
    assert result.rules[0].found == 3
    budget_only = recording(step(1, MIB, MIB, alerts=[alert(AlertKind.OVER_BUDGET)]))
    assert check(budget_only, Limits(no_nan=True)).ok


def test_lines_list_the_violations_then_the_rules_that_held() -> None:
    run = recording(step(1, MIB, MIB))
    result = check(run, Limits(max_peak=limit("1MiB"), no_nan=True))
    assert [rule.rule for rule in result.rules] == [CheckRule.MAX_PEAK, CheckRule.NO_NAN]
    assert check_lines(result) == [
        "peak 5.00 MiB (5,242,880 B) at step 1 is over --max-peak 1MiB (1,048,576 B)",
        "ok: no NaN/Inf alert in 1 step",
    ]
    assert not Limits(max_not_known=5).any_rule
