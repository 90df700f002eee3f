"""A close that ran no forward and no backward (the second of two optimizers stepped after one
backward) has its activations measured at 0: autograd's node counter saw no node, so nothing
was saved (`decision._nothing_saved`), where memtui used to say "not known" at every second
close, with a reason about calls the step never made."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_harness import alone_and_recorded
from repo_paths import FIXTURES

pytestmark = pytest.mark.slow  # torch children, with and without `memtui run`

JOB = FIXTURES / "two_optimizers_one_backward.py"


def test_the_second_optimizers_closes_are_measured_empty(tmp_path: Path) -> None:
    plain, monitored, report = alone_and_recorded(JOB, tmp_path)
    assert monitored["losses"] == plain["losses"]
    steps = report["steps"]
    assert len(steps) == 24  # two closes per iteration
    unknown = [step["step"] for step in steps if step["max"]["activations"] is None]
    assert unknown == []
    saved = {step["max"]["activations"] for step in steps[0::2]}
    assert len(saved) == 1 and saved.pop() > 0  # the forward's closes: the same batch shape
    for step in steps[1::2]:
        assert step["optimizer"].startswith("Adam#"), step
        assert step["activations_measured"] and step["max"]["activations"] == 0, step["step"]
        assert step["end"]["activations"] == 0
    assert not [alert for alert in report["alerts"] if alert["kind"] == "activations_vary"]
