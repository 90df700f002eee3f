"""`memtui check`: a recording held against the limits a CI job sets (docs/check.md).

Pure: a `Recording` and its `Limits` in, each rule's result and the violations out. The command
(`memtui/commands/check_command.py`) and the pytest plugin (`memtui_pytest`) read the recording
and print what this returns; neither judges a figure itself.

The rules read the figures every view states: a step's peak is `step_peak` (one definition,
`memtui_protocol.peak`), a pile's figure is its high in the step (`Step.max` through
`pile_figure`, the report's "highest in run"). A figure a step does not know (its activations
not known, docs/numbers.md#not-known-null-never-a-guess) is never taken for a pass: a rule says
on how many steps it could not look, and those steps break it beyond `--max-not-known` percent
of the steps; a rule that could look at no step at all (no step recorded, or every one not
known) is broken whatever that allowance, since nothing was measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import msgspec

from memtui.model.alert_summary import KIND_WORDS
from memtui.model.leaks import LeakRow, leak_growth, leak_holding
from memtui.model.recording import Recording, StepAlert
from memtui.model.step_ranges import steps_words
from memtui.model.step_rows import pile_figure, step_peak
from memtui_protocol.schema import AlertKind, LeakKind, Pile, Step, TextEnum
from memtui_protocol.units import format_bytes, written_decimal


class CheckRule(TextEnum):
    """The rules `memtui check` and the pytest marker take, one spelling each."""

    MAX_PEAK = "max_peak"
    """`--max-peak SIZE`: every step's peak at most SIZE."""
    MAX_PILE = "max_pile"
    """`--max PILE=SIZE`: every step's high of PILE at most SIZE."""
    NO_LEAK = "no_leak"
    """`--no-leak`: no leak named."""
    NO_NAN = "no_nan"
    """`--no-nan`: no NaN/Inf alert."""


class Breach(TextEnum):
    """How a rule was broken."""

    OVER_LIMIT = "over_limit"
    """A figure above its limit."""
    NOT_KNOWN = "not_known"
    """Steps whose figure is not known, beyond `--max-not-known` (or no step to look at)."""
    LEAK = "leak"
    """A holder the job's censuses named as a leak."""
    NONFINITE = "nonfinite"
    """A NaN/Inf alert."""


NONFINITE_KINDS = (
    AlertKind.NONFINITE_LOSS,
    AlertKind.NONFINITE_GRADIENT,
    AlertKind.NONFINITE_ACTIVATION,
)
"""The alert kinds that say a number went NaN/Inf (`--no-nan`)."""


@dataclass(frozen=True)
class SizeLimit:
    """A limit in bytes, with the size as the user wrote it (said back in the lines)."""

    bytes: int
    written: str

    @property
    def decimal(self) -> bool:
        """Figures beside it are printed in its unit system (`1GB`: GB, `1GiB`: GiB)."""
        return written_decimal(self.written)


@dataclass(frozen=True)
class Limits:
    """What a run must hold to pass: the flags of `memtui check`, or a pytest marker's keywords."""

    max_peak: SizeLimit | None = None
    max_piles: tuple[tuple[Pile, SizeLimit], ...] = ()
    no_leak: bool = False
    no_nan: bool = False
    max_not_known: float = 0.0
    """Percent of the steps (0-100) on which a size rule may not know its figure."""

    @property
    def any_rule(self) -> bool:
        """Whether any rule is set (`max_not_known` alone is none: it only loosens the others)."""
        return bool(self.max_peak or self.max_piles or self.no_leak or self.no_nan)


class Violation(msgspec.Struct, frozen=True):
    """One way a rule was broken, with the figures that broke it (docs/check.md)."""

    rule: CheckRule
    breach: Breach
    message: str
    """The one line `memtui check` prints for it."""
    pile: Pile | None = None
    measured: int | float | None = None
    """Bytes (over a size limit), percent of the steps (not known), bytes held (a leak), alerts
    counted (NaN/Inf)."""
    limit: int | float | None = None
    """Bytes, or `--max-not-known`'s percent; None for `--no-leak`/`--no-nan` (none allowed)."""
    step: int | None = None
    """Where it was broken: the highest figure's step, the first step not known, the step
    that named the leak, the first NaN/Inf alert's step."""
    first_step: int | None = None
    """The first step that broke it (over the limit, not known, the leak's growth began)."""
    steps: int | None = None
    """How many steps broke it."""
    holder: str | None = None
    """A leak's holder; a NaN/Inf breach's alert kind."""


class RuleResult(msgspec.Struct, frozen=True):
    """One rule as it was checked, held or not (docs/check.md)."""

    rule: CheckRule
    flag: str
    """The rule as the command line gives it: `--max-peak 1GiB`, `--max activations=64MiB`."""
    ok: bool
    message: str
    """What was found, in one line (the lines of its violations when broken)."""
    pile: Pile | None = None
    limit: int | None = None
    highest: int | None = None
    """The highest figure over the steps that know it (size rules)."""
    highest_step: int | None = None
    steps: int = 0
    """The steps the rule looked at: every step of the recording."""
    not_known_steps: int = 0
    """Of those, the steps that do not know its figure (size rules)."""
    found: int = 0
    """Leaks named (`--no-leak`), NaN/Inf alerts (`--no-nan`), steps over the limit."""


class CheckResult(msgspec.Struct, frozen=True):
    """Every rule's result: `memtui check --json` (docs/check.md)."""

    ok: bool
    violations: list[Violation]
    rules: list[RuleResult]
    steps: int
    job: str | None = None
    """How the job ended (`ExitStatus`: ok, error, killed, ...), as `memtui report` says it;
    set by the command, which may ask the system whether the writer still runs."""


def check(recording: Recording, limits: Limits) -> CheckResult:
    """Each rule of `limits` over the recording's steps, in the order of the flags' synopsis."""
    steps = recording.steps
    checked: list[tuple[RuleResult, list[Violation]]] = []
    if limits.max_peak is not None:
        figures = [(step.step, step_peak(step)) for step in steps]
        checked.append(_size_rule(CheckRule.MAX_PEAK, None, limits.max_peak, figures, limits))
    for pile, limit in limits.max_piles:
        figures = [(step.step, pile_figure(step, step.max, pile)) for step in steps]
        checked.append(_size_rule(CheckRule.MAX_PILE, pile, limit, figures, limits))
    if limits.no_leak:
        checked.append(_leak_rule(recording))
    if limits.no_nan:
        checked.append(_nan_rule(recording))
    violations = [violation for _, broken in checked for violation in broken]
    return CheckResult(
        ok=not violations,
        violations=violations,
        rules=[result for result, _ in checked],
        steps=len(steps),
    )


def size_flag(pile: Pile | None, limit: SizeLimit) -> str:
    """A size rule as the command line gives it."""
    return f"--max-peak {limit.written}" if pile is None else f"--max {pile}={limit.written}"


def _size_rule(
    rule: CheckRule,
    pile: Pile | None,
    limit: SizeLimit,
    figures: Sequence[tuple[int, int | None]],
    limits: Limits,
) -> tuple[RuleResult, list[Violation]]:
    """A limit on one figure per step (the peak, or a pile's high)."""
    name = "peak" if pile is None else str(pile)
    flag = size_flag(pile, limit)
    size = partial(format_bytes, binary=not limit.decimal)
    known = [(number, value) for number, value in figures if value is not None]
    unknown = [number for number, value in figures if value is None]
    over = [(number, value) for number, value in known if value > limit.bytes]
    top_step, top = max(known, key=lambda item: item[1]) if known else (None, None)
    share = 100.0 * len(unknown) / len(figures) if figures else 100.0
    violations: list[Violation] = []
    breach: Callable[..., Violation] = partial(Violation, rule, pile=pile)
    if not known:
        why = (
            f"not known on all {len(figures)} steps"
            if figures
            else "not known: the recording has no step (no optimizer.step() or backward() "
            "closed one)"
        )
        violations.append(
            breach(
                Breach.NOT_KNOWN,
                f"{name} {why}: {flag} could not be checked"
                + (" (memtui report says why)" if figures else ""),
                measured=share,
                limit=limits.max_not_known,
                step=unknown[0] if unknown else None,
                first_step=unknown[0] if unknown else None,
                steps=len(unknown),
            )
        )
    if over and top is not None:
        first = over[0][0]
        detail = (
            f"; over on {len(over)} of {len(figures)} steps, first at step {first}"
            if len(over) > 1 or first != top_step
            else ""
        )
        if unknown:
            detail += f"; not known on {_steps(len(unknown))}"
        violations.append(
            breach(
                Breach.OVER_LIMIT,
                f"{name} {size(top)} ({top:,} B) at step {top_step} is over {flag} "
                f"({limit.bytes:,} B){detail}",
                measured=top,
                limit=limit.bytes,
                step=top_step,
                first_step=first,
                steps=len(over),
            )
        )
    if known and unknown and share > limits.max_not_known:
        violations.append(
            breach(
                Breach.NOT_KNOWN,
                f"{name} not known on {len(unknown)} of {len(figures)} steps ({_percent(share)}: "
                f"{steps_words(unknown)}), over --max-not-known {_percent(limits.max_not_known)}: "
                f"{flag} was not checked on them (memtui report says why)",
                measured=share,
                limit=limits.max_not_known,
                step=unknown[0],
                first_step=unknown[0],
                steps=len(unknown),
            )
        )
    if violations:
        message = "; ".join(violation.message for violation in violations)
    else:
        allowed = (
            f" (not known on {len(unknown)} of {len(figures)} steps, {_percent(share)}, within "
            f"--max-not-known {_percent(limits.max_not_known)})"
            if unknown
            else ""
        )
        message = f"{name} {size(top)} at step {top_step} is within {flag}{allowed}"
    result = RuleResult(
        rule,
        flag,
        ok=not violations,
        message=message,
        pile=pile,
        limit=limit.bytes,
        highest=top,
        highest_step=top_step,
        steps=len(figures),
        not_known_steps=len(unknown),
        found=len(over),
    )
    return result, violations


def _steps(count: int) -> str:
    return f"{count} step" + ("s" if count != 1 else "")


def _percent(value: float) -> str:
    """`7.5%`, `0%`, `100%`; a share too small for three figures says so (`<0.001%`)."""
    if 0 < value < 0.001:
        return "<0.001%"
    return f"{value:.3g}%"


def _no_steps(rule: CheckRule, flag: str, what: str) -> tuple[RuleResult, list[Violation]]:
    """A rule about what the agent watches step by step, over a recording with no step."""
    message = (
        f"{what} not known: the recording has no step, nothing was watched: {flag} could not "
        "be checked"
    )
    violation = Violation(rule, Breach.NOT_KNOWN, message, measured=100.0)
    return RuleResult(rule, flag, ok=False, message=message), [violation]


def _leak_rule(recording: Recording) -> tuple[RuleResult, list[Violation]]:
    """`--no-leak`: every holder the censuses named, and any `leak` alert none of them is."""
    flag = "--no-leak"
    steps = recording.steps
    if not steps:
        return _no_steps(CheckRule.NO_LEAK, flag, "leaks")
    alerts = [item for item in recording.alerts if item.kind is AlertKind.LEAK]
    named_at: dict[str, int | None] = {}
    for item in alerts:
        named_at.setdefault(item.alert.where or "", item.step)
    rows = recording.leaks.latest()
    violations = [_leak_violation(row, named_at.get(row.holder)) for row in rows]
    holders = {row.holder for row in rows}
    for item in alerts:
        where = item.alert.where or ""
        if where not in holders:
            holders.add(where)
            violations.append(
                Violation(
                    CheckRule.NO_LEAK,
                    Breach.LEAK,
                    f"leak at step {item.step}: {item.alert.message}; {flag} allows none",
                    step=item.step,
                    holder=item.alert.where,
                )
            )
    censuses = recording.leaks.censuses.count
    message = (
        "; ".join(violation.message for violation in violations)
        if violations
        else f"no leak named in {_steps(len(steps))} ({censuses} censuses of live tensors)"
    )
    result = RuleResult(
        CheckRule.NO_LEAK,
        flag,
        ok=not violations,
        message=message,
        steps=len(steps),
        found=len(violations),
    )
    return result, violations


def _leak_violation(row: LeakRow, named_at: int | None) -> Violation:
    size = format_bytes
    named = f", named at step {named_at}" if named_at is not None else ""
    held = (
        leak_holding(row)  # its host bytes are not known
        if row.kind is LeakKind.GRAPH_HISTORY
        else f"{size(row.bytes)} ({row.bytes:,} B) in {leak_holding(row)}"
    )
    return Violation(
        CheckRule.NO_LEAK,
        Breach.LEAK,
        f"leak: {row.holder} keeps {held}, {leak_growth(row, size)} per step since step "
        f"{row.first_step}{named}: --no-leak allows none",
        measured=row.bytes,
        step=named_at if named_at is not None else row.counted_at,
        first_step=row.first_step,
        holder=row.holder,
    )


def _nan_rule(recording: Recording) -> tuple[RuleResult, list[Violation]]:
    """`--no-nan`: each kind of NaN/Inf alert, from its first step."""
    flag = "--no-nan"
    steps = recording.steps
    if not steps:
        return _no_steps(CheckRule.NO_NAN, flag, "NaN/Inf")
    by_kind: dict[AlertKind, list[StepAlert]] = {}
    for item in recording.alerts:
        if item.kind in NONFINITE_KINDS and isinstance(item.kind, AlertKind):
            by_kind.setdefault(item.kind, []).append(item)
    violations = []
    for kind in NONFINITE_KINDS:
        items = by_kind.get(kind)
        if not items:
            continue
        numbers = [item.step for item in items if item.step is not None]
        first = items[0]
        where = f" [{first.alert.where}]" if first.alert.where else ""
        at = f"step {first.step}" if first.step is not None else "the job's end"
        on = f" ({len(items)} alerts, {steps_words(numbers)})" if len(items) > 1 and numbers else ""
        violations.append(
            Violation(
                CheckRule.NO_NAN,
                Breach.NONFINITE,
                f"{KIND_WORDS[kind]} at {at}{where}{on}: {first.alert.message}; {flag} allows none",
                measured=len(items),
                step=first.step,
                first_step=min(numbers, default=None),
                steps=len(set(numbers)),
                holder=str(kind),
            )
        )
    message = (
        "; ".join(violation.message for violation in violations)
        if violations
        else f"no NaN/Inf alert in {_steps(len(steps))}"
    )
    found = sum(len(items) for items in by_kind.values())
    result = RuleResult(
        CheckRule.NO_NAN, flag, ok=not violations, message=message, steps=len(steps), found=found
    )
    return result, violations


def check_lines(result: CheckResult) -> list[str]:
    """What `memtui check` prints: each violation's line, then each rule that held (`ok: ...`)."""
    lines = [violation.message for violation in result.violations]
    lines += [f"ok: {rule.message}" for rule in result.rules if rule.ok]
    return lines


def step_of(steps: Sequence[Step], number: int | None) -> Step | None:
    """The recording's step numbered `number` (the peak breakdown the plugin prints)."""
    if number is None:
        return None
    return next((step for step in steps if step.step == number), None)


__all__ = [
    "NONFINITE_KINDS",
    "Breach",
    "CheckResult",
    "CheckRule",
    "Limits",
    "RuleResult",
    "SizeLimit",
    "Violation",
    "check",
    "check_lines",
    "size_flag",
    "step_of",
]
