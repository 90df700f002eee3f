"""Two training threads under `memtui run`, many times, beside a loaded CPU (issue 32).

The crash this guards against (SIGSEGV, exit 139: the agent read one thread's gradients while
the other's backward wrote them) showed in 5 of 30 runs only while the machine was loaded, so
this runs the job the way a user does, one `memtui run --headless` per run, with every core
kept busy by spinning processes, and counts how each run ended and whether its losses are bit
for bit those of the same arrangement run without memtui beside the same load (the baseline).
Each run cycles through the job's four arrangements (two workers; the main thread beside a
worker that steps first, so the agent moves; two workers with GradScaler; the main thread
stepping first), see tests/fixtures/two_threads.py.

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


def _one(command: list[str], folder: Path, kept: Path) -> tuple[str, str]:
    """How one run ended (`ok`, `exit N`, `signal NAME` or `hung`) and what it printed; the
    output of a run that did not end well is kept in `kept` for a look afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            command, cwd=folder, env=_env(folder), capture_output=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return "hung", ""
    if done.returncode == 0:
        return "ok", done.stdout.decode(errors="replace")
    kept.mkdir(parents=True, exist_ok=True)
    name = f"{folder.parent.name}-{folder.name}"
    (kept / f"{name}.stdout").write_bytes(done.stdout)
    (kept / f"{name}.stderr").write_bytes(done.stderr)
    # `memtui run` exits 128 + N when the job died of signal N, as a shell does.
    code = done.returncode
    if code < 0 or code > 128:
        number = -code if code < 0 else code - 128
        try:
            return f"signal {signal.Signals(number).name}", ""
        except ValueError:
            return f"signal {number}", ""
    return f"exit {code}", ""


ARRANGEMENTS = 4
"""The job's arrangements, run N takes N % 4 (tests/fixtures/two_threads.py)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--spinners", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--keep", type=Path, default=Path("two-threads-failures"),
        help="folder for the output of runs that did not end well",
    )  # fmt: skip
    args = parser.parse_args()
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.spinners)]
    for spinner in spinners:
        spinner.start()
    ended: collections.Counter[str] = collections.Counter()
    seconds = {"plain": 0.0, "memtui run": 0.0}
    try:
        with tempfile.TemporaryDirectory(prefix="memtui-two-threads-") as scratch:
            root = Path(scratch)
            # The baseline: each arrangement once without memtui, beside the same load; its
            # losses are what every run under memtui must print, bit for bit.
            expected: dict[int, str] = {}
            for arrangement in range(ARRANGEMENTS):
                plain = [sys.executable, str(JOB), str(args.steps), "1", "plain", str(arrangement)]
                started = time.perf_counter()
                how, printed = _one(plain, root / "plain" / str(arrangement), args.keep)
                seconds["plain"] += time.perf_counter() - started
                if how != "ok":
                    print(f"the plain job itself failed ({how}): no baseline", file=sys.stderr)
                    return 2
                expected[arrangement] = printed
            for run in range(args.runs):
                under = [
                    sys.executable, "-m", "memtui", "run", "--headless", "-o",
                    f"run{run}.memtui", str(JOB), str(args.steps), "1", "memtui", str(run),
                ]  # fmt: skip
                started = time.perf_counter()
                how, printed = _one(under, root / "memtui_run" / str(run), args.keep)
                seconds["memtui run"] += time.perf_counter() - started
                if how == "ok" and printed != expected[run % ARRANGEMENTS]:
                    how = "losses differ"
                ended[how] += 1
                if (run + 1) % 20 == 0:
                    print(f"{run + 1} runs: {dict(ended)}", flush=True)
    finally:
        for spinner in spinners:
            spinner.kill()
    print(f"two threads, {args.runs} runs of {args.steps} steps, {args.spinners} spinning cores")
    print(f"  memtui run: ok with the plain run's losses {ended['ok']}/{args.runs}, {dict(ended)}")
    plain_s = seconds["plain"] / ARRANGEMENTS
    run_s = seconds["memtui run"] / max(args.runs, 1)
    print(f"  seconds a run: plain {plain_s:.2f}, memtui run {run_s:.2f} ({run_s / plain_s:.2f}x)")
    return 0 if ended["ok"] == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())
