"""`memtui cluster --once` and `--json`: the cluster view as a text table or as JSON.

Both read one `ClusterView` (memtui/model/cluster.py): the ranks worst first, each pile's high
in its latest step, its peak and headroom, its alerts and whether it still reports; then the
worst rank named, the imbalance between ranks, the ranks that stopped reporting (one line
each) and, for ranks on this host, the command that opens their live view.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from memtui.model.cluster import ClusterRank, ClusterView
from memtui_protocol.peak import PEAK_WORDS
from memtui_protocol.schema import PILES
from memtui_protocol.units import format_bytes

CLUSTER_FORMAT = "memtui-cluster"
CLUSTER_VERSION = 1
_HEADINGS = ("rank", "host", "step", *PILES, "peak", "headroom", "alerts", "state")


def render_cluster_text(view: ClusterView, binary: bool = True) -> str:
    """The table and the lines under it."""
    taken = _dt.datetime.fromtimestamp(view.taken).strftime("%Y-%m-%d %H:%M:%S")
    hosts = view.hosts
    lines = [
        f"job {view.job}: {len(view.ranks)} rank(s) on {len(hosts)} host(s), from Prometheus "
        f"{view.url} at {taken} (worst first: least headroom, then highest peak; "
        f"peak: {PEAK_WORDS})"
    ]
    table = [list(_HEADINGS)]
    for rank in view.ranks:
        table.append(_cells(rank, binary))
    widths = [max(len(row[column]) for row in table) for column in range(len(_HEADINGS))]
    for row in table:
        cells = [
            cell.ljust(width) if column in (1, len(row) - 1) else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    worst = view.worst
    if worst is not None:
        lines.append(f"worst: rank {worst.label} on {worst.figures.host} ({_worst_why(worst)})")
    if view.imbalance is not None:
        lines.append(
            f"imbalance (max/min of each pile's high in the latest step): {view.imbalance}"
        )
    for rank in view.ranks:
        if rank.reason:
            lines.append(f"rank {rank.label} on {rank.figures.host}: {rank.reason}")
    for rank in view.ranks:
        if rank.live_view is not None:
            lines.append(f"rank {rank.label} runs on this host: live view with `{rank.live_view}`")
    if view.other_jobs:
        lines.append(f"other memtui jobs in Prometheus: {', '.join(view.other_jobs)} (--job NAME)")
    return "\n".join(lines)


def _cells(rank: ClusterRank, binary: bool) -> list[str]:
    figures = rank.figures
    highs = figures.piles.get("max", {})
    return [
        rank.label,
        figures.host,
        str(figures.step) if figures.step is not None else "-",
        *(_size(highs.get(pile), binary) for pile in PILES),
        _size(rank.peak, binary),
        _size(rank.headroom, binary) if rank.headroom is not None else "n/a",
        str(rank.alerts),
        str(rank.state),
    ]


def _size(value: int | None, binary: bool) -> str:
    return format_bytes(value, binary) if value is not None else "-"


def _worst_why(rank: ClusterRank) -> str:
    parts = [f"peak {_size(rank.peak, True)}"]
    headroom = rank.headroom
    parts.append(
        f"headroom {format_bytes(headroom)}" if headroom is not None else "no device figures"
    )
    if rank.state.stale:
        parts.append(str(rank.state))
    return ", ".join(parts)


def cluster_json(view: ClusterView) -> dict[str, Any]:
    """The `--json` document (strict JSON: no NaN, sizes in bytes)."""
    return {
        "format": CLUSTER_FORMAT,
        "version": CLUSTER_VERSION,
        "prometheus": view.url,
        "job": view.job,
        "taken": view.taken,
        "ranks": [_rank_json(rank) for rank in view.ranks],
        "worst": {"rank": view.worst.figures.rank, "host": view.worst.figures.host}
        if view.worst is not None
        else None,
        "imbalance": {
            str(pile): {
                "max": spread.high,
                "min": spread.low,
                "ratio": spread.ratio,
                "heaviest_rank": int(spread.heaviest),
            }
            for pile, spread in view.spreads.items()
        },
        "other_jobs": list(view.other_jobs),
    }


def _rank_json(rank: ClusterRank) -> dict[str, Any]:
    figures = rank.figures
    peak_piles = figures.piles.get("peak")
    return {
        "rank": figures.rank,
        "host": figures.host,
        "local_rank": figures.local_rank,
        "world_size": figures.world_size,
        "pid": figures.pid,
        "step": figures.step,
        "end": _piles(figures.piles.get("end")),
        "max": _piles(figures.piles.get("max")),
        "peak": {
            "total": _piles_total(peak_piles),
            "held": rank.peak,
            "piles": _piles(peak_piles),
        }
        if peak_piles
        else None,
        "device": dict(figures.device),
        "host_rss": figures.host_rss,
        "headroom": rank.headroom,
        "alerts": dict(sorted(figures.alerts.items())),
        "step_end": figures.step_end,
        "step_duration_s": figures.duration,
        "state": str(rank.state),
        "stale": rank.state.stale,
        "reason": rank.reason or None,
        "live_view": rank.live_view,
    }


def _piles(values: dict[str, int] | None) -> dict[str, int | None] | None:
    """A rank's piles for one stat; null for a pile Prometheus holds no sample of (the step
    does not know it: the exporter serves none), never 0."""
    return {pile: values.get(pile) for pile in PILES} if values else None


def _piles_total(values: dict[str, int] | None) -> int | None:
    """The four piles' total (`peak.total`, as `memtui report --json` states it); null when a
    pile has no sample."""
    if not values or any(pile not in values for pile in PILES):
        return None
    return sum(values[pile] for pile in PILES)
