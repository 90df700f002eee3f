"""Prometheus metrics of one rank (`--metrics-port`), in `prometheus_client`'s formats.

The training thread's only work is the hand-off: the emitter gives every message it has just
recorded to `MetricsExporter.offer`, which keeps a reference to the latest `Step` and, on the
rare message that carries alerts or leaks, folds them into two small dictionaries. Nothing is
formatted, locked or waited for there. A scrape runs on the endpoint's one thread
(`metrics_server.MetricsServer`: a few connections at a time, each with a deadline, so no client
can grow the job's threads): `collect()` reads those references once each and builds the metric
families, so every series of one scrape comes from the same step, the one the recording holds.

`prometheus_client` is optional (`pip install 'memtui[metrics]'`) and imported only when a port
is given: without one, this module is never imported and nothing is started. A missing package,
a port in use or an unwritable target folder is one note on stderr (and in the recording); the
job runs on and records as before.

Names and labels are `memtui_protocol.metrics`' (README, "Cluster view").
"""

from __future__ import annotations

import re
import socket as _socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from memtui_agent.output.metrics_server import MetricsServer
from memtui_agent.output.raised import raised
from memtui_agent.output.scrape_target import ScrapeTarget, write_target
from memtui_protocol import metrics, schema
from memtui_protocol.config import AgentConfig
from memtui_protocol.os_text import os_text
from memtui_protocol.peak import PEAK_WORDS, peak_total
from memtui_protocol.schema import AlertKind

_SESSION_MEMBER = re.compile(r"^(?:rank|proc)-\d+\.memtui$")
MAX_HOLDERS_KEPT = 256
"""Leak holders remembered (the largest `metrics.MAX_LEAK_HOLDERS` are served)."""
AGENT_KINDS = tuple(
    kind.value for kind in AlertKind if kind not in (AlertKind.SNAPSHOT, AlertKind.GROUPED)
)
"""Alert kinds an agent raises (the other two are the viewer's), served at 0 from the start so
that `rate()` and `increase()` see the first alert of each kind."""


class MetricsExporter:
    """The collector: the latest step and the alerts and leaks so far, as metric families."""

    def __init__(self, labels: dict[str, str], info: dict[str, str]) -> None:
        self._names = list(metrics.LABELS)
        self._values = [labels[name] for name in metrics.LABELS]
        self._info = info
        self._step: schema.Step | None = None
        self._alerts: dict[str, int] = dict.fromkeys(AGENT_KINDS, 0)
        self._leaks: dict[str, int] = {}

    # ----- the training thread: a reference kept, nothing more on most steps ----------------

    def offer(self, message: schema.Message) -> None:
        """Take a message the emitter has just recorded (never raises, never blocks)."""
        if isinstance(message, schema.Step):
            self._step = message
        alerts, leaks = raised(message)
        if alerts or leaks:
            self._fold(alerts, leaks)

    def _fold(self, alerts: list[schema.Alert], leaks: list[schema.Leak]) -> None:
        """Copy, change, swap: a scrape reading the old dictionary never sees one half-changed."""
        if alerts:
            counts = dict(self._alerts)
            for alert in alerts:
                kind = alert.kind if AlertKind.parse(alert.kind) else metrics.OTHER_ALERT_KIND
                counts[kind] = counts.get(kind, 0) + 1
            self._alerts = counts
        if leaks:
            held = dict(self._leaks)
            for leak in leaks:
                held[leak.holder] = leak.bytes
            if len(held) > MAX_HOLDERS_KEPT:
                held = dict(sorted(held.items(), key=lambda item: -item[1])[:MAX_HOLDERS_KEPT])
            self._leaks = held

    # ----- the scrape thread -----------------------------------------------------------------

    def describe(self) -> list[Any]:
        """Nothing to declare ahead: the registry then never calls `collect` at registration."""
        return []

    def collect(self) -> Iterator[Any]:
        """The metric families of the latest step (read once: one step per scrape)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            InfoMetricFamily,
        )

        names, values = self._names, self._values
        info = InfoMetricFamily(metrics.AGENT_INFO, "The rank's agent", labels=names)
        info.add_metric(values, self._info)
        yield info
        alerts = CounterMetricFamily(
            metrics.ALERTS, "Alerts raised so far, by kind", labels=[*names, "kind"]
        )
        for kind, count in self._alerts.items():
            alerts.add_metric([*values, kind], count)
        yield alerts
        step = self._step
        if step is None:
            return  # no step closed yet: nothing is known, nothing is served as 0
        piles = GaugeMetricFamily(
            metrics.PILE_BYTES,
            "Tracked piles at the step's close (end), their highs (max), at the peak (peak)",
            labels=[*names, "pile", "stat"],
        )
        for stat, figures in (("end", step.end), ("max", step.max), ("peak", step.peak)):
            for pile in metrics.PILE_NAMES:
                value = getattr(figures, pile)
                if value is not None:  # not known: no sample, never a 0 that reads as one
                    piles.add_metric([*values, pile, stat], value)
        yield piles
        peak = peak_total(step.peak, step.distributed)
        if peak is not None:
            yield _gauge(
                metrics.PEAK_BYTES,
                f"The latest step's peak ({PEAK_WORDS}), as every memtui view states it",
                names,
                values,
                peak,
            )
        wrapped = step.distributed
        if wrapped is not None:
            family = GaugeMetricFamily(
                metrics.WRAPPER_BYTES,
                "Data-parallel wrappers' memory outside the piles at the close (DDP, FSDP)",
                labels=[*names, "kind"],
            )
            for kind in metrics.WRAPPER_KINDS:
                figure = getattr(wrapped, kind)
                if figure is not None:
                    family.add_metric([*values, kind], figure)
            if family.samples:
                yield family
        yield _gauge(metrics.STEP, "The latest closed step", names, values, step.step)
        yield _gauge(
            metrics.STEP_DURATION,
            "Duration of the latest step",
            names,
            values,
            max(0.0, step.t_end - step.t_start),
        )
        yield _gauge(
            metrics.STEP_END_TIME, "When the latest step closed", names, values, step.t_end
        )
        yield _gauge(
            metrics.ACTIVATIONS_MEASURED,
            "1: the latest step's activations were measured; 0: carried or not known",
            names,
            values,
            1 if step.activations_measured else 0,
        )
        if step.host.rss:
            yield _gauge(metrics.HOST_RSS, "Process RSS at the close", names, values, step.host.rss)
        if step.workers is not None:
            workers = GaugeMetricFamily(
                metrics.WORKERS_BYTES,
                "DataLoader worker processes as last sampled (USS, PSS, USS growth since start)",
                labels=[*names, "kind"],
            )
            for kind, figure in (
                ("uss", step.workers.uss),
                ("pss", step.workers.pss),
                ("growth", step.workers.growth),
            ):
                if figure is not None:
                    workers.add_metric([*values, kind], figure)
            yield workers
        device = GaugeMetricFamily(
            metrics.DEVICE_BYTES,
            "Allocator and device memory at the close (only the kinds this job has)",
            labels=[*names, "kind"],
        )
        allocator = step.allocator
        for kind, figure in zip(
            metrics.DEVICE_KINDS,
            (
                allocator.allocated,
                allocator.reserved,
                allocator.process_gpu,
                allocator.device_used,
                allocator.device_total,
            ),
            strict=True,
        ):
            if figure is not None:
                device.add_metric([*values, kind], figure)
        if device.samples:
            yield device
        leaks = self._leaks
        if leaks:
            family = GaugeMetricFamily(
                metrics.LEAK_BYTES, "Bytes a leaking holder keeps", labels=[*names, "holder"]
            )
            shown: dict[str, int] = {}
            largest = sorted(leaks.items(), key=lambda item: -item[1])[: metrics.MAX_LEAK_HOLDERS]
            for holder, held in largest:
                label = metrics.short_holder(holder)
                shown[label] = shown.get(label, 0) + held  # two holders cut to one label: summed
            for label, held in shown.items():
                family.add_metric([*values, label], held)
            yield family


def _gauge(name: str, documentation: str, names: list[str], values: list[str], value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(name, documentation, labels=names)
    family.add_metric(values, value)
    return family


class MetricsEndpoint:
    """The exporter, its HTTP server and its `file_sd` target file."""

    def __init__(
        self, exporter: MetricsExporter, server: MetricsServer, target: ScrapeTarget | None
    ):
        self.exporter = exporter
        self.server = server
        self.target = target
        self.port: int = server.port

    @property
    def offer(self) -> Callable[[schema.Message], None]:
        """What the emitter calls with each message it has recorded."""
        return self.exporter.offer

    def close(self) -> None:
        """Stop serving (at most one poll interval of the server, 0.5 s) and remove the target
        file, so Prometheus stops scraping a rank that ended cleanly."""
        if self.target is not None:
            self.target.remove()
        self.server.close()

    def forget_in_child(self) -> None:
        """A forked child (a DataLoader worker) closes its copy of the listening socket, so the
        port is free once the rank itself exits; the parent's server is untouched."""
        self.target = None
        self.server.forget_in_child()


def job_label(config: AgentConfig, argv: list[str]) -> str:
    """The `job` label: `--metrics-job`, else the session folder's name (every rank of every
    node writing into one folder shares it), else the recording's or the script's name."""
    if config.metrics_job:
        return config.metrics_job
    if config.record:
        path = Path(config.record)
        return path.parent.name if _SESSION_MEMBER.match(path.name) else path.stem
    script = next((word for word in argv if word.endswith(".py")), argv[0] if argv else "job")
    return Path(script).stem or "job"


def start_metrics(
    config: AgentConfig, hello: schema.Hello, note: Callable[[str, str], None]
) -> MetricsEndpoint | None:
    """Serve this process's metrics on `metrics_port + LOCAL_RANK`; None (after one note) when
    `prometheus_client` is missing or the port cannot be bound."""
    assert config.metrics_port is not None
    try:
        from prometheus_client import CollectorRegistry
        from prometheus_client.exposition import choose_encoder
    except ImportError:
        note(
            "metrics",
            "--metrics-port needs prometheus_client (pip install 'memtui[metrics]'); no "
            "/metrics for this process, the job runs on and records as before",
        )
        return None
    rank = hello.rank if hello.rank is not None and hello.rank >= 0 else 0
    local_rank = hello.local_rank if hello.local_rank is not None else 0
    port = config.metrics_port + local_rank if config.metrics_port else 0
    labels = {
        "job": os_text(job_label(config, list(hello.argv))),  # the path may not be UTF-8
        "host": hello.hostname or os_text(_socket.gethostname()),
        "rank": str(rank),
        "local_rank": str(local_rank),
        "world_size": str(hello.world_size or 1),
    }
    exporter = MetricsExporter(
        labels, {"pid": str(hello.pid), "version": hello.agent_version, "device": hello.device}
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)  # a collector by protocol (`collect`, `describe`)

    def render(accept: str) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)  # text, or OpenMetrics if asked for
        return encoder(registry), content_type

    try:
        server = MetricsServer(config.metrics_addr, port, render)
    except (OSError, ValueError) as exc:  # in use, no such address (UnicodeError: a ValueError)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        note(
            "metrics",
            f"metrics port {port} on {config.metrics_addr} for rank {rank}: "
            f"{reason}; no /metrics for this rank, the job runs on and records as before",
        )
        return None
    server.start()
    bound = server.port
    target = None
    if config.record:
        folder = Path(config.record).parent / metrics.TARGETS_FOLDER
        name = metrics.target_file_name(labels["host"], rank)
        try:
            address = _target_address(config, labels["host"], bound)
            target = write_target(folder / name, address, labels)
        except OSError as exc:
            note("metrics-target", f"no Prometheus target file in {folder}: {exc}")
    return MetricsEndpoint(exporter, server, target)


def _target_address(config: AgentConfig, host: str, port: int) -> str:
    """`host:port` as Prometheus must dial it: the bound address, or this host's name when
    bound to every interface."""
    address = config.metrics_addr
    if address in ("", "0.0.0.0", "::"):
        address = host
    if ":" in address and not address.startswith("["):
        address = f"[{address}]"  # an IPv6 literal
    return f"{address}:{port}"


__all__ = ["MetricsEndpoint", "MetricsExporter", "job_label", "start_metrics"]
