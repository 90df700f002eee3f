"""The Prometheus endpoint's parts without a training job: the config, the collector (parsed back
with `prometheus_client`'s own exposition parser), the `file_sd` target file and the Grafana
dashboard. The endpoint inside a real job is in `test_metrics_endpoint.py` and, scraped by a
real Prometheus, in `test_cluster_prometheus.py`."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

from memtui_agent.output.metrics import MetricsExporter, job_label
from memtui_agent.output.scrape_target import write_target
from memtui_protocol import metrics, schema
from memtui_protocol.config import AgentConfig
from memtui_protocol.safe_open import RefusedPath

LABELS = {"job": "j", "host": "h", "rank": "3", "local_rank": "1", "world_size": "4"}
DASHBOARD = REPO / "docs" / "grafana" / "memtui.json"


def scrape(exporter: MetricsExporter) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The exposition text `prometheus_client` serves, parsed back: name -> samples."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def step(number: int, **fields: Any) -> schema.Step:
    piles = schema.Piles(1000, 2000, 4000, 123_456_789)
    return schema.Step(
        step=number, t_start=10.0, t_end=10.25, end=piles, max=piles, peak=piles, **fields
    )


def test_the_config_travels_through_the_environment() -> None:
    config = AgentConfig(metrics_port=9400, metrics_addr="0.0.0.0", metrics_job="llama")
    assert AgentConfig.from_env(config.to_env()) == config
    assert AgentConfig.from_env({}).metrics_port is None
    assert AgentConfig.from_env({"MEMTUI_METRICS_PORT": "x"}).metrics_port is None
    assert AgentConfig.from_env({"MEMTUI_METRICS_PORT": "70000"}).metrics_port is None
    assert "MEMTUI_METRICS_PORT" not in AgentConfig().to_env()


def test_nothing_is_served_as_zero_before_the_first_step() -> None:
    exporter = MetricsExporter(LABELS, {"pid": "7", "version": "v", "device": "cpu"})
    served = scrape(exporter)
    assert set(served) == {metrics.AGENT_INFO_SERIES, metrics.ALERTS_TOTAL}
    [(labels, value)] = served[metrics.AGENT_INFO_SERIES]
    assert labels == {**LABELS, "pid": "7", "version": "v", "device": "cpu"} and value == 1


def test_a_step_is_served_exactly_with_every_label() -> None:
    exporter = MetricsExporter(LABELS, {"pid": "7", "version": "v", "device": "cpu"})
    exporter.offer(step(5, host=schema.Host(rss=612_368_384), activations_measured=False))
    served = scrape(exporter)
    assert set(served) <= set(metrics.SERVED)
    for samples in served.values():
        for labels, _ in samples:
            assert {name: labels[name] for name in metrics.LABELS} == LABELS
    piles = {
        (labels["stat"], labels["pile"]): value for labels, value in served["memtui_pile_bytes"]
    }
    assert len(piles) == 12 and piles[("peak", "activations")] == 123_456_789
    assert served["memtui_step"][0][1] == 5
    assert served["memtui_step_duration_seconds"][0][1] == 0.25
    assert served["memtui_step_end_timestamp_seconds"][0][1] == 10.25
    assert served["memtui_activations_measured"][0][1] == 0
    assert served["memtui_host_rss_bytes"][0][1] == 612_368_384
    assert "memtui_device_bytes" not in served  # a CPU job: no device figures, never 0


def test_device_kinds_are_only_those_the_job_has() -> None:
    exporter = MetricsExporter(LABELS, {})
    allocator = schema.Allocator(allocated=10, reserved=20, process_gpu=None, device_total=80)
    exporter.offer(step(1, allocator=allocator))
    kinds = {labels["kind"]: value for labels, value in scrape(exporter)["memtui_device_bytes"]}
    assert kinds == {"allocated": 10, "reserved": 20, "device_total": 80}


def test_alerts_are_counted_wherever_the_stream_carries_them() -> None:
    exporter = MetricsExporter(LABELS, {})
    alert = schema.Alert(kind="nonfinite_loss", message="m")
    exporter.offer(schema.AlertNow(time=1.0, step=1, alert=schema.Alert("over_budget", "m")))
    exporter.offer(step(1, alerts=[alert, schema.Alert(kind="from_a_newer_agent", message="m")]))
    exporter.offer(step(2, late=[schema.StepLate(step=1, alerts=[alert])]))
    exporter.offer(schema.End(time=3.0, status="error", alerts=[schema.Alert("oom", "m")]))
    counts = {labels["kind"]: value for labels, value in scrape(exporter)["memtui_alerts_total"]}
    assert counts["nonfinite_loss"] == 2 and counts["over_budget"] == 1 and counts["oom"] == 1
    assert counts["other"] == 1 and counts["leak"] == 0  # known kinds start at 0
    assert "snapshot" not in counts and "grouped" not in counts  # the viewer's own kinds


def test_leak_holders_are_bounded_in_number_and_length() -> None:
    exporter = MetricsExporter(LABELS, {})
    leaks = [
        schema.Leak(holder=f"holder{index}." + "x" * 200, kind="tensors", bytes=index * 100,
                    tensors=1, per_step=1, first_step=1)
        for index in range(30)
    ]  # fmt: skip
    exporter.offer(step(1, leaks=leaks))
    exporter.offer(step(2, leaks=[schema.Leak("history", "tensors", 5000, 2, 100, 1)]))
    served = {labels["holder"]: value for labels, value in scrape(exporter)["memtui_leak_bytes"]}
    assert len(served) == metrics.MAX_LEAK_HOLDERS
    assert served["history"] == 5000
    assert all(len(holder) <= metrics.MAX_HOLDER_CHARS for holder in served)


def test_the_job_label() -> None:
    assert job_label(AgentConfig(metrics_job="x", record="/a/b/rank-0.memtui"), []) == "x"
    assert job_label(AgentConfig(record="/runs/llama/rank-3.memtui"), []) == "llama"
    assert job_label(AgentConfig(record="/runs/llama/proc-0.memtui"), []) == "llama"
    assert job_label(AgentConfig(record="/runs/one.memtui"), []) == "one"
    assert job_label(AgentConfig(), ["torchrun", "--nnodes", "2", "train.py"]) == "train"


def test_the_target_file_is_file_sd_json_and_refuses_a_planted_link(tmp_path: Path) -> None:
    folder = tmp_path / "prometheus"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    path = folder / metrics.target_file_name("node-1", 3)
    assert path.name == "node-1-rank3.json"
    os.symlink(victim, path)
    with pytest.raises(RefusedPath):
        write_target(path, "127.0.0.1:9401", LABELS)  # a link there: refused, never followed
    path.unlink()
    target = write_target(path, "127.0.0.1:9401", LABELS)
    assert json.loads(path.read_text()) == [{"targets": ["127.0.0.1:9401"], "labels": LABELS}]
    assert path.stat().st_mode & 0o777 == 0o644  # a system Prometheus runs as its own user
    assert victim.read_text() == "untouched"
    assert [p.name for p in folder.iterdir()] == [path.name]  # no temporary left behind
    replacement = folder / "rerun"
    replacement.write_text("[]")
    os.rename(replacement, path)  # a rerun replaced it: not ours any more, kept
    target.remove()
    assert path.exists()


def test_a_linked_target_folder_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, tmp_path / "prometheus")
    with pytest.raises(RefusedPath):
        write_target(tmp_path / "prometheus" / "h-rank0.json", "127.0.0.1:1", LABELS)
    assert not list(elsewhere.iterdir())


def dashboard_queries() -> list[str]:
    document = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in document["panels"] for target in panel["targets"]]


def test_the_grafana_dashboard_queries_only_what_the_exporter_serves() -> None:
    document = json.loads(DASHBOARD.read_text())
    assert document["title"] and document["uid"] and document["schemaVersion"] >= 30
    variables = {item["name"]: item for item in document["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in document["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["targets"]
    names = set()
    for expr in dashboard_queries() + [
        item["definition"] for item in variables.values() if "definition" in item
    ]:
        names |= set(re.findall(r"\bmemtui_[a-z_]+", expr))
    assert names and names <= set(metrics.SERVED), names - set(metrics.SERVED)
    titles = " ".join(panel["title"] for panel in document["panels"]).lower()
    for subject in ("per rank", "worst", "headroom", "alerts"):
        assert subject in titles


def test_a_pile_the_step_does_not_know_has_no_sample() -> None:
    """Null in the frame (a step whose activations are not known, its gradients' high unseen):
    no sample for it, never a 0 a dashboard would plot; `memtui cluster` reads the missing
    sample back as not known, and gives the rank no peak total."""
    from memtui.input.cluster_query import RankFigures

    exporter = MetricsExporter(LABELS, {"pid": "7", "version": "v", "device": "cpu"})
    frame = schema.Step(
        step=5,
        t_start=10.0,
        t_end=10.25,
        end=schema.Piles(1000, 2000, 4000, None),
        max=schema.Piles(1000, None, 4000, None),
        peak=schema.Piles(1000, None, 4000, None),
        activations_measured=False,
    )
    exporter.offer(frame)
    served = {
        (labels["pile"], labels["stat"]): value
        for labels, value in scrape(exporter)[metrics.PILE_BYTES]
    }
    assert served == {
        ("weights", "end"): 1000,
        ("gradients", "end"): 2000,
        ("optimizer_state", "end"): 4000,
        ("weights", "max"): 1000,
        ("optimizer_state", "max"): 4000,
        ("weights", "peak"): 1000,
        ("optimizer_state", "peak"): 4000,
    }
    piles: dict[str, dict[str, int]] = {}
    for (pile, stat), value in served.items():
        piles.setdefault(stat, {})[pile] = int(value)
    read = RankFigures(job="j", rank=3, step=5, piles=piles).step_message()
    assert read is not None
    assert (read.end, read.max, read.peak) == (frame.end, frame.max, frame.peak)
