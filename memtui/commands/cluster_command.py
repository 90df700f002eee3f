"""`memtui cluster --prometheus URL [--job NAME] [--once|--json]`: every rank of a job, from
Prometheus' HTTP API.

memtui grows no aggregator of its own: each rank serves its metrics (`--metrics-port`),
Prometheus scrapes them through the `file_sd` files the ranks write, and this command reads
Prometheus. `--once` prints a table, `--json` the JSON document, otherwise the per-job TUI opens
with one source per rank (a rank on this host whose socket is found gets its real live view).
Any failure to ask Prometheus is one line and a non-zero exit, in bounded time.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

from memtui.errors import UsageError
from memtui.input.cluster_query import ClusterSnapshot, RankFigures, snapshot
from memtui.input.prometheus_api import TIMEOUT_SECONDS, PrometheusClient
from memtui.model.cluster import cluster_view, rank_state
from memtui.terminal_text import terminal_safe
from memtui_protocol.os_text import os_text
from memtui_protocol.runtime_dir import RuntimeDirError, live_sidecars


def run_cluster(
    url: str, job: str | None, once: bool, as_json: bool, timeout: float = TIMEOUT_SECONDS
) -> int:
    """The command; its exit code (a `PrometheusError` is the caller's one line)."""
    client = PrometheusClient(url, timeout=timeout)
    found = snapshot(client, job)
    sockets = local_sockets(found)
    view = cluster_view(found, {rank: f"memtui attach {pid}" for rank, (pid, _) in sockets.items()})
    if as_json:
        from memtui.reports.cluster_report import cluster_json
        from memtui.reports.report_format import strict_json

        print(strict_json(cluster_json(view)))
        return 0
    if once:
        from memtui.reports.cluster_report import render_cluster_text

        print(terminal_safe(render_cluster_text(view), keep_newlines=True))
        return 0
    return _open_tui(client, found, [rank.figures.rank for rank in view.ranks], sockets)


def local_sockets(found: ClusterSnapshot) -> dict[int, tuple[int, str]]:
    """rank -> (pid, socket) for the ranks running on this host whose agent serves a socket
    of this user's (the sidecar's pid is the one Prometheus reports)."""
    here = os_text(socket.gethostname())  # as the agent wrote it in the host label
    pids = {figures.pid: figures.rank for figures in found.ranks if figures.host == here}
    if not any(pid is not None for pid in pids):
        return {}
    try:
        sidecars = live_sidecars()
    except (RuntimeDirError, OSError):
        return {}
    sockets = {}
    for sidecar in sidecars:
        rank = pids.get(int(sidecar["pid"]))
        if rank is not None and sidecar.get("socket"):
            sockets[rank] = (int(sidecar["pid"]), str(sidecar["socket"]))
    return sockets


def _judge(figures: RankFigures, now: float) -> str | None:
    state, reason = rank_state(figures, now)
    return reason if state.stale else None


def _open_tui(
    client: PrometheusClient,
    found: ClusterSnapshot,
    order: list[int],
    sockets: dict[int, tuple[int, str]],
) -> int:
    """The per-job screen over every rank, worst first."""
    from memtui.commands.tui_commands import _need_terminal, replay_outcome
    from memtui.input.cluster_source import ClusterPoller, PrometheusRankSource
    from memtui.input.sources import LiveSource, SourceError

    problem = _need_terminal("cluster")
    if problem:
        raise UsageError(problem + " (or use --once / --json)")
    poller = ClusterPoller(client, found.job, found)
    ranks: dict[str, Any] = {}
    for rank in order:
        source: Any = PrometheusRankSource(poller, rank, _judge)
        if rank in sockets:
            pid, path = sockets[rank]
            live = LiveSource(Path(path), label=f"rank {rank} live (pid {pid})")
            try:
                live.check()
                source = live
            except SourceError as exc:
                print(
                    f"memtui: rank {rank}: {terminal_safe(exc)}; from Prometheus", file=sys.stderr
                )
        ranks[str(rank)] = source
    from memtui.tui.app import MemtuiApp, run_app

    app = MemtuiApp(next(iter(ranks.values())), ranks=ranks)
    return replay_outcome(app.sessions, run_app(app))
