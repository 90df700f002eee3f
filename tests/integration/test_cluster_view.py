"""`memtui cluster` without a Prometheus server: a stand-in HTTP server on the loopback answers the
query API, so the ordering (headroom, then peak), the states of ranks that stopped reporting,
and every way of failing (unreachable, HTTP error, not the API, too large, too slow, several
jobs) are checked in the inner loop. The real engine is in `test_cluster_prometheus.py`."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from memtui.commands.cli import main
from memtui.input.cluster_query import RankFigures
from memtui.input.cluster_source import new_alerts
from memtui.model.cluster import RankState, rank_state

GIB = 1 << 30
NOW = 1_800_000_000.0


def series(
    job: str, rank: int, host: str, name: str, value: float, **labels: str
) -> dict[str, Any]:
    metric = {"__name__": name, "job": job, "rank": str(rank), "host": host,
              "local_rank": str(rank % 2), "world_size": "3", **labels}  # fmt: skip
    return {"metric": metric, "value": [NOW, str(value)]}


def gpu_rank(
    job: str, rank: int, peak_activations: int, used: int, step: int = 12
) -> list[dict[str, Any]]:
    host = f"node{rank // 2}"
    samples = [series(job, rank, host, "memtui_step", step)]
    for stat in ("end", "max", "peak"):
        for pile, value in (("weights", GIB), ("gradients", GIB), ("optimizer_state", 2 * GIB),
                            ("activations", peak_activations)):  # fmt: skip
            samples.append(
                series(job, rank, host, "memtui_pile_bytes", value, stat=stat, pile=pile)
            )
    for kind, value in (("allocated", 5 * GIB), ("device_used", used), ("device_total", 80 * GIB)):
        samples.append(series(job, rank, host, "memtui_device_bytes", value, kind=kind))
    samples.append(series(job, rank, host, "memtui_alerts_total", rank, kind="oom"))
    samples.append(series(job, rank, host, "memtui_step_end_timestamp_seconds", NOW - 1))
    samples.append(series(job, rank, host, "memtui_step_duration_seconds", 0.5))
    samples.append(series(job, rank, host, "memtui_agent_info", 1, pid=str(999_000 + rank)))
    return samples


class FakePrometheus:
    """Answers /api/v1/query from a list of series (by metric name), /api/v1/targets from a
    list of targets; `fresh` are the ranks a plain selector still returns."""

    def __init__(self) -> None:
        self.series: list[dict[str, Any]] = []
        self.fresh: set[tuple[str, str]] = set()
        self.targets: list[dict[str, Any]] = []
        self.raw: tuple[int, bytes] | None = None
        self.delay = 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                time.sleep(fake.delay)
                status, body = fake.raw or (200, fake.answer(self.path))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str) -> bytes:
        parsed = urllib.parse.urlsplit(path)
        if parsed.path == "/api/v1/targets":
            data: Any = {"activeTargets": self.targets}
        else:
            query = urllib.parse.parse_qs(parsed.query)["query"][0]
            name = re.search(r"memtui_[a-z_]+", query)
            job = re.search(r'job="([^"]+)"', query)
            result = [
                item for item in self.series
                if name and item["metric"]["__name__"] == name.group(0)
                and (job is None or item["metric"]["job"] == job.group(1))
                and ("last_over_time" in query
                     or (item["metric"]["job"], item["metric"]["rank"]) in self.fresh)
            ]  # fmt: skip
            data = {"resultType": "vector", "result": result}
        return json.dumps({"status": "success", "data": data}).encode()


@pytest.fixture
def prometheus() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    try:
        yield fake
    finally:
        fake.server.shutdown()
        fake.server.server_close()


def three_ranks(fake: FakePrometheus) -> None:
    fake.series = [
        *gpu_rank("llama", 0, GIB, used=60 * GIB),
        *gpu_rank("llama", 1, 3 * GIB, used=70 * GIB),  # least headroom: worst
        *gpu_rank("llama", 2, 4 * GIB, used=60 * GIB, step=9),  # highest peak; it died
    ]
    fake.fresh = {("llama", "0"), ("llama", "1")}
    fake.targets = [
        {"labels": {"job": "llama", "rank": str(rank)}, "health": health, "lastError": error}
        for rank, health, error in ((0, "up", ""), (1, "up", ""),
                                    (2, "down", "dial tcp 10.0.0.2:9400: connection refused"))
    ]  # fmt: skip


def test_once_orders_by_headroom_then_peak_and_names_the_dead_rank(
    prometheus: FakePrometheus, capsys: pytest.CaptureFixture[str]
) -> None:
    three_ranks(prometheus)
    assert main(["cluster", "--prometheus", prometheus.url, "--once"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("job llama: 3 rank(s) on 2 host(s)")
    # Rank 1 has the least headroom; 0 and 2 have the same, and 2 the higher peak.
    assert [line.split()[0] for line in lines[2:5]] == ["1", "2", "0"], out
    assert "worst: rank 1 on node0 (peak 7.00 GiB, headroom 10.00 GiB)" in out
    assert "activations 4.00x (heaviest rank 2)" in out
    [dead] = [line for line in lines if line.startswith("rank 2 on node1:")]
    assert "stopped reporting: last scrape failed (dial tcp 10.0.0.2:9400" in dead
    assert "last step 9" in dead


def test_json_is_the_same_view(
    prometheus: FakePrometheus, capsys: pytest.CaptureFixture[str]
) -> None:
    three_ranks(prometheus)
    assert main(["cluster", "--prometheus", prometheus.url, "--job", "llama", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["worst"] == {"rank": 1, "host": "node0"}
    assert [rank["rank"] for rank in document["ranks"]] == [1, 2, 0]
    first = document["ranks"][0]
    assert first["headroom"] == 10 * GIB and first["peak"]["total"] == 7 * GIB
    assert first["alerts"] == {"oom": 1} and first["pid"] == 999_001
    assert [rank["stale"] for rank in document["ranks"]] == [False, True, False]
    assert document["imbalance"]["activations"] == {
        "max": 4 * GIB, "min": GIB, "ratio": 4.0, "heaviest_rank": 2,
    }  # fmt: skip


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    started = time.monotonic()
    code = main(argv)
    captured = capsys.readouterr()
    assert code != 0 and not captured.out
    assert captured.err.count("\n") == 1, captured.err
    assert time.monotonic() - started < 10
    return captured.err


def test_every_failure_is_one_line_in_bounded_time(
    prometheus: FakePrometheus, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["cluster", "--prometheus", prometheus.url, "--once", "--timeout", "1"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    assert "cannot reach Prometheus" in one_line_error(
        capsys, ["cluster", "--prometheus", f"http://127.0.0.1:{closed}", "--once"]
    )
    assert "give an http:// or https:// URL" in one_line_error(
        capsys, ["cluster", "--prometheus", "127.0.0.1:9090", "--once"]
    )
    assert "holds no memtui metrics" in one_line_error(capsys, base)
    prometheus.raw = (200, b"<html>Grafana</html>")
    assert "is not a Prometheus query API" in one_line_error(capsys, base)
    prometheus.raw = (200, b'{"status": "success", "data": {"resultType": "matrix"}}')
    assert "is not a Prometheus query API" in one_line_error(capsys, base)
    prometheus.raw = (400, b'{"status": "error", "error": "parse error at char 3"}')
    assert "answered HTTP 400: parse error at char 3" in one_line_error(capsys, base)
    prometheus.raw = (200, b"[" + b"0," * (9 * 1024 * 1024) + b"0]")
    assert "more than 16 MiB" in one_line_error(capsys, base)
    prometheus.raw = None
    prometheus.delay = 3.0
    assert "did not answer within 1 s" in one_line_error(capsys, base)
    prometheus.delay = 0.0
    three_ranks(prometheus)
    prometheus.series += gpu_rank("bert", 0, GIB, used=GIB)
    prometheus.fresh.add(("bert", "0"))
    assert "several memtui jobs (bert, llama): choose one with --job" in one_line_error(
        capsys, base
    )
    assert "no memtui job 'gpt'" in one_line_error(capsys, [*base, "--job", "gpt"])


def test_states() -> None:
    reporting = RankFigures(job="j", rank=0, step=5, fresh=True, health="up", step_end=NOW - 1)
    assert rank_state(reporting, NOW) == (RankState.REPORTING, "")
    hung = RankFigures(job="j", rank=0, step=5, fresh=True, health="up", step_end=NOW - 600)
    state, reason = rank_state(hung, NOW)
    assert state is RankState.NOT_STEPPING and not state.stale
    assert reason.startswith("not stepping: no step closed for 600 s")
    gone = RankFigures(job="j", rank=0, step=5, fresh=False, health=None)
    assert rank_state(gone, NOW)[0] is RankState.GONE and RankState.GONE.stale


def test_the_tui_source_turns_counts_into_alerts() -> None:
    alerts = new_alerts({"oom": 1}, {"oom": 3, "leak": 0, "nonfinite_loss": 1}, since=7)
    assert [(alert.kind, alert.message.split(" (")[0]) for alert in alerts] == [
        ("nonfinite_loss", "1 nonfinite_loss alert since step 7"),
        ("oom", "2 oom alerts since step 7"),
    ]


def test_the_tui_shows_every_rank_from_prometheus(prometheus: FakePrometheus) -> None:
    """The per-job screen over Prometheus sources: the ranks table in worst-first order, the
    dead rank disconnected with its reason."""
    import asyncio

    from memtui.commands.cluster_command import _judge
    from memtui.input.cluster_query import snapshot
    from memtui.input.cluster_source import ClusterPoller, PrometheusRankSource
    from memtui.input.prometheus_api import PrometheusClient
    from memtui.tui.app import MemtuiApp
    from memtui.tui.ranks import RanksTable

    three_ranks(prometheus)
    client = PrometheusClient(prometheus.url)
    poller = ClusterPoller(client, "llama", snapshot(client, "llama"))
    ranks: dict[str, Any] = {
        str(rank): PrometheusRankSource(poller, rank, _judge) for rank in (1, 0, 2)
    }
    app = MemtuiApp(ranks["1"], ranks=ranks)

    async def scenario() -> None:
        async with app.run_test(size=(160, 48)) as pilot:
            for _ in range(10):
                await pilot.pause(0.05)
                app.refresh_view()
            table = app.query_one(RanksTable)
            assert table.view is not None
            assert [row.label for row in table.view.rows] == ["1", "0", "2"]
            assert app.sessions["1"].steps[-1].step == 12
            assert "stopped reporting" in (app.sessions["2"].disconnected or "")
            app.exit(0)

    asyncio.run(scenario())


@pytest.mark.slow  # starts an interpreter
def test_cluster_and_the_tensorboard_export_never_import_torch(
    tmp_path: Path, builder: ModuleType
) -> None:
    """In a fresh interpreter: the viewer's new commands leave torch (and the agent) alone."""
    recording = tmp_path / "demo.memtui"
    recording.write_bytes(builder.encode_recording(builder.demo_messages()))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    code = (
        "import sys\n"
        "from memtui.commands.cli import main\n"
        f"main(['cluster', '--prometheus', 'http://127.0.0.1:{closed}', '--once'])\n"
        f"main(['export', {str(recording)!r}, '--format', 'tensorboard'])\n"
        "loaded = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
        "'memtui_agent'))]\n"
        "print('LOADED', loaded)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert "LOADED []" in result.stdout, result.stdout + result.stderr
    assert (tmp_path / "demo.tensorboard" / "demo").is_dir()
