"""The metrics endpoint inside a real job (fresh interpreters): off by default (nothing imported,
nothing listening), `/metrics` equal to the recording, a port in use or a missing
`prometheus_client` one note while the job runs on and records as before."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI

pytestmark = pytest.mark.slow  # each test starts a torch job in a fresh interpreter

JOB = """
import json, os, sys, threading, urllib.request
import torch, memtui_agent
port = json.loads(sys.argv[2])
agent = memtui_agent.start(record=sys.argv[1], socket=False, metrics_port=port)
model = torch.nn.Linear(8, 4)
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    opt.zero_grad(); model(torch.randn(2, 8)).sum().backward(); opt.step()
found = {
    "imported": "prometheus_client" in sys.modules,
    "threads": sorted(t.name for t in threading.enumerate() if t.name == "memtui-metrics"),
    "port": agent.metrics.port if agent.metrics is not None else None,
}
if agent.metrics is not None:
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics.port}/metrics") as answer:
        found["metrics"] = answer.read().decode()
    found["targets"] = sorted(os.listdir(os.path.join(os.path.dirname(sys.argv[1]), "prometheus")))
memtui_agent.stop()
found["after"] = sorted(os.listdir(os.path.dirname(sys.argv[1])))
print("RESULT " + json.dumps(found))
"""


def run_job(
    tmp_path: Path, port: int | None, prelude: str = ""
) -> tuple[dict[str, Any], str, Path]:
    script = tmp_path / "job.py"
    script.write_text(prelude + JOB)
    record = tmp_path / "run" / "rank-0.memtui"
    record.parent.mkdir()
    result = subprocess.run(
        [sys.executable, str(script), str(record), json.dumps(port)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), result.stderr, record


def report(record: Path) -> dict[str, Any]:
    result = subprocess.run(
        [*MEMTUI, "report", str(record), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    loaded: dict[str, Any] = json.loads(result.stdout)
    return loaded


def test_without_a_port_nothing_is_imported_or_started(tmp_path: Path) -> None:
    found, stderr, _ = run_job(tmp_path, None)
    assert found == {"imported": False, "threads": [], "port": None, "after": ["rank-0.memtui"]}
    assert not stderr


def test_metrics_equal_the_recording_and_the_target_goes_at_the_end(tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    found, stderr, record = run_job(tmp_path, 0)
    assert found["imported"] and found["threads"] == ["memtui-metrics"], stderr
    assert found["targets"] == [f"{socket.gethostname()}-rank0.json"]
    assert found["after"] == ["prometheus", "rank-0.memtui"]  # the target file removed
    assert not list((record.parent / "prometheus").iterdir())
    last = report(record)["steps"][-1]
    served = {
        (sample.name, sample.labels.get("stat"), sample.labels.get("pile")): sample.value
        for family in text_string_to_metric_families(found["metrics"])
        for sample in family.samples
    }
    assert served[("memtui_step", None, None)] == last["step"] == 3
    for stat in ("end", "max"):
        for pile, value in last[stat].items():
            assert served[("memtui_pile_bytes", stat, pile)] == value
    for pile, value in last["peak"]["piles"].items():
        assert served[("memtui_pile_bytes", "peak", pile)] == value
    with pytest.raises(OSError):  # the endpoint is closed once the agent stops
        socket.create_connection(("127.0.0.1", found["port"]), timeout=2).close()


def test_a_port_in_use_is_one_note_and_the_job_records_as_before(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        found, stderr, record = run_job(tmp_path, port)
    assert found["port"] is None and found["threads"] == []
    notes = [line for line in stderr.splitlines() if line.startswith("memtui:")]
    assert len(notes) == 1 and f"metrics port {port}" in notes[0], stderr
    assert "the job runs on" in notes[0]
    assert [step["step"] for step in report(record)["steps"]] == [1, 2, 3]


def test_a_missing_prometheus_client_is_one_note(tmp_path: Path) -> None:
    prelude = "import sys\nsys.modules['prometheus_client'] = None  # as if not installed\n"
    found, stderr, record = run_job(tmp_path, 0, prelude)
    notes = [line for line in stderr.splitlines() if line.startswith("memtui:")]
    assert len(notes) == 1 and "pip install 'memtui[metrics]'" in notes[0], stderr
    assert found["port"] is None
    assert report(record)["exit"]["status"] == "ok"
