"""The cluster view's model: every rank of a job, worst first, with its state, as pure data.

Built from one `ClusterSnapshot` (what Prometheus holds) by `cluster_view`; the text table, the
JSON and the TUI's rank order all read it. The ranks' piles are compared with the per-job
screen's own functions (`rank_rows`, `imbalance_line`), over each rank's latest step as a
`schema.Step`, so the cluster view and the ranks table of a session cannot disagree.

Worst first: the least headroom on the device (total minus used, where NVML reports both),
then the highest tracked peak; a CPU job has no device figures, so its ranks are ordered by
peak alone.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

from memtui.input.cluster_query import ClusterSnapshot, RankFigures
from memtui.model.rank_rows import RankRow, Spread, imbalance_line, rank_rows, spread
from memtui.model.step_rows import pile_figure
from memtui_protocol.schema import Pile, TextEnum

HANG_SECONDS = 120.0
"""A reporting rank whose last step closed longer ago than this (and 20 of its steps) is named
as not stepping: its endpoint answers, its training does not move."""


class RankState(TextEnum):
    """Whether a rank still reports (state is data: the text below is for display only)."""

    REPORTING = "reporting"
    NOT_STEPPING = "not stepping"
    """Scraped fine, but no step closed for a long while (a hang in a collective?)."""
    STOPPED = "stopped reporting"
    """Its endpoint no longer answers Prometheus (the rank died, or its host is gone)."""
    GONE = "gone"
    """No longer scraped: its target file was removed (it ended cleanly) or Prometheus lost it."""

    @property
    def stale(self) -> bool:
        return self in (RankState.STOPPED, RankState.GONE)


@dataclass(frozen=True)
class ClusterRank:
    """One rank, as the cluster view shows it."""

    figures: RankFigures
    state: RankState
    reason: str
    """One line: why the rank is in this state ("" while it reports)."""
    live_view: str | None
    """The command that opens its live view (a rank running on this host), else None."""

    @property
    def label(self) -> str:
        return str(self.figures.rank)

    @property
    def peak(self) -> int | None:
        """Its latest step's peak, as every view states it (`RankFigures.peak`)."""
        return self.figures.peak()

    @property
    def headroom(self) -> int | None:
        """Device total minus device used at the latest close (None where either is unknown)."""
        device = self.figures.device
        if "device_total" in device and "device_used" in device:
            return device["device_total"] - device["device_used"]
        return None

    @property
    def alerts(self) -> int:
        return sum(self.figures.alerts.values())


@dataclass(frozen=True)
class ClusterView:
    """Every rank of one job, worst first."""

    url: str
    job: str
    ranks: tuple[ClusterRank, ...]
    rows: tuple[RankRow, ...]
    """The ranks table's rows (the per-job screen's), in the same order as `ranks`."""
    imbalance: str | None
    spreads: dict[Pile, Spread]
    taken: float
    other_jobs: tuple[str, ...] = ()

    @property
    def worst(self) -> ClusterRank | None:
        return self.ranks[0] if self.ranks else None

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(sorted({rank.figures.host for rank in self.ranks}))


def rank_state(figures: RankFigures, now: float) -> tuple[RankState, str]:
    """How a rank stands, and the one line that says why."""
    last = _last_step(figures)
    if figures.health == "down":
        error = figures.last_error or "no answer"
        return RankState.STOPPED, f"stopped reporting: last scrape failed ({error}){last}"
    if not figures.fresh and figures.health is None:
        return RankState.GONE, (
            f"gone: no longer scraped (its target file was removed as it ended, or Prometheus "
            f"dropped it){last}"
        )
    if not figures.fresh:
        return RankState.STOPPED, f"stopped reporting: its series went stale{last}"
    if figures.step_end is not None:
        quiet = now - figures.step_end
        if quiet > max(HANG_SECONDS, 20 * (figures.duration or 0.0)):
            return RankState.NOT_STEPPING, f"not stepping: no step closed for {quiet:.0f} s{last}"
    return RankState.REPORTING, ""


def _last_step(figures: RankFigures) -> str:
    if figures.step is None:
        return ""
    when = ""
    if figures.step_end is not None:
        stamp = _dt.datetime.fromtimestamp(figures.step_end)
        when = f" at {stamp:%H:%M:%S}"
    return f"; last step {figures.step}{when}"


def _order(rank: ClusterRank) -> tuple[bool, int, int, int]:
    headroom = rank.headroom
    return (headroom is None, headroom or 0, -(rank.peak or 0), rank.figures.rank)


def cluster_view(
    snapshot: ClusterSnapshot,
    live_views: dict[int, str] | None = None,
    now: float | None = None,
) -> ClusterView:
    """The view of one snapshot.

    Args:
        live_views: rank -> the command that opens its live view (ranks running on this host,
            found by the caller).
        now: the clock the staleness of steps is judged by (default: the snapshot's).
    """
    now = snapshot.taken if now is None else now
    ranks = []
    for figures in snapshot.ranks:
        state, reason = rank_state(figures, now)
        ranks.append(ClusterRank(figures, state, reason, (live_views or {}).get(figures.rank)))
    ranks.sort(key=_order)
    latest = {rank.label: rank.figures.step_message() for rank in ranks}
    rows = rank_rows(latest, {rank.label: _state_cell(rank) for rank in ranks})
    reporting = {label: step for label, step in latest.items() if step is not None}
    spreads = {}
    for pile in Pile:  # over the ranks whose latest step knows the pile's high
        highs = {
            label: high
            for label, step in reporting.items()
            if (high := pile_figure(step, step.max, pile)) is not None
        }
        if len(highs) >= 2:
            spreads[pile] = spread(highs)
    return ClusterView(
        url=snapshot.url,
        job=snapshot.job,
        ranks=tuple(ranks),
        rows=rows,
        imbalance=imbalance_line(latest) if len(reporting) >= 2 else None,
        spreads=spreads,
        taken=snapshot.taken,
        other_jobs=snapshot.other_jobs,
    )


def _state_cell(rank: ClusterRank) -> str:
    """The ranks table's last column: the host, the state, the alerts."""
    parts = [rank.figures.host, str(rank.state)]
    if rank.alerts:
        parts.append(f"{rank.alerts} alert{'s' if rank.alerts > 1 else ''}")
    return " · ".join(parts)
