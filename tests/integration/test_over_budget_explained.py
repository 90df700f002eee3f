"""Out of memory explained, on a real CPU job that passes `--budget` (issue 37, item 3).

The job (tests/fixtures/over_budget.py) prints its own numbers each step: its weights, its
optimizer state and the bytes autograd saves for its backward. The end of `memtui run` and
`memtui report` (text and JSON) must name the piles at the step that passed the budget, the
top modules, and the largest batch that fits, and agree with those numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from math import floor
from pathlib import Path
from typing import Any

import pytest
from cli_harness import scrubbed_env
from repo_paths import FIXTURES

_CONSOLE = Path(sys.executable).with_name("memtui")
MEMTUI = [str(_CONSOLE)] if _CONSOLE.exists() else [sys.executable, "-m", "memtui"]
BUDGET = 600_000
"""Over the small steps' peak (weights, gradients and state: 544 KiB), under the big ones'."""


def _memtui(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MEMTUI, *args],
        cwd=cwd,
        env=scrubbed_env(cwd / "rt", TERM="xterm"),
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_a_cpu_job_over_budget_is_explained_in_pile_terms(tmp_path: Path) -> None:
    job = str(FIXTURES / "over_budget.py")
    run = _memtui(["run", "--headless", "--budget", str(BUDGET), "-o", "rec.memtui", job], tmp_path)
    assert run.returncode == 0, run.stderr
    own = {numbers["step"]: numbers for numbers in map(json.loads, run.stdout.splitlines())}
    big = own[4]  # the first step of 64 samples: the one over the budget
    assert big["batch"] == 64 and own[3]["batch"] == 4

    report = _memtui(["report", "--json", "rec.memtui"], tmp_path)
    assert report.returncode == 0, report.stderr
    entry: dict[str, Any] = json.loads(report.stdout)["out_of_memory"]
    assert entry["cause"] == "over_budget" and entry["step"] == 4
    assert entry["budget"] == BUDGET and entry["piles_at"] == "peak"
    piles = entry["piles"]
    # The piles at the step's peak (in `head`'s backward) are the job's own: its weights and
    # optimizer state, `head`'s fresh gradients, and the tensors still saved (`x` and `h`).
    assert piles["weights"] == big["weights"]
    assert piles["optimizer_state"] == big["state"]
    assert piles["gradients"] == big["head"]
    assert piles["activations"] == big["at_peak"]
    assert entry["peak"] == sum(piles.values()) > BUDGET
    # The top module is the ReLU whose output (the wide hidden layer) autograd saves.
    assert entry["top_modules"][0] == {"module": "act", "bytes": big["hidden"]}
    # The largest batch that fits: what is not activations at the peak stays, the activations
    # scale with the batch, per sample as the job's own tensors say.
    per_sample = big["at_peak"] / big["batch"]
    fixed = big["weights"] + big["state"] + big["head"]
    fits = floor((BUDGET - fixed) / per_sample)
    assert 0 < fits < big["batch"]
    assert floor(entry["batch_fraction"] * big["batch"]) == fits

    text = _memtui(["report", "rec.memtui"], tmp_path).stdout.splitlines()
    stderr = run.stderr.splitlines()
    shown = floor(entry["batch_fraction"] * 100) / 100
    expected = [
        f"over budget at step 4: tracked peak {_kib(entry['peak'])}, budget "
        f"{_kib(BUDGET)}, over by {_kib(entry['peak'] - BUDGET)}",
        f"  piles at step 4's peak: weights {_kib(big['weights'])}, gradients "
        f"{_kib(big['head'])}, optimizer_state {_kib(big['state'])}, activations "
        f"{_kib(big['at_peak'])}",
        f"  top modules by saved activations (step 4): act {_kib(big['hidden'])}, ",
        f"  largest batch that fits the budget of {_kib(BUDGET)}: {shown:.2f}x step 4's batch",
    ]
    for line in expected:
        assert any(said.startswith(line) for said in text), (line, text)
        assert any(said.startswith(f"memtui: {line}") for said in stderr), (line, stderr)


def _kib(value: int) -> str:
    return f"{value / 1024:.2f} KiB"
