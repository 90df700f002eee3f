"""One peak everywhere: a DDP job's recording, fed to the report, the TUI's piles panel, the
Prometheus exporter and `memtui cluster` (reading what that exporter serves), states the same
peak for the same step: the piles at the peak plus the DDP buckets no pile counts
(docs/numbers.md, "The peak"). Before, the cluster and the report left the buckets out while
the TUI added them (6.09 MiB against 7.62 MiB on a 2-rank job)."""

from __future__ import annotations

import re
from types import ModuleType

import msgspec

from memtui.input.cluster_query import ClusterSnapshot, _take
from memtui.input.prometheus_api import Sample
from memtui.model.cluster import cluster_view
from memtui.model.session import Session
from memtui.model.view_state import piles_view
from memtui.reports.cluster_report import cluster_json, render_cluster_text
from memtui.reports.report import build_report, render_text
from memtui_agent.output.metrics import MetricsExporter
from memtui_protocol import metrics, schema
from memtui_protocol.units import format_bytes

LABELS = {"job": "ddp", "host": "h", "rank": "0", "local_rank": "0", "world_size": "2"}
BUCKETS = 1_597_440
"""DDP's buckets: a second copy of the gradients (`gradient_as_bucket_view=False`)."""


def ddp_messages(builder: ModuleType) -> list[schema.Message]:
    wrapped = schema.Distributed(ddp_buckets=BUCKETS, ddp_bucket_view=False, ddp_in_gradients=0)
    return [
        msgspec.structs.replace(message, distributed=wrapped)
        if isinstance(message, schema.Step)
        else message
        for message in builder.demo_messages()
    ]


def truth(step: schema.Step) -> int:
    """The peak by its definition, counted here: the four piles at the peak, then the buckets."""
    return sum(step.peak.counted()) + BUCKETS


def served(exporter: MetricsExporter) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    text = generate_latest(registry).decode()
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def test_every_view_states_the_same_peak_with_the_ddp_buckets(builder: ModuleType) -> None:
    messages = ddp_messages(builder)
    steps = [message for message in messages if isinstance(message, schema.Step)]
    last = steps[-1]
    session = Session(live=False)
    session.ingest(messages)
    recording = session.recording
    assert recording is not None

    # The TUI's piles panel, on the last step.
    tui = piles_view(recording.steps[-1], None, True).peak
    # The Prometheus exporter, fed as the agent feeds it, then the cluster reading it back.
    exporter = MetricsExporter(LABELS, {"pid": "7", "version": "v", "device": "cpu"})
    for message in messages:
        exporter.offer(message)
    samples = served(exporter)
    [exported] = [value for name, _, value in samples if name == metrics.PEAK_BYTES]
    from memtui.input.cluster_query import RankFigures

    figures = RankFigures(job="ddp", rank=0)
    for name, labels, value in samples:
        _take(figures, name, Sample({"__name__": name, **labels}, value, 0.0))
    view = cluster_view(ClusterSnapshot("http://prometheus", "ddp", (figures,), 0.0))
    cluster = view.ranks[0].peak
    # The report, its JSON per step and its text's highest.
    document = build_report(recording)
    reported = document["steps"][-1]["peak"]["held"]

    assert tui == int(exported) == cluster == reported == truth(last)
    assert cluster_json(view)["ranks"][0]["peak"]["held"] == truth(last)
    assert format_bytes(truth(last)) in render_cluster_text(view)
    top = max(steps, key=truth)
    line = re.search(r"^peak \(([^)]*)\): (.*) at step (\d+)", render_text(recording), re.M)
    assert line is not None and "DDP" in line[1]
    assert (line[2], int(line[3])) == (format_bytes(truth(top)), top.step)
    assert document["peaks"]["steady"] == max(truth(step) for step in steps[1:])


def test_without_a_wrapper_the_peak_is_the_piles_total(builder: ModuleType) -> None:
    messages = builder.demo_messages()
    session = Session(live=False)
    session.ingest(messages)
    assert session.recording is not None
    step = session.recording.steps[-1]
    assert piles_view(step, None, True).peak == sum(step.peak.counted())
    document = build_report(session.recording)
    assert document["steps"][-1]["peak"]["held"] == document["steps"][-1]["peak"]["total"]
