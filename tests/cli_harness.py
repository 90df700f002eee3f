"""The one way the tests run the `memtui` CLI and the jobs it starts, in one scrubbed environment.

A test's child process must see what a user's shell gives memtui and nothing of the machine the
suite runs on: no `MEMTUI_*` setting of the developer's, no launcher's rank variables (a test
says which launch it runs in), no scheduler's job (SLURM, PMIx: an `srun` around the suite would
otherwise turn every run into a task of one launch), torch on one thread (two xdist workers share
the cores), and the runtime folder of the test's own (set by conftest's autouse fixture), so one
test's live job is never another's `attach --list`. Importable because pytest puts `tests/` on
`sys.path` (`pythonpath` in pyproject.toml); tests/ is not a package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TypeAlias

MEMTUI: Final = (sys.executable, "-m", "memtui")
"""The CLI as `python -m memtui`: the interpreter running the suite, whatever its PATH."""

LAUNCH_VARIABLES: Final = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
    "PMIX_NAMESPACE", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
)  # fmt: skip
"""What a launcher or a scheduler sets for its tasks: never inherited from the suite's machine."""

MemtuiCli: TypeAlias = Callable[..., "subprocess.CompletedProcess[str]"]
"""The `memtui_cli` fixture (tests/conftest.py): `memtui_cli(*ARGS, **ENV)` run in the test's
folder."""

DEFAULT_TIMEOUT_S: Final = 240.0
"""A safety net for a child that hangs: far above what any run takes, loaded or not."""


def scrubbed_env(runtime: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment for a child of a test: the suite's own, less every `MEMTUI_*` setting and
    launch variable, with the test's runtime folder (`runtime`, else the one the test runs with)
    and one torch thread; `extra` is set last (a test's own `RANK`, `MEMTUI_*`, `TERM`...)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("MEMTUI_") and key not in LAUNCH_VARIABLES
    }
    folder = str(runtime) if runtime is not None else os.environ.get("MEMTUI_RUNTIME_DIR")
    if folder is not None:
        env["MEMTUI_RUNTIME_DIR"] = folder
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_memtui(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    stdin: int | None = subprocess.DEVNULL,
) -> subprocess.CompletedProcess[str]:
    """`memtui ARGS` to its end, its output as text (never a terminal: stdin is /dev/null unless
    a test wants its own), in `scrubbed_env()` unless `env` is given."""
    return subprocess.run(
        [*MEMTUI, *args],
        cwd=cwd,
        env=scrubbed_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=stdin,
    )


def start_memtui(
    *args: str, cwd: Path, env: dict[str, str] | None = None, stdin: int | None = subprocess.DEVNULL
) -> subprocess.Popen[str]:
    """`memtui ARGS` started and left running (a live job, a viewer), its output piped."""
    return subprocess.Popen(
        [*MEMTUI, *args],
        cwd=cwd,
        env=scrubbed_env() if env is None else env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def alone_and_recorded(
    job: Path, tmp_path: Path, job_args: Sequence[str] = (), memtui_args: Sequence[str] = ()
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A fixture job that writes its results as JSON to the path it is given first, run alone and
    under `memtui run --headless MEMTUI_ARGS`, both in `scrubbed_env()` (torch on one thread
    alike): (its results alone, its results under memtui, `memtui report --json` of the
    recording). Each run must succeed."""
    cwd = job.parent
    alone_out, recorded_out = tmp_path / "alone.json", tmp_path / "recorded.json"
    recording = tmp_path / "job.memtui"
    alone = subprocess.run(
        [sys.executable, str(job), str(alone_out), *job_args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=DEFAULT_TIMEOUT_S,
        env=scrubbed_env(),
    )
    assert alone.returncode == 0, alone.stderr
    ran = run_memtui(
        "run",
        "--headless",
        *memtui_args,
        "-o",
        str(recording),
        str(job),
        str(recorded_out),
        *job_args,
        cwd=cwd,
    )
    assert ran.returncode == 0, ran.stderr
    report = run_memtui("report", str(recording), "--json", cwd=cwd)
    assert report.returncode == 0, report.stderr
    return (
        json.loads(alone_out.read_text()),
        json.loads(recorded_out.read_text()),
        json.loads(report.stdout),
    )
