"""A monitored test's recording, judged by `memtui check`'s rules, as the lines a test fails with.

The failure says what `memtui check` would print for the recording, then the piles at the peak
of the step that broke the rule (or of the highest peak), as pytest-memray's `limit_memory` lists
its allocations: what to shrink first. A test whose figures are not known (no step closed: no
`optimizer.step()` nor `backward()`) breaks a size rule, it never passes one unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from memtui.errors import UserError
from memtui.model.recording import Recording, read_recording
from memtui.model.step_rows import NOT_KNOWN, known_piles, pile_figure, pile_of, step_peak
from memtui.reports.check_rules import Breach, CheckResult, Limits, check, check_lines, step_of
from memtui_protocol.peak import PEAK_WORDS
from memtui_protocol.schema import Pile, Step
from memtui_protocol.units import format_bytes


@dataclass(frozen=True)
class Verdict:
    """What memtui found in one test's recording."""

    broken: bool
    """A rule is broken, or the recording could not be read while a rule was set."""
    text: str
    """The lines the test fails with (or, unbroken, what was found)."""
    peak: int | None
    """The highest peak over the steps that know theirs; None: not known."""
    steps: int


def judge(path: Path, limits: Limits) -> Verdict:
    """The recording at `path` against `limits` (no rule: only its peak, for the summary)."""
    try:
        recording = read_recording(path)
    except UserError as exc:
        why = f"memtui: the test's recording cannot be read: {exc}"
        return Verdict(limits.any_rule, why, None, 0)
    result = check(recording, limits)
    peaks = [(total, step) for step in recording.steps if (total := step_peak(step)) is not None]
    top = max(peaks, key=lambda item: item[0], default=None)
    lines = check_lines(result)
    if recording.warning:
        lines.append(f"memtui: the recording is damaged: {recording.warning}")
    shown = _breakdown_step(recording, result, top[1] if top else None)
    if shown is not None:
        binary = not (limits.max_peak is not None and limits.max_peak.decimal)
        lines.extend(peak_breakdown(shown, limits, binary))
    broken = not result.ok or (limits.any_rule and recording.warning is not None)
    return Verdict(broken, "\n".join(lines), top[0] if top else None, len(recording.steps))


def _breakdown_step(recording: Recording, result: CheckResult, top: Step | None) -> Step | None:
    """The step whose piles the failure lists: the first broken size rule's, else the peak's."""
    for violation in result.violations:
        if violation.breach is Breach.OVER_LIMIT:
            return step_of(recording.steps, violation.step) or top
    return top


def peak_breakdown(step: Step, limits: Limits, binary: bool = True) -> list[str]:
    """The piles at a step's peak, one line each, then the peak against `--max-peak`."""
    size = partial(format_bytes, binary=binary, missing=NOT_KNOWN)
    piles = known_piles(step, step.peak)
    limited = dict(limits.max_piles)
    lines = [f"piles at the peak of step {step.step} (peak = {PEAK_WORDS}):"]
    for pile in Pile:
        limit = limited.get(pile)
        high = pile_figure(step, step.max, pile) if limit is not None else None
        beside = (
            f"   high in the step {size(high)}, limit {limit.written}" if limit is not None else ""
        )
        lines.append(f"  {pile:<16}{size(pile_of(piles, pile)):>14}{beside}")
    wrapped = step.distributed.untracked() if step.distributed is not None else 0
    if wrapped:
        lines.append(f"  {'DDP/FSDP buffers':<16}{size(wrapped):>14}")
    peak = step_peak(step)
    over = f"   limit {limits.max_peak.written}" if limits.max_peak is not None else ""
    lines.append(f"  {'peak':<16}{size(peak):>14}{over}")
    return lines
