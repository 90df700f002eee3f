"""What one recorded message raises: the alerts it carries (its own and the late ones of earlier
steps) and the leaks it names. One reading for every export that counts them as frames pass
(the Prometheus exporter, the loggers' figures), so they count the same alerts."""

from __future__ import annotations

from memtui_protocol import schema


def raised(message: schema.Message) -> tuple[list[schema.Alert], list[schema.Leak]]:
    """The alerts and leaks `message` adds; empty lists for a message that adds none (most
    steps: checked without building a list)."""
    if isinstance(message, (schema.Step, schema.End)):
        if not (message.alerts or message.late or message.leaks):
            return [], []
        late = [alert for values in message.late for alert in values.alerts]
        return [*message.alerts, *late], list(message.leaks)
    if isinstance(message, schema.AlertNow):
        return [message.alert], []
    return [], []
