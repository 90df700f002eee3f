"""The cluster TUI's sources: each rank's figures from Prometheus, as the frames of a live job.

`memtui cluster` opens the per-job screen (`MemtuiApp`) with one source per rank, exactly as a
session folder or `attach` to a torchrun job does, so the ranks table, the piles, the timeline
and the alerts are the same widgets over the same model. A rank on this host whose agent serves
its socket gets the real `LiveSource` (its full live view); every other rank gets a
`PrometheusRankSource`: a hello built from its labels, then a `Step` frame each time Prometheus
holds a newer step for it, with the alerts counted since the last one. One `ClusterPoller` asks
Prometheus for all ranks at once and shares the answer, so N ranks cost one round of queries.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import msgspec

from memtui.input.cluster_query import ClusterSnapshot, RankFigures, snapshot
from memtui.input.frame_stream import Sink
from memtui.input.prometheus_api import PrometheusClient, PrometheusError
from memtui_protocol import schema

POLL_SECONDS = 2.0
"""How often the poller asks Prometheus again (a scrape interval is typically 5-15 s)."""

Judge = Callable[[RankFigures, float], str | None]
"""Why a rank no longer reports (None: it does): the model's rule, handed in."""


class ClusterPoller:
    """One round of queries per `POLL_SECONDS`, shared by every rank's source."""

    def __init__(self, client: PrometheusClient, job: str, first: ClusterSnapshot) -> None:
        self.client = client
        self.job = job
        self._lock = threading.Lock()
        self._latest = first
        self._error: str | None = None
        self._taken = time.monotonic()

    def latest(self) -> tuple[ClusterSnapshot, str | None]:
        """The newest snapshot (asked again when older than the poll interval) and, if the last
        round failed, its one line."""
        with self._lock:
            if time.monotonic() - self._taken >= POLL_SECONDS:
                self._taken = time.monotonic()
                try:
                    self._latest = snapshot(self.client, self.job)
                    self._error = None
                except PrometheusError as exc:
                    self._error = str(exc)
            return self._latest, self._error


class PrometheusRankSource:
    """One rank as Prometheus holds it, fed to the screen as frames."""

    live = True

    def __init__(self, poller: ClusterPoller, rank: int, judge: Judge) -> None:
        self.poller = poller
        self.rank = rank
        self.judge = judge
        self.label = f"rank {rank} from Prometheus {poller.client.url}"

    def check(self) -> None:
        """Nothing to open: the poller's first round already reached Prometheus."""

    def run(self, sink: Sink, stop: threading.Event) -> str | None:
        """Frames until the rank stops reporting, Prometheus fails, or `stop` is set."""
        shown: int | None = None
        counted: dict[str, int] | None = None
        while not stop.is_set():
            found, error = self.poller.latest()
            if error is not None:
                return error
            figures = next((item for item in found.ranks if item.rank == self.rank), None)
            if figures is None:
                return f"rank {self.rank} is no longer in Prometheus"
            if counted is None:
                sink([hello_of(figures, self.poller.client.url)])
                counted = {}
            step = figures.step_message()
            if step is not None and figures.step != shown:
                alerts = new_alerts(counted, figures.alerts, shown)
                sink([msgspec.structs.replace(step, alerts=alerts)])
                shown, counted = figures.step, dict(figures.alerts)
            reason = self.judge(figures, time.time())
            if reason is not None:
                return reason
            stop.wait(POLL_SECONDS / 2)
        return None


def new_alerts(
    before: dict[str, int], now: dict[str, int], since: int | None
) -> list[schema.Alert]:
    """One alert per kind whose count grew since the last step shown (the counts are all
    Prometheus has: each alert's message is in the rank's recording)."""
    alerts = []
    for kind, count in sorted(now.items()):
        grown = count - before.get(kind, 0)
        if grown > 0:
            after = f" since step {since}" if since is not None else ""
            alerts.append(
                schema.Alert(
                    kind=kind,
                    message=f"{grown} {kind} alert{'s' if grown > 1 else ''}{after} (counted by "
                    "Prometheus; the rank's recording holds each message)",
                )
            )
    return alerts


def hello_of(figures: RankFigures, url: str) -> schema.Hello:
    """The hello a rank's recording would start with, from what Prometheus knows of it."""
    started = figures.step_end or time.time()
    return schema.Hello(
        format_version=schema.FORMAT_VERSION,
        agent_version="",
        pid=figures.pid or 0,
        argv=[f"{figures.job}: rank {figures.rank} on {figures.host} (from Prometheus {url})"],
        started="",
        started_unix=started - (figures.duration or 0.0) * (figures.step or 0),
        device="cuda" if figures.device else "cpu",
        hostname=figures.host,
        rank=figures.rank,
        local_rank=figures.local_rank,
        world_size=figures.world_size,
    )
