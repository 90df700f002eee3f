"""The model behind the screen: every rank's Session, which one is shown, one ViewState out.

The app only forwards what happened (message batches, a source that ended, the job's exit, a
key) and hands the ViewState this model builds to its widgets; it keeps no state of its own about
the job. With one rank this is a thin wrapper over its Session; with several it adds the
side-by-side rows and the imbalance line, computed here, not set on widgets.
"""

from __future__ import annotations

import dataclasses

from memtui.model.rank_rows import imbalance_line, rank_rows
from memtui.model.session import Session
from memtui.model.view_state import RanksView, ViewState
from memtui_protocol import schema


class ViewModel:
    """All ranks of the job on screen (a single job is one rank labelled "")."""

    def __init__(
        self,
        ranks: dict[str, tuple[str, bool]],
        warning: str | None = None,
        following: frozenset[str] = frozenset(),
    ) -> None:
        """`ranks`: label -> (source label, live); `following`: the labels whose source is a
        recording its job is still writing (`memtui replay` while the job runs)."""
        self.sessions = {
            label: Session(
                source_label=source, live=live, warning=warning, following=label in following
            )
            for label, (source, live) in ranks.items()
        }
        self.selected = next(iter(self.sessions))
        self._own_version = 0

    @property
    def session(self) -> Session:
        """The Session of the rank on screen."""
        return self.sessions[self.selected]

    @property
    def version(self) -> tuple[int, ...]:
        """Changes whenever anything on screen may have: skip redraws while it stays put."""
        return (self._own_version, *(session.version for session in self.sessions.values()))

    # ----- what happened -------------------------------------------------------------------

    def ingest(self, label: str, messages: list[schema.Message]) -> None:
        """A batch from one rank's source."""
        self.sessions[label].ingest(messages)

    def source_ended(self, label: str, reason: str | None) -> None:
        """One rank's source ran out: for a recording, damage on the way is a warning over what
        was read; for a live stream, no final frame means the job died or the socket broke."""
        session = self.sessions[label]
        if not session.live:
            if reason is not None:
                session.warning = reason
                session.version += 1
        elif reason is not None or session.end is None:
            session.mark_disconnected(reason or "stream closed")

    def job_exited(self, code: int, stopped: bool) -> None:
        """The job memtui started has exited (`stopped`: memtui itself sent it SIGTERM)."""
        for session in self.sessions.values():
            session.exit_code = code
            session.stopped = stopped
            session.version += 1

    # ----- keys ------------------------------------------------------------------------------

    def next_rank(self) -> None:
        """Show the next rank (wrapping)."""
        labels = list(self.sessions)
        self.selected = labels[(labels.index(self.selected) + 1) % len(labels)]
        self._own_version += 1

    def toggle_units(self) -> None:
        """Binary <-> decimal units, for every rank at once."""
        for session in self.sessions.values():
            session.toggle_units()

    # ----- out -------------------------------------------------------------------------------

    def view_state(self, timeline_width: int) -> ViewState:
        """The shown rank's ViewState, with the ranks side by side when there are several."""
        if len(self.sessions) < 2:
            return self.session.view_state(timeline_width=timeline_width)
        latest = {
            label: session.steps[-1] if session.steps else None
            for label, session in self.sessions.items()
        }
        rows = rank_rows(
            latest, {label: session.status_text() for label, session in self.sessions.items()}
        )
        line = f"rank {self.selected} of {len(self.sessions)} (r: next rank)"
        imbalance = imbalance_line(latest)
        if imbalance is not None:
            line += " · max/min of each pile's high in the latest step: " + imbalance
        view = self.session.view_state(timeline_width=timeline_width, extra_notes=(line,))
        return dataclasses.replace(view, ranks=RanksView(rows, self.selected, self.session.binary))
