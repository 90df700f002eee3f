"""A `torch.compile`d job compiles under the agent exactly what it compiles alone.

dynamo guards every graph on torch's global module hooks (their number and their handles'
keys): the agent installing or removing its hooks between steps, or its between-roots hook
still in place during a model's first call, made dynamo compile the same model again, up to
its recompile limit, after which the job's model ran uncompiled (8 graphs instead of 4 here,
"hit config.recompile_limit"). Once the job has compiled, `auto` measures every step, and the
between-roots hook leaves as a root's first forward starts (`module_scout`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_harness import alone_and_recorded
from repo_paths import FIXTURES

pytestmark = pytest.mark.slow  # torch children, with and without `memtui run`

JOB = FIXTURES / "compiled_recompiles.py"


@pytest.mark.parametrize("mode", ["auto", "every"])
def test_the_agent_makes_dynamo_compile_nothing_more(tmp_path: Path, mode: str) -> None:
    plain, monitored, report = alone_and_recorded(
        JOB, tmp_path, memtui_args=["--activations", mode]
    )
    assert plain["graphs"] == 4  # the fixture's premise: one graph per batch size
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
