"""Every rank of a job as Prometheus last saw it (`memtui cluster`): one query per metric.

Each rank's figures come from `last_over_time(NAME{job=...}[WINDOW])`, so a rank that stopped
reporting is still listed with what it last said; whether it still reports is read from the
plain selector (Prometheus drops a series five minutes after its last sample, or at once when
its target goes away) and from the target list (`up`, with the scrape's last error). A rank is
keyed by `(job, rank)`, the labels every memtui series carries.

This is a source like a recording or a socket: the figures become a `schema.Step` per rank
(`RankFigures.step`), so the per-job screen and the ranks table show them unchanged.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from memtui.input.prometheus_api import PrometheusClient, PrometheusError, Sample
from memtui_protocol import metrics, schema
from memtui_protocol.metrics import WRAPPER_KINDS
from memtui_protocol.peak import peak_total
from memtui_protocol.schema import PILES

WINDOW = "1h"
"""How far back a rank that stopped reporting is still listed."""
JOB_LABEL = "job"

_PER_METRIC = (
    metrics.STEP,
    metrics.PILE_BYTES,
    metrics.WRAPPER_BYTES,
    metrics.DEVICE_BYTES,
    metrics.HOST_RSS,
    metrics.ALERTS_TOTAL,
    metrics.STEP_END_TIME,
    metrics.STEP_DURATION,
    metrics.AGENT_INFO_SERIES,
)


@dataclass
class RankFigures:
    """One rank's latest figures as Prometheus holds them."""

    job: str
    rank: int
    host: str = ""
    local_rank: int | None = None
    world_size: int | None = None
    step: int | None = None
    piles: dict[str, dict[str, int]] = field(default_factory=dict)
    """`{stat: {pile: bytes}}` for stat in end, max, peak."""
    wrapped: dict[str, int] = field(default_factory=dict)
    """`{kind: bytes}` of `memtui_wrapper_bytes`: DDP's buckets, FSDP's gathered parameters."""
    device: dict[str, int] = field(default_factory=dict)
    host_rss: int | None = None
    alerts: dict[str, int] = field(default_factory=dict)
    step_end: float | None = None
    duration: float | None = None
    pid: int | None = None
    fresh: bool = False
    """Its series are current (Prometheus has not marked them stale)."""
    health: str | None = None
    """Its scrape target's health ("up", "down", "unknown"); None: no target any more."""
    last_error: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return (self.job, self.rank)

    def step_message(self) -> schema.Step | None:
        """The figures as the frame a rank's recording holds for that step (None before one)."""
        if self.step is None or not self.piles:
            return None

        def piles(stat: str) -> schema.Piles:
            # A pile the rank serves no sample for is one its step does not know (the
            # exporter writes none for it), never 0.
            values = self.piles.get(stat, {})
            return schema.Piles(*(values.get(pile) for pile in PILES))

        end = self.step_end if self.step_end is not None else 0.0
        allocator = schema.Allocator(
            allocated=self.device.get("allocated"),
            reserved=self.device.get("reserved"),
            process_gpu=self.device.get("process"),
            device_used=self.device.get("device_used"),
            device_total=self.device.get("device_total"),
        )
        return schema.Step(
            step=self.step,
            t_start=end - (self.duration or 0.0),
            t_end=end,
            end=piles("end"),
            max=piles("max"),
            peak=piles("peak"),
            allocator=allocator,
            host=schema.Host(rss=self.host_rss or 0),
            distributed=self.distributed(),
        )

    def distributed(self) -> schema.Distributed | None:
        """What the rank's data-parallel wrappers hold outside the piles (None: no wrapper)."""
        if not self.wrapped:
            return None
        get = self.wrapped.get
        return schema.Distributed(
            ddp_buckets=get("ddp_buckets"),
            ddp_in_gradients=get("ddp_in_gradients"),
            fsdp_gathered=get("fsdp_gathered"),
            fsdp_gathered_max=get("fsdp_gathered_max"),
        )

    def peak(self) -> int | None:
        """The latest step's peak as every view states it (`memtui_protocol.peak`): the piles
        at the peak plus the wrappers' memory; None when a pile at the peak has no sample."""
        values = self.piles.get("peak", {})
        return peak_total(schema.Piles(*(values.get(pile) for pile in PILES)), self.distributed())


@dataclass(frozen=True)
class ClusterSnapshot:
    """What one round of queries found."""

    url: str
    job: str
    ranks: tuple[RankFigures, ...]
    taken: float
    other_jobs: tuple[str, ...] = ()


def label_selector(job: str) -> str:
    """`{job="NAME"}` with the PromQL string escapes."""
    escaped = job.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'{{{JOB_LABEL}="{escaped}"}}'


def choose_job(client: PrometheusClient, job: str | None) -> tuple[str, tuple[str, ...]]:
    """The job to show and the other memtui jobs seen: `--job`, else the one job reporting now,
    else the one job seen in the window.

    Raises:
        PrometheusError: no memtui job, or several and no `--job`.
    """
    seen = _jobs(client.query(f"last_over_time({metrics.STEP}[{WINDOW}])"))
    if job is not None:
        if job not in seen:
            known = ", ".join(sorted(seen)) or "none"
            raise PrometheusError(
                f"no memtui job {job!r} in Prometheus at {client.url} over the last {WINDOW} "
                f"(jobs seen: {known})"
            )
        return job, tuple(sorted(seen - {job}))
    if not seen:
        raise PrometheusError(
            f"Prometheus at {client.url} holds no memtui metrics over the last {WINDOW} "
            "(is it scraping the ranks' file_sd targets? see README, Cluster view)"
        )
    reporting = _jobs(client.query(metrics.STEP))
    candidates = reporting if reporting else seen
    if len(candidates) > 1:
        names = ", ".join(sorted(candidates))
        raise PrometheusError(f"several memtui jobs ({names}): choose one with --job NAME")
    chosen = next(iter(candidates))
    return chosen, tuple(sorted(seen - {chosen}))


def _jobs(samples: list[Sample]) -> set[str]:
    return {sample.labels[JOB_LABEL] for sample in samples if JOB_LABEL in sample.labels}


def snapshot(client: PrometheusClient, job: str | None) -> ClusterSnapshot:
    """Every rank of the job (one round of queries).

    Raises:
        PrometheusError: Prometheus cannot be asked, or holds no such job.
    """
    client.begin_round()  # one deadline for every query of this round
    chosen, others = choose_job(client, job)
    selector = label_selector(chosen)
    ranks: dict[int, RankFigures] = {}

    def rank_of(sample: Sample) -> RankFigures | None:
        number = label_int(sample.labels.get("rank"))
        if number is None:
            return None
        figures = ranks.get(number)
        if figures is None:
            figures = ranks[number] = RankFigures(job=chosen, rank=number)
        figures.host = sample.labels.get("host", figures.host)
        figures.local_rank = _or(label_int(sample.labels.get("local_rank")), figures.local_rank)
        figures.world_size = _or(label_int(sample.labels.get("world_size")), figures.world_size)
        return figures

    for name in _PER_METRIC:
        for sample in client.query(f"last_over_time({name}{selector}[{WINDOW}])"):
            figures = rank_of(sample)
            if figures is not None:
                _take(figures, name, sample)
    for sample in client.query(f"{metrics.STEP}{selector}"):
        figures = rank_of(sample)
        if figures is not None:
            figures.fresh = True
    for target in client.targets():
        labels = target.get("labels")
        if not isinstance(labels, dict) or labels.get(JOB_LABEL) != chosen:
            continue
        number = label_int(labels.get("rank"))
        figures = ranks.get(number) if number is not None else None
        if figures is None:
            continue  # a target that never served a step: nothing to show for it yet
        figures.health = str(target.get("health", "unknown"))
        figures.last_error = str(target.get("lastError", ""))[:300]
    ordered = tuple(ranks[number] for number in sorted(ranks))
    return ClusterSnapshot(client.url, chosen, ordered, time.time(), others)


def _take(figures: RankFigures, name: str, sample: Sample) -> None:
    """One sample into the rank's figures. A value Prometheus holds as NaN or infinite (or a
    count beyond int64, or negative) is no figure: it is left out, as if not scraped."""
    value, labels = sample.value, sample.labels
    count = _count(value)
    if name in (metrics.STEP_END_TIME, metrics.STEP_DURATION):
        if math.isfinite(value) and value >= 0:
            if name == metrics.STEP_END_TIME:
                figures.step_end = value
            else:
                figures.duration = value
        return
    if name == metrics.AGENT_INFO_SERIES:
        figures.pid = _or(label_int(labels.get("pid")), figures.pid)
        return
    if count is None:
        return
    if name == metrics.STEP:
        figures.step = count
    elif name == metrics.PILE_BYTES:
        stat, pile = labels.get("stat", ""), labels.get("pile", "")
        if stat in metrics.STATS and pile in PILES:
            figures.piles.setdefault(stat, {})[pile] = count
    elif name == metrics.WRAPPER_BYTES:
        if labels.get("kind") in WRAPPER_KINDS:
            figures.wrapped[labels["kind"]] = count
    elif name == metrics.DEVICE_BYTES:
        if labels.get("kind") in metrics.DEVICE_KINDS:
            figures.device[labels["kind"]] = count
    elif name == metrics.HOST_RSS:
        figures.host_rss = count
    elif name == metrics.ALERTS_TOTAL:
        figures.alerts[labels.get("kind", metrics.OTHER_ALERT_KIND)] = count


MAX_COUNT = 2**63 - 1
"""Bytes and steps are int64 in every reader (the recording's schema, the JSON report)."""
_DIGITS = re.compile(r"[0-9]{1,10}")
"""A label that is a number: ASCII digits only. `str.isdigit` also takes `²` and other digits
`int()` refuses, and `int()` takes Arabic-Indic digits and underscores: neither is a rank."""


def label_int(text: object) -> int | None:
    """A label's value as a non-negative int of at most 10 ASCII digits; None otherwise."""
    if not isinstance(text, str) or _DIGITS.fullmatch(text) is None:
        return None
    return int(text)


def _count(value: float) -> int | None:
    """A sample's value as a count (whole, 0..int64 max); None for NaN, inf, negatives."""
    if not math.isfinite(value) or value < 0 or value > MAX_COUNT:
        return None
    return int(value)


def _or(value: int | None, default: int | None) -> int | None:
    return value if value is not None else default
