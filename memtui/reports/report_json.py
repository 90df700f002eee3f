"""`memtui report --json`, written a batch of steps at a time instead of built whole.

The document of a 200,000-step recording is over 500 MB of text. Built whole (every step's
entry as a struct, then the encoded bytes, the indented copy, the decoded string and its
escaped copy) it peaked at 4.8 GB; here each batch of `BATCH` steps is turned into its entries,
encoded, indented and escaped, written and dropped, so the peak is what the recording's fold
holds plus one batch. The bytes are exactly `strict_json(report_of(recording))`'s: the rest of
the document is encoded as before with an empty `steps`, and the steps are written in its
place, indented as msgspec indents them (a test compares the two).
"""

from __future__ import annotations

from collections.abc import Callable

from memtui.model.recording import Recording
from memtui.reports.report import report_of, step_alerts, step_report
from memtui.reports.report_format import strict_json

BATCH = 256
"""Steps encoded and written at a time (a few MB of text at most)."""
_EMPTY_STEPS = '\n  "steps": [],\n'
"""The key in the document encoded without steps. A string value cannot hold it (a newline
inside a string is always escaped), so it is found only where msgspec wrote the key."""


def write_report_json(recording: Recording, write: Callable[[str], object]) -> None:
    """Write the `report --json` document of `recording`, then a newline, through `write`."""
    rest = strict_json(report_of(recording, with_steps=False))
    before, found, after = rest.partition(_EMPTY_STEPS)
    if not found:
        raise AssertionError("the report's steps key is not where it is expected")
    steps = recording.steps
    if not steps:
        write(rest + "\n")
        return
    alerts = step_alerts(recording)
    write(before + '\n  "steps": [\n')
    for start in range(0, len(steps), BATCH):
        entries = [
            strict_json(step_report(step, recording, alerts.get(step.step, [])))
            for step in steps[start : start + BATCH]
        ]
        last = start + BATCH >= len(steps)
        text = ",\n".join("    " + entry.replace("\n", "\n    ") for entry in entries)
        write(text + ("\n" if last else ",\n"))
    write("  ],\n" + after + "\n")
