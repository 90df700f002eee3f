"""Driving the training measurements: worker processes interleaved round-robin, and cProfile.

Sections 1 and 2 share these runs: every worker reports its step times and its RSS at the end
of the loop, so the overhead table and the memory table come from the same processes.
"""

from __future__ import annotations

import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import procs
from procs import ROOT, Failure, WorkerResult

T = TypeVar("T")
AGENT_CONFIGS = ("off", "default", "full")
CONFIGS: list[tuple[str, str]] = [
    ("none", "no monitoring"),
    ("floor", "hook floor: the agent's hooks, empty"),
    ("off", "memtui, NaN checks off"),
    ("default", "memtui agent (defaults)"),
    ("full", 'memtui, nan_check="full"'),
    ("profiler", "torch.profiler CPU+profile_memory"),
    ("memtracker", "torch MemTracker"),
    ("traceml", "TraceML trace_step"),
]
LABELS = dict(CONFIGS)
JOBS = {"gpt": "GPT-like", "stack": "many small modules"}
SLOW = ("stack", "memtracker")
"""MemTracker's cost per op grows with the module count: seconds per step on 601 modules."""


@dataclass(frozen=True)
class Sizes:
    """How many steps each worker runs."""

    quick: bool
    rounds: int
    warmup: dict[str, int]
    measured: dict[str, int]
    slow_steps: int
    timeout: float
    parallel: int
    """Processes at once: 1 for measurements; 2 in --quick, whose timings mean nothing anyway."""


@dataclass
class Cell:
    """One (job, configuration): per-round median step time and end-of-loop RSS."""

    medians: dict[int, float] = field(default_factory=dict)
    rss_end: list[int] = field(default_factory=list)
    failure: str | None = None

    def median(self) -> float | None:
        """Median over rounds of the per-process medians, or None with no data."""
        return statistics.median(self.medians.values()) if self.medians else None


Cells = dict[tuple[str, str], Cell]


STARTED = time.monotonic()


def say(text: str) -> None:
    """Progress, with the time since start, goes to stderr: stdout holds only the tables."""
    print(f"[{time.monotonic() - STARTED:5.0f} s] {text}", file=sys.stderr, flush=True)


def run_all(tasks: list[Callable[[], T]], parallel: int) -> list[T]:
    """Run `tasks` in order, or `parallel` at a time (each task only waits on a subprocess)."""
    if parallel <= 1:
        return [task() for task in tasks]
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(lambda task: task(), tasks))


def worker_task(
    note: str, args: list[str], threads: int, timeout: float, traceml: Path | None = None
) -> Callable[[], WorkerResult | Failure]:
    """A deferred worker run that says what it is doing when it starts."""

    def task() -> WorkerResult | Failure:
        say(note)
        return procs.run_worker(args, threads, timeout, traceml=traceml)

    return task


def measure_training(sizes: Sizes, threads: int, traceml: procs.TraceML, scratch: Path) -> Cells:
    """Run every (job, configuration) once per round, round-robin, each in a fresh process.

    A configuration that fails once is not retried: the table says why, the others go on.
    The agent configurations record to `scratch/{job}-{config}-{round}.memtui`.
    """
    cells = {(job, config): Cell() for job in JOBS for config, _ in CONFIGS}
    skip = None
    if not traceml.usable:
        skip = f"skipped: {traceml.reason}"
    elif sizes.quick:
        skip = "skipped in --quick (its launcher alone takes ~8 s)"
    if skip is not None:
        for job in JOBS:
            cells[(job, "traceml")].failure = skip
    for index in range(sizes.rounds):
        planned: list[tuple[Cell, int, Callable[[], WorkerResult | Failure]]] = []
        for job in JOBS:
            for config, label in CONFIGS:
                cell = cells[(job, config)]
                slow = (job, config) == SLOW
                if cell.failure is not None or (slow and index > 0):
                    continue
                warmup = 1 if slow else sizes.warmup[job]
                steps = sizes.slow_steps if slow else warmup + sizes.measured[job]
                args = ["--job", job, "--config", config, "--steps", str(steps)]
                if sizes.quick:
                    args.append("--quick")
                if config in AGENT_CONFIGS:
                    args += ["--record", str(scratch / f"{job}-{config}-{index}.memtui")]
                venv = traceml.venv if config == "traceml" else None
                note = f"round {index + 1}/{sizes.rounds}: {JOBS[job]}, {label}"
                task = worker_task(note, args, threads, sizes.timeout, venv)
                planned.append((cell, warmup, task))
        results = run_all([task for _, _, task in planned], sizes.parallel)
        for (cell, warmup, _), result in zip(planned, results, strict=True):
            if isinstance(result, Failure):
                cell.failure = f"failed: {result.reason}"
                continue
            cell.medians[index] = statistics.median(result.step_s[warmup:])
            cell.rss_end.append(result.rss_end)
    return cells


def measure_flatness(
    samples: tuple[int, int, int], threads: int, sizes: Sizes, scratch: Path
) -> dict[str, WorkerResult | Failure]:
    """RSS after each of `samples` steps of the tiny model, unmonitored and monitored."""
    last = samples[-1]
    tasks = []
    for config in ("none", "default"):
        args = ["--job", "tiny", "--config", config, "--steps", str(last)]
        args += ["--rss-at", ",".join(str(n) for n in samples)]
        if config == "default":
            args += ["--record", str(scratch / "flat.memtui")]
        note = f"memory: {last} steps of the 8-block model, {LABELS[config]}"
        tasks.append(worker_task(note, args, threads, sizes.timeout))
    return dict(zip(("none", "default"), run_all(tasks, sizes.parallel), strict=True))


def profile_agent(threads: int, steps: int, top: int, describe: str) -> int:
    """cProfile a monitored run of the many-module model; print the agent's functions.

    cProfile charges its own per-call cost to every Python function, which inflates hooks (many
    cheap calls) against torch's C++ work: read the list as where the agent's time goes, and
    section 1's ratios as what it costs.
    """
    with tempfile.TemporaryDirectory(prefix="memtui-bench-") as folder:
        stats_path = Path(folder) / "agent.prof"
        args = ["--job", "stack", "--config", "default", "--steps", str(steps)]
        args += ["--record", str(Path(folder) / "p.memtui"), "--profile", str(stats_path)]
        result = procs.run_worker(args, threads, 600.0)
        if isinstance(result, Failure):
            print(f"profile failed: {result.reason}")
            return 1
        raw = pstats.Stats(str(stats_path)).stats  # type: ignore[attr-defined]
    agent_root = str(ROOT / "agent")
    total = sum(entry[2] for entry in raw.values())
    agent = [(key, entry) for key, entry in raw.items() if key[0].startswith(agent_root)]
    own = sum(entry[2] for _, entry in agent)
    print(
        f"{describe}: {steps} monitored steps, {total:.2f} s profiled, "
        f"{own:.2f} s ({own / total:.0%}) in the agent's own code"
    )
    # Cumulative time of a wrapper (the agent's `backward`) includes torch's own work inside
    # it; own time is the agent's alone. Both orders are needed to read the profile.
    for title, column in (("by cumulative time", 3), ("by own time", 2)):
        print(f"\nagent functions {title}")
        print(f"{'cumulative':>11}{'own':>9}{'calls':>10}  function")
        ranked = sorted(agent, key=lambda item: -item[1][column])[:top]
        for (filename, line, name), entry in ranked:
            where = f"{Path(filename).relative_to(ROOT)}:{line} {name}"
            print(f"{entry[3]:>10.3f}s{entry[2]:>8.3f}s{entry[1]:>10}  {where}")
    return 0
