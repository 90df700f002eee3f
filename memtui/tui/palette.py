"""The screen's colours and words for each concept, keyed by the concept's enum.

Every widget that colours or names a pile, a bar part, an alert kind or an allocation line
looks it up here, by member: the timeline and the piles bar cannot drift apart, and a mapping
indexed by a position or a string spelt by hand does not type-check.
"""

from __future__ import annotations

from memtui.model.alert_kinds import AlertKindShown
from memtui.model.alloc_rows import AllocKind
from memtui.model.step_rows import BarPart, Untracked
from memtui_protocol.schema import Pile, Severity, alert_severity

PILE_COLOURS: dict[Pile, str] = {
    Pile.WEIGHTS: "#4c8bf5",
    Pile.GRADIENTS: "#f5a623",
    Pile.OPTIMIZER_STATE: "#b06ce0",
    Pile.ACTIVATIONS: "#3fb950",
}
CARRIED_ACTIVATIONS = "#a6e3b0"
"""A lighter green for activations a step carries from a measured step (not measured itself)."""
UNTRACKED_COLOURS: dict[Untracked, str] = {
    Untracked.DDP_BUCKETS: "#d29922",
    Untracked.FSDP_GATHERED: "#39c5cf",
    Untracked.OTHER: "#8b949e",
}
PART_COLOURS: dict[BarPart, str] = dict([*PILE_COLOURS.items(), *UNTRACKED_COLOURS.items()])
"""The piles' colours plus the memory no pile tracks (shown only when present)."""

PART_LABELS: dict[BarPart, str] = {
    Pile.WEIGHTS: "weights",
    Pile.GRADIENTS: "gradients",
    Pile.OPTIMIZER_STATE: "optimizer state",
    Pile.ACTIVATIONS: "activations",
    Untracked.DDP_BUCKETS: "DDP buckets",
    Untracked.FSDP_GATHERED: "FSDP gathered",
    Untracked.OTHER: "other",
}
COLUMN_LABELS: dict[Pile, str] = {
    **{pile: PART_LABELS[pile] for pile in Pile},
    Pile.OPTIMIZER_STATE: "optimizer",
}
"""A pile as a table column's heading, where room is short."""

ERROR_STYLE = "bold red"
"""What is wrong with the job, not only worth knowing: an out-of-memory, a leak, a NaN."""
SEVERITY_STYLES: dict[Severity, str] = {
    Severity.ERROR: ERROR_STYLE,
    Severity.WARNING: "bold yellow",
    Severity.NOTE: "dim",
}
"""Each severity's style; never alone: `SEVERITY_WORDS` says it in the row too."""
SEVERITY_WORDS: dict[Severity, str] = {
    Severity.ERROR: "error",
    Severity.WARNING: "warn",
    Severity.NOTE: "note",
}
"""Each severity as the alerts table's first column says it (a word, not a colour alone)."""

ALLOC_STYLES: dict[AllocKind, str] = {
    AllocKind.HEADING: "bold",
    AllocKind.NONE: "dim",
    AllocKind.OOM: "bold red",
    AllocKind.RING_FULL: "yellow",
}
"""Allocation lines styled apart from the plain allocations and segment growth."""


def alert_style(kind: AlertKindShown) -> str:
    """The kind column's style, its severity's (a kind this version does not know: a
    warning's)."""
    return SEVERITY_STYLES[alert_severity(kind)]
