"""A `torch.compile`d job compiles under the agent exactly what it compiles alone.

dynamo guards every graph on torch's global module hooks (their number and their handles'
keys): the agent installing or removing its hooks between steps, or its between-roots hook
still in place during a model's first call, made dynamo compile the same model again, up to
its recompile limit, after which the job's model ran uncompiled (8 graphs instead of 4 here,
"hit config.recompile_limit"). Once the job has compiled, `auto` measures every step, and the
between-roots hook leaves as a root's first forward starts (`module_scout`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui, scrubbed_env
from repo_paths import FIXTURES

pytestmark = pytest.mark.slow  # torch children, with and without `memtui run`

JOB = FIXTURES / "compiled_recompiles.py"


def _plain(tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "plain.json"
    done = subprocess.run(
        [sys.executable, str(JOB), str(out)],
        capture_output=True,
        text=True,
        cwd=FIXTURES,
        timeout=300,
        env=scrubbed_env(),  # as `run_memtui`'s children: torch on one thread alike
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _monitored(tmp_path: Path, mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
    out = tmp_path / f"{mode}.json"
    recording = tmp_path / f"{mode}.memtui"
    ran = run_memtui(
        "run",
        "--headless",
        "--activations",
        mode,
        "-o",
        str(recording),
        str(JOB),
        str(out),
        cwd=FIXTURES,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    report = run_memtui("report", str(recording), "--json", cwd=FIXTURES)
    assert report.returncode == 0, report.stderr
    return json.loads(out.read_text()), json.loads(report.stdout)


@pytest.mark.parametrize("mode", ["auto", "every"])
def test_the_agent_makes_dynamo_compile_nothing_more(tmp_path: Path, mode: str) -> None:
    plain = _plain(tmp_path)
    assert plain["graphs"] == 4  # the fixture's premise: one graph per batch size
    monitored, report = _monitored(tmp_path, mode)
    assert monitored["graphs"] == plain["graphs"]
    assert monitored["losses"] == plain["losses"]
    steps = report["steps"]
    assert len(steps) == 24
    # Every step measured: nothing carried that dynamo could have compiled differently, and
    # nothing "not known".
    assert all(step["activations_measured"] for step in steps), [
        step["step"] for step in steps if not step["activations_measured"]
    ]
    notes = [alert for alert in report["alerts"] if alert["kind"] == "compiled"]
    if mode == "auto":
        assert [note["step"] for note in notes] == [1], report["alerts"]
        assert "torch.compile" in notes[0]["message"]
    else:
        assert notes == []  # `every` changes nothing: no note
