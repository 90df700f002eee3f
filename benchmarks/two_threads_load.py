"""Two training threads under `memtui run`, many times, beside a loaded CPU (issue 32).

The crash this guards against (SIGSEGV, exit 139: the agent read one thread's gradients while
the other's backward wrote them) showed in 5 of 30 runs only while the machine was loaded, so
this runs the job the way a user does, one `memtui run --headless` per run, with every core
kept busy by spinning processes, and counts how each run ended. The baseline is the same job
without memtui, run the same number of times beside the same load: any crash there is not
memtui's. Each run cycles through the job's four arrangements (two workers; the main thread
beside a worker that steps first, so the agent moves; two workers with GradScaler; the main
thread stepping first), see tests/fixtures/two_threads.py.

    python benchmarks/two_threads_load.py [--runs 200] [--steps 30] [--spinners N]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "two_threads.py"
TIMEOUT_S = 300
"""A run that has not ended by then counts as hung (a healthy run takes seconds)."""


def _spin() -> None:
    """Keeps one core busy until killed."""
    while True:
        pass


def _env(folder: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MEMTUI_")}
    return dict(env, MEMTUI_RUNTIME_DIR=str(folder / "rt"), OMP_NUM_THREADS="1")


def _one(command: list[str], folder: Path) -> str:
    """How one run ended: `ok`, `exit N`, `signal NAME` or `hung`."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            command, cwd=folder, env=_env(folder), capture_output=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return "hung"
    if done.returncode == 0:
        return "ok"
    # `memtui run` exits 128 + N when the job died of signal N, as a shell does.
    code = done.returncode
    if code < 0 or code > 128:
        number = -code if code < 0 else code - 128
        try:
            return f"signal {signal.Signals(number).name}"
        except ValueError:
            return f"signal {number}"
    return f"exit {code}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--spinners", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.spinners)]
    for spinner in spinners:
        spinner.start()
    ended: dict[str, collections.Counter[str]] = {
        "plain": collections.Counter(),
        "memtui run": collections.Counter(),
    }
    seconds = {"plain": 0.0, "memtui run": 0.0}
    try:
        with tempfile.TemporaryDirectory(prefix="memtui-two-threads-") as scratch:
            root = Path(scratch)
            for run in range(args.runs):
                plain = [sys.executable, str(JOB), str(args.steps), "1", "plain", str(run)]
                under = [
                    sys.executable, "-m", "memtui", "run", "--headless", "-o",
                    f"run{run}.memtui", str(JOB), str(args.steps), "1", "memtui", str(run),
                ]  # fmt: skip
                for name, command in (("plain", plain), ("memtui run", under)):
                    started = time.perf_counter()
                    ended[name][_one(command, root / name.replace(" ", "_") / str(run))] += 1
                    seconds[name] += time.perf_counter() - started
                if (run + 1) % 20 == 0:
                    print(f"{run + 1} runs: {dict(ended['memtui run'])}", flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
    print(f"two threads, {args.runs} runs of {args.steps} steps, {args.spinners} spinning cores")
    for name, counts in ended.items():
        bad = args.runs - counts["ok"]
        print(
            f"  {name:10} ok {counts['ok']}/{args.runs}, not ok {bad} {dict(counts)}, "
            f"{seconds[name] / args.runs:.2f} s a run"
        )
    ratio = seconds["memtui run"] / max(seconds["plain"], 1e-9)
    print(f"  memtui run / plain time per run: {ratio:.2f}")
    return 0 if ended["memtui run"]["ok"] == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
