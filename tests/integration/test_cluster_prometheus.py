"""Beyond one machine, against the real engine: a Prometheus server (Debian's `prometheus`,
installed by .ci/run) scrapes a simulated two-node job through the `file_sd` files its ranks
write into one session folder.

Two `torchrun` launches on this machine (`--nnodes 2 --nproc-per-node 2`, node ranks 0 and 1,
gloo on 127.0.0.1, a tiny DDP model on CPU), each under `memtui run --metrics-port`, train in
lock-step until the test says stop. Meanwhile a single-process job of another name is killed
with SIGKILL, so its target stays and its scrapes fail. Every address is on the loopback; every
process started here is stopped in the fixture's `finally`, also when a test fails.

Checked: every raw sample Prometheus scraped equals the recording's figures at the step the
same scrape reported (`memtui report --json`), for every rank; `memtui cluster --once` lists
the four ranks and names the worst; the killed job's rank is one "stopped reporting" line; an
unreachable Prometheus is one line and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI
from repo_paths import REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="the prometheus binary is not installed (apt-get install prometheus; .ci/run "
        "installs it)",
    ),
]

STEPS_AT_LEAST = 4
"""Steps every rank must have closed, as Prometheus saw them, before the job is told to stop."""
DEADLINE = 90.0
"""The whole scenario's bound (starting torch in six processes on two shared cores is most)."""

DDP_JOB = """
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
ddp = DDP(model)
opt = torch.optim.AdamW(ddp.parameters())
stop_file = sys.argv[1]
stop = torch.zeros(1)
for step in range(1000):  # bounded: about 4 minutes at most, then it ends by itself
    opt.zero_grad()
    ddp(torch.randn(8 * (1 + rank), 32)).pow(2).mean().backward()  # rank 3 holds the most
    opt.step()
    time.sleep(0.2)
    stop[0] = float(rank == 0 and os.path.exists(stop_file))
    dist.broadcast(stop, 0)  # every rank stops after the same step
    if stop.item():
        break
dist.destroy_process_group()
"""

LONE_JOB = """
import time, torch
torch.set_num_threads(1)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(1500):  # killed by the test long before
    opt.zero_grad(); model(torch.randn(4, 16)).sum().backward(); opt.step(); time.sleep(0.2)
"""


def free_port(consecutive: int = 1) -> int:
    """A loopback port whose next `consecutive - 1` ports are free too (PORT + LOCAL_RANK)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base: int = probe.getsockname()[1]
        if base + consecutive > 65535:
            continue
        try:
            held = []
            for offset in range(consecutive):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
        return base
    raise RuntimeError("no free loopback ports")


def query(url: str, promql: str) -> Any:
    address = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(address, timeout=5) as answer:
        document = json.load(answer)
    assert document["status"] == "success", document
    return document["data"]["result"]


def wait_for(what: str, check: Any, deadline: float, pause: float = 0.5) -> Any:
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(pause)


def stop_process(process: subprocess.Popen[Any]) -> None:
    """SIGTERM to its process group, then SIGKILL (the group holds torchrun's ranks)."""
    if process.poll() is not None:
        return
    for signum, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def memtui(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MEMTUI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The scenario, run once: what the tests below read."""
    root = tmp_path_factory.mktemp("cluster")
    session, lone = root / "twonode", root / "lone"
    session.mkdir()
    lone.mkdir()
    stop_file = root / "stop"
    (root / "job.py").write_text(DDP_JOB)
    (root / "lone.py").write_text(LONE_JOB)
    prometheus_port = free_port()
    url = f"http://127.0.0.1:{prometheus_port}"
    (root / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 500ms\n  scrape_timeout: 400ms\n"
        "scrape_configs:\n  - job_name: memtui\n    honor_labels: true\n"
        "    file_sd_configs:\n      - refresh_interval: 1s\n        files:\n"
        f"          - {session}/prometheus/*.json\n          - {lone}/prometheus/*.json\n"
    )
    env = dict(
        os.environ,
        MEMTUI_RUNTIME_DIR=str(root / "rt"),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    master = free_port()
    processes: list[subprocess.Popen[Any]] = []
    logs = []

    def start(name: str, command: list[str]) -> subprocess.Popen[Any]:
        log = open(root / f"{name}.log", "w")  # noqa: SIM115 (closed in the finally)
        logs.append(log)
        process = subprocess.Popen(
            command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        processes.append(process)
        return process

    started = time.monotonic()
    deadline = started + DEADLINE
    try:
        start("prometheus", [
            "prometheus", f"--config.file={root / 'prometheus.yml'}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
        ])  # fmt: skip
        nodes = []
        for node in (0, 1):
            nodes.append(start(f"node{node}", [
                *MEMTUI, "run", "--headless",
                "--metrics-port", str(free_port(2)), "-o", str(session), "--",
                torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                "--master-addr", "127.0.0.1", "--master-port", str(master),
                str(root / "job.py"), str(stop_file),
            ]))  # fmt: skip
        lone_run = start("lone", [
            *MEMTUI, "run", "--headless", "--metrics-port",
            str(free_port()), "-o", str(lone), "--", sys.executable, str(root / "lone.py"),
        ])  # fmt: skip

        def stepping(job: str, ranks: int) -> bool:
            try:
                found = query(url, f'memtui_step{{job="{job}"}} >= {STEPS_AT_LEAST}')
            except OSError:
                return False
            return len(found) == ranks

        wait_for("four ranks stepping in Prometheus", lambda: stepping("twonode", 4), deadline)
        wait_for("the lone job stepping in Prometheus", lambda: stepping("lone", 1), deadline)
        running = memtui("cluster", "--prometheus", url, "--job", "twonode", "--once")
        running_json = memtui("cluster", "--prometheus", url, "--job", "twonode", "--json")
        # The lone job dies (SIGKILL, no final frame, its target file stays).
        info = query(url, 'memtui_agent_info{job="lone"}')
        os.kill(int(info[0]["metric"]["pid"]), signal.SIGKILL)
        wait_for(
            "the killed job's target to go down",
            lambda: query(url, 'up{job="lone"} == 0'),
            deadline,
        )
        killed = memtui("cluster", "--prometheus", url, "--job", "lone", "--once")
        stop_file.touch()
        for launch in nodes:
            launch.wait(max(1.0, deadline - time.monotonic()))
        lone_run.wait(max(1.0, deadline - time.monotonic()))
        report = memtui("report", str(session), "--json")
        assert report.returncode == 0, report.stderr
        yield {
            "url": url,
            "session": session,
            "nodes": [node.returncode for node in nodes],
            "running": running,
            "running_json": running_json,
            "killed": killed,
            "ranks": json.loads(report.stdout)["ranks"],
            "seconds": time.monotonic() - started,
            "logs": root,
        }
    finally:
        for process in reversed(processes):
            stop_process(process)
        for log in logs:
            log.close()


def _log_tail(cluster: dict[str, Any]) -> str:
    root = cluster["logs"]
    return "\n".join(
        f"--- {path.name}\n{path.read_text()[-1500:]}" for path in sorted(root.glob("*.log"))
    )


def test_the_two_node_job_ran_whole_in_bounded_time(cluster: dict[str, Any]) -> None:
    assert cluster["nodes"] == [0, 0], _log_tail(cluster)
    assert sorted(cluster["ranks"]) == ["0", "1", "2", "3"]
    folder = cluster["session"] / "prometheus"
    assert not list(folder.glob("*.json")), "a rank that ended cleanly removes its target file"
    assert cluster["seconds"] < DEADLINE


def test_every_scraped_sample_equals_the_recording_at_the_same_step(
    cluster: dict[str, Any],
) -> None:
    """Raw samples (`NAME[10m]`: what each scrape returned, with its time), joined on the
    scrape time with `memtui_step`, against `memtui report --json` at that step."""
    from memtui.input.prometheus_api import PrometheusClient

    client = PrometheusClient(cluster["url"])
    steps: dict[tuple[str, float], int] = {}
    for labels, values in client.range_samples('memtui_step{job="twonode"}[10m]'):
        for stamp, value in values:
            steps[(labels["rank"], stamp)] = int(value)
    piles: dict[tuple[str, float], dict[tuple[str, str], int]] = {}
    for labels, values in client.range_samples('memtui_pile_bytes{job="twonode"}[10m]'):
        for stamp, value in values:
            piles.setdefault((labels["rank"], stamp), {})[(labels["stat"], labels["pile"])] = int(
                value
            )
    rss: dict[tuple[str, float], int] = {}
    for labels, values in client.range_samples('memtui_host_rss_bytes{job="twonode"}[10m]'):
        for stamp, value in values:
            rss[(labels["rank"], stamp)] = int(value)
    peaks: dict[tuple[str, float], int] = {}
    for labels, values in client.range_samples('memtui_peak_bytes{job="twonode"}[10m]'):
        for stamp, value in values:
            peaks[(labels["rank"], stamp)] = int(value)
    assert not client.range_samples('memtui_device_bytes{job="twonode"}[10m]'), (
        "a CPU job serves no device figures (never an unknown as 0)"
    )
    checked: dict[str, set[int]] = {}
    for (rank, stamp), number in steps.items():
        recorded = {step["step"]: step for step in cluster["ranks"][rank]["steps"]}[number]
        expected = {
            (stat, pile): (recorded[stat] if stat != "peak" else recorded["peak"]["piles"])[pile]
            for stat in ("end", "max", "peak")
            for pile in ("weights", "gradients", "optimizer_state", "activations")
        }
        assert piles[(rank, stamp)] == expected, (rank, number)
        assert rss[(rank, stamp)] == recorded["host"]["rss"], (rank, number)
        # The one peak (DDP's buckets included), as the report states it for that step.
        held = recorded["peak"]["held"]
        assert peaks[(rank, stamp)] == held > recorded["peak"]["total"], (rank, number)
        checked.setdefault(rank, set()).add(number)
    assert sorted(checked) == ["0", "1", "2", "3"]
    assert all(len(numbers) >= 2 for numbers in checked.values()), checked


def test_promql_over_every_rank(cluster: dict[str, Any]) -> None:
    """The labels every series carries, and one PromQL answer per rank (the last scraped
    step's activations high) equal to the recording."""
    url = cluster["url"]
    answer = query(
        url, 'last_over_time(memtui_pile_bytes{job="twonode",pile="activations",stat="max"}[10m])'
    )
    steps = {
        sample["metric"]["rank"]: int(sample["value"][1])
        for sample in query(url, 'last_over_time(memtui_step{job="twonode"}[10m])')
    }
    assert len(answer) == 4
    for sample in answer:
        labels = sample["metric"]
        assert labels["world_size"] == "4" and labels["host"] == socket.gethostname()
        assert labels["local_rank"] == str(int(labels["rank"]) % 2)
        recorded = {step["step"]: step for step in cluster["ranks"][labels["rank"]]["steps"]}
        assert int(sample["value"][1]) == recorded[steps[labels["rank"]]]["max"]["activations"]


def test_cluster_once_lists_every_rank_and_names_the_worst(cluster: dict[str, Any]) -> None:
    running = cluster["running"]
    assert running.returncode == 0, running.stderr
    lines = running.stdout.splitlines()
    assert lines[0].startswith("job twonode: 4 rank(s) on 1 host(s)")
    table = [line.split() for line in lines[2:6]]
    # Worst first by peak: rank 3 trains on the largest batch, rank 2 the next (0 and 1 peak
    # alike, at the update, and are then in rank order).
    assert [row[0] for row in table] == ["3", "2", "0", "1"], running.stdout
    assert all(row[-1] == "reporting" for row in table)
    assert any(line.startswith("worst: rank 3 on ") for line in lines), running.stdout
    document = json.loads(cluster["running_json"].stdout)
    assert document["format"] == "memtui-cluster" and document["worst"]["rank"] == 3
    assert [rank["rank"] for rank in document["ranks"]] == [3, 2, 0, 1]
    assert document["imbalance"]["activations"]["heaviest_rank"] == 3
    assert all(rank["live_view"] is None or rank["live_view"].startswith("memtui attach ")
               for rank in document["ranks"])  # fmt: skip


def test_a_rank_that_dies_is_one_stopped_reporting_line(cluster: dict[str, Any]) -> None:
    killed = cluster["killed"]
    assert killed.returncode == 0, killed.stderr
    lines = killed.stdout.splitlines()
    assert lines[2].split()[-2:] == ["stopped", "reporting"], killed.stdout  # the table's state
    reasons = [line for line in lines if line.startswith("rank 0 on ")]
    assert len(reasons) == 1, killed.stdout
    reason = reasons[0]
    assert "stopped reporting: last scrape failed" in reason, killed.stdout
    # Prometheus's own error for the dead endpoint, quoted: refused once the rank is gone, or
    # reset by peer when a scrape was mid-way as it died (seen on a loaded machine, issue 33).
    said = reason.lower()
    assert "connection refused" in said or "connection reset by peer" in said, reason


def test_an_unreachable_prometheus_is_one_line_in_bounded_time(cluster: dict[str, Any]) -> None:
    started = time.monotonic()
    result = memtui("cluster", "--prometheus", f"http://127.0.0.1:{free_port()}", "--once")
    assert result.returncode != 0 and not result.stdout
    assert result.stderr.count("\n") == 1 and "cannot reach Prometheus" in result.stderr
    assert time.monotonic() - started < 15


def test_every_grafana_query_is_valid_promql_with_data(cluster: dict[str, Any]) -> None:
    """The dashboard's queries, its variables filled in as Grafana would, asked of the real
    server: each parses, and the per-rank panels find the job (device panels stay empty on a
    CPU job)."""
    dashboard = REPO / "docs" / "grafana" / "memtui.json"
    document = json.loads(dashboard.read_text())
    fills = {"$job": "twonode", "$rank": ".*", "$__range": "10m", "$__rate_interval": "1m"}
    for panel in document["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in fills.items():
                expr = expr.replace(name, value)
            # Series that ended within the lookback are gone: ask at the job's last scrapes.
            found = query(cluster["url"], f"last_over_time(({expr})[10m:1s])")
            device = "memtui_device_bytes" in expr or "memtui_leak_bytes" in expr
            assert device or found, (panel["title"], expr)
