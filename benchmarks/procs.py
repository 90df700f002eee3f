"""Starting benchmark subprocesses: the worker, the demo job, and TraceML's separate venv.

Every failure here becomes a value (`Failure`), never an exception, so that one tool that will
not install or crashes costs its own row of the table and nothing else.

TraceML lives in its own virtual environment (default `~/.cache/memtui-bench/traceml-venv`,
created by `python benchmarks/run.py --setup-traceml`) so that its dependencies never touch the
project's venv; a `.pth` file points it at this venv's site-packages, so both sides train with the
very same torch build.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "worker.py"
MARKER = "BENCH_RESULT "
DEFAULT_TRACEML_VENV = Path.home() / ".cache" / "memtui-bench" / "traceml-venv"


@dataclass(frozen=True)
class Failure:
    """Why a measurement has no number: one short line for the table."""

    reason: str


@dataclass(frozen=True)
class WorkerResult:
    """What one worker process reported (see worker.py)."""

    step_s: list[float]
    rss_start: int
    rss_end: int
    rss_at: dict[int, int]
    threads: int


def clean_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment minus anything that would start an agent, with the thread count fixed.

    A `MEMTUI_*` variable inherited from a `memtui run` around the benchmark would monitor the
    baseline too. The thread count is fixed because on a small, shared machine an OpenMP pool
    larger than the free cores turns every other process's activity into step-time noise.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEMTUI_")}
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    return env


def _tail(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:110] if lines else "no output"


def _run(
    command: list[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str] | Failure:
    """Run `command` in its own session; on timeout, kill the whole process group.

    `traceml run` starts torchrun and an aggregator below itself: killing only the launcher,
    as `subprocess.run` does, would leave them running into the next measurement.
    """
    try:
        child = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as exc:
        return Failure(f"cannot start: {exc}")
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return Failure(f"timed out after {timeout:.0f} s")
    return subprocess.CompletedProcess(command, child.returncode, stdout, stderr)


def run_worker(
    args: list[str],
    threads: int,
    timeout: float,
    traceml: Path | None = None,
) -> WorkerResult | Failure:
    """Run worker.py with `args` in a fresh interpreter (under `traceml run` if given)."""
    with tempfile.TemporaryDirectory(prefix="memtui-bench-") as scratch:
        if traceml is not None:
            # `traceml run` launches the script through torchrun and an aggregator process;
            # its logs go to the scratch folder, not into the repository.
            command = [
                str(traceml / "bin" / "traceml"),
                "run",
                str(WORKER),
                "--logs-dir",
                str(Path(scratch) / "logs"),
                "--args",
                *args,
            ]
        else:
            command = [sys.executable, str(WORKER), *args]
        done = _run(command, clean_env(threads), Path(scratch), timeout)
    if isinstance(done, Failure):
        return done
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(MARKER):
            data: dict[str, Any] = json.loads(line[len(MARKER) :])
            return WorkerResult(
                step_s=list(data["step_s"]),
                rss_start=int(data["rss_start"]),
                rss_end=int(data["rss_end"]),
                rss_at={int(key): int(value) for key, value in data["rss_at"].items()},
                threads=int(data["threads"]),
            )
    return Failure(f"exit {done.returncode}: {_tail(done.stderr or done.stdout)}")


def run_demo(steps: int, record: Path, threads: int, timeout: float) -> Failure | None:
    """`memtui run`'s runner on the bundled demo job, recording to `record`."""
    command = [
        sys.executable,
        "-m",
        "memtui_agent.startup.runner",
        "--module",
        "memtui_agent.demo.tiny_lm",
        "--steps",
        str(steps),
        "--quiet",
    ]
    env = clean_env(threads, {"MEMTUI_RECORD": str(record), "MEMTUI_SOCKET": "0"})
    done = _run(command, env, ROOT, timeout)
    if isinstance(done, Failure):
        return done
    if done.returncode != 0:
        return Failure(f"exit {done.returncode}: {_tail(done.stderr)}")
    return None


@dataclass
class TraceML:
    """Whether TraceML can be measured here, and if not, why not."""

    venv: Path
    version: str | None = None
    reason: str = field(default="")

    @property
    def usable(self) -> bool:
        """True when the venv has a working `traceml` launcher and `traceml_ai` imports."""
        return self.version is not None


def find_traceml(venv: Path) -> TraceML:
    """Probe `venv` for TraceML without installing anything."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "traceml").exists() or not python.exists():
        return TraceML(
            venv,
            reason=f"not installed in {venv} (python benchmarks/run.py --setup-traceml)",
        )
    probe = "import torch, traceml_ai; print(traceml_ai.__version__)"
    try:
        done = subprocess.run(
            [str(python), "-c", probe], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return TraceML(venv, reason=f"probe failed: {exc}")
    if done.returncode != 0:
        return TraceML(venv, reason=f"does not import: {_tail(done.stderr)}")
    return TraceML(venv, version=done.stdout.strip())


def setup_traceml(venv: Path) -> int:
    """Create `venv`, pip-install traceml-ai into it, and let it see this venv's torch."""
    print(f"creating {venv} and installing traceml-ai into it", file=sys.stderr)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "traceml-ai"],
    ]
    for command in steps:
        if subprocess.run(command).returncode != 0:
            print(f"failed: {' '.join(command)}", file=sys.stderr)
            return 1
    found = list((venv / "lib").glob("python*/site-packages"))
    if not found:
        print(f"no site-packages under {venv / 'lib'}", file=sys.stderr)
        return 1
    # Appended after TraceML's own site-packages: its pinned dependencies win, torch comes
    # from here, so both sides of the comparison run the same torch.
    (found[0] / "zz_memtui_bench_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    probe = find_traceml(venv)
    print(f"traceml-ai {probe.version}" if probe.usable else probe.reason, file=sys.stderr)
    return 0 if probe.usable else 1
