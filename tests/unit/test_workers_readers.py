"""The DataLoader workers' figures in every reader: the screen's gap rows, the text and JSON
report, the CSV export, the Prometheus exporter; and a recording without them still reads."""

from __future__ import annotations

import json

import msgspec

from memtui.model.leaks import LeakRow, leak_holding
from memtui.model.recording import Recording
from memtui.model.session import Session
from memtui.model.step_rows import gap_rows
from memtui.reports.export import CSV_COLUMNS, csv_rows
from memtui.reports.report import build_report, render_text
from memtui.reports.report_format import strict_json
from memtui_agent.output.metrics import MetricsExporter
from memtui_protocol import metrics, schema
from memtui_protocol.schema import LeakKind

MiB = 1024 * 1024
WORKERS = schema.Workers(count=2, uss=180 * MiB, growth=160 * MiB, pss=350 * MiB, sampled=1.0)
LEAK = schema.Leak(
    holder="dataset.items",
    kind=LeakKind.WORKERS.value,
    bytes=160 * MiB,
    tensors=0,
    per_step=340 * 1024,
    first_step=1,
    fix="keep the samples in one numpy array",
)


def _step(number: int, workers: schema.Workers | None = WORKERS, **fields: object) -> schema.Step:
    piles = schema.Piles(1000, 1000, 0, 0)
    return schema.Step(
        step=number,
        t_start=10.0 + number,
        t_end=10.5 + number,
        end=piles,
        max=piles,
        peak=piles,
        host=schema.Host(rss=400 * MiB),
        workers=workers,
        **fields,  # type: ignore[arg-type]
    )


def _recording(*steps: schema.Step) -> Recording:
    hello = schema.Hello(
        format_version=1, agent_version="t", pid=1, argv=["x.py"], started="now", started_unix=0.0
    )
    session = Session(source_label="test", live=False)
    session.ingest([hello, *steps])
    assert session.recording is not None
    return session.recording


def test_the_screen_shows_the_workers_beside_the_host_levels() -> None:
    rows = gap_rows(_step(3))
    labels = [row.label for row in rows]
    assert labels.index("DataLoader workers") == labels.index("system total") + 1
    row = rows[labels.index("DataLoader workers")]
    assert (row.value, row.delta) == (180 * MiB, 160 * MiB)
    assert "2 worker processes" in row.meaning
    assert "DataLoader workers" not in [row.label for row in gap_rows(_step(3, workers=None))]


def test_the_report_says_the_workers_outside_the_piles() -> None:
    recording = _recording(_step(1), _step(2, leaks=[LEAK]))
    text = render_text(recording)
    assert (
        "DataLoader workers at step 2: 2 processes, private memory (USS) 180.00 MiB, PSS "
        "350.00 MiB, grown 160.00 MiB since they started" in text
    )
    assert "dataset.items (copied into the DataLoader workers): 160.00 MiB of the workers'" in text
    document = json.loads(strict_json(build_report(recording)))
    assert document["steps"][0]["workers"] == {
        "count": 2,
        "uss": 180 * MiB,
        "pss": 350 * MiB,
        "growth": 160 * MiB,
    }
    assert [(leak["holder"], leak["kind"]) for leak in document["leaks"]] == [
        ("dataset.items", "workers")
    ]
    assert leak_holding(LeakRow.of(LEAK, 2)) == "workers' USS"


def test_a_job_without_workers_says_nothing_of_them() -> None:
    recording = _recording(_step(1, workers=None))
    assert "DataLoader workers" not in render_text(recording)
    assert "workers" not in json.loads(strict_json(build_report(recording)))["steps"][0]
    assert csv_rows(recording)[0]["workers_uss"] is None


def test_the_csv_has_the_workers_columns() -> None:
    [row] = csv_rows(_recording(_step(1)))
    assert CSV_COLUMNS[-2:] == ("workers_uss", "workers_growth")
    assert (row["workers_uss"], row["workers_growth"]) == (180 * MiB, 160 * MiB)


def test_prometheus_serves_the_workers_kinds() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    labels = {"job": "j", "host": "h", "rank": "0", "local_rank": "0", "world_size": "1"}
    exporter = MetricsExporter(labels, {"pid": "7", "version": "v", "device": "cpu"})
    exporter.offer(_step(4))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    served = {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if sample.name == metrics.WORKERS_BYTES
    }
    assert served == {"uss": 180 * MiB, "pss": 350 * MiB, "growth": 160 * MiB}
    assert metrics.WORKERS_BYTES in metrics.SERVED


def test_a_step_frame_without_workers_still_decodes() -> None:
    """An older agent's frame has no `workers` (omitted, as every default is): None; a newer
    one round-trips."""
    old = msgspec.msgpack.encode(_step(1, workers=None))
    assert b"workers" not in old
    assert msgspec.msgpack.decode(old, type=schema.Step).workers is None
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(_step(1)), type=schema.Step)
    assert again.workers == WORKERS


def test_tensorboard_scalars_have_the_workers() -> None:
    from memtui.reports.tensorboard_export import step_scalars

    scalars = step_scalars(_step(2))
    assert (scalars["workers/uss"], scalars["workers/growth"], scalars["workers/pss"]) == (
        180 * MiB,
        160 * MiB,
        350 * MiB,
    )
    assert not any(name.startswith("workers/") for name in step_scalars(_step(2, workers=None)))
