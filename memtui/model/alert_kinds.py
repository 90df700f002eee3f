"""An alert's kind as the viewer holds it: converted from the wire's string once, at the fold.

On the wire `Alert.kind` stays a plain string, so recordings written before and kinds a newer
agent adds still decode. The viewer converts it here, when `recording.apply` takes the alert in;
every reader after that (the alerts table, its colours, the report's text) compares `AlertKind`
members, and a kind this version does not know is carried as its string and shown as written.
"""

from __future__ import annotations

from memtui_protocol.schema import AlertKind

AlertKindShown = AlertKind | str
"""The `AlertKind`, or the string of a kind a newer agent sent (listed as written)."""


def alert_kind(text: str) -> AlertKindShown:
    """The member for a kind read from the wire; the string itself for one this version does
    not know."""
    return AlertKind.parse(text) or text
