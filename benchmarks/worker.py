"""One benchmark process: train one job under one monitoring configuration, report as JSON.

`run.py` starts a fresh interpreter per measurement because every tool measured here installs
process-wide state (global module hooks, saved-tensor hooks, a dispatch mode, a profiler), and
a process that once ran the agent is not a clean baseline for the next configuration.

The result is one line on stdout, `BENCH_RESULT {json}`, which the parent finds even when a
tool's launcher (TraceML's) prints its own report around it. Configurations:

    none        no monitoring (the baseline)
    floor       the hooks memtui's agent installs, with empty bodies: identity saved-tensor
                hooks, global module pre/post hooks, optimizer pre/post hooks, a post-accumulate
                grad hook per parameter. What any tool that observes these events pays before
                doing any work; the agent cannot cost less than this.
    default     memtui agent, defaults (activations auto; recording to --record, no socket)
    every       memtui agent measuring activations on every step (--activations every)
    full        memtui agent with nan_check="full"
    off         memtui agent with nan_check="off"
    profiler    torch.profiler.profile(activities=[CPU], profile_memory=True) around the loop
    memtracker  torch.distributed._tools.mem_tracker.MemTracker tracking model and optimizer
    traceml     TraceML's trace_step around each step (run under `traceml run`)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from procs import MARKER

MEMTUI_CONFIGS = {
    "default": ("default", "auto"),
    "every": ("default", "every"),
    "full": ("full", "auto"),
    "off": ("off", "auto"),
    "metrics": ("default", "auto"),
}
"""memtui configurations: (nan_check, activations). `metrics` is the defaults plus the
Prometheus endpoint (`metrics_port=0`), scraped once a second by another process (Prometheus
scrapes every 5-15 s as usually configured: this is the busier case)."""
SCRAPE_SECONDS = 1.0
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
"""What a step's time is read with (`--clock`)."""
CONFIGS = ["none", "floor", *MEMTUI_CONFIGS, "profiler", "memtracker", "traceml"]


def rss_bytes() -> int:
    """Resident set size now, after a collection so that garbage does not count."""
    import psutil

    gc.collect()
    return int(psutil.Process().memory_info().rss)


def _loop(
    job: Any,
    steps: int,
    rss_at: set[int],
    wrap: Callable[[], contextlib.AbstractContextManager[Any]],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[float], dict[int, int]]:
    """Run `steps` steps, timing each one with `clock`; sample RSS after the step numbers in
    `rss_at`."""
    times: list[float] = []
    samples: dict[int, int] = {}
    for number in range(1, steps + 1):
        started = clock()
        with wrap():
            job.step()
        times.append(clock() - started)
        if number in rss_at:
            samples[number] = rss_bytes()
    return times, samples


def _identity(value: Any) -> Any:
    return value


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def _empty_hooks(job: Any) -> Iterator[None]:
    """The agent's hook set with bodies that do nothing (the `floor` configuration).

    Same kinds, same registration points and the same per-call mechanism (a Python call from
    C++ for every saved tensor, unpack, module call and accumulated gradient), so the ratio it
    measures is the floor under any implementation of the agent's accounting.
    """
    import torch
    from torch.nn.modules import module
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    handles = [
        module.register_module_forward_pre_hook(_nothing),
        module.register_module_forward_hook(_nothing, always_call=True),
        register_optimizer_step_pre_hook(_nothing),
        register_optimizer_step_post_hook(_nothing),
    ]
    handles += [
        parameter.register_post_accumulate_grad_hook(_nothing)
        for parameter in job.model.parameters()
        if parameter.requires_grad
    ]
    torch._C._autograd._push_saved_tensors_default_hooks(_identity, _identity)
    try:
        yield
    finally:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _outer(config: str, job: Any) -> Iterator[Callable[[], Any]]:
    """Enter the context a tool wants around the whole loop; yield its per-step wrapper.

    MemTracker refuses a second forward of a module until `reset_mod_stats()` clears the
    previous iteration's per-module statistics, so a training loop under it must call that
    once per step; the call is part of using the tool and is timed with the step.
    """
    if config == "profiler":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            yield contextlib.nullcontext
    elif config == "memtracker":
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(job.model, job.optimizer)

        @contextlib.contextmanager
        def per_step() -> Iterator[None]:
            yield
            tracker.reset_mod_stats()

        with tracker:
            yield per_step
    elif config == "floor":
        with _empty_hooks(job):
            yield contextlib.nullcontext
    elif config == "traceml":
        import traceml_ai

        yield lambda: traceml_ai.trace_step(job.model)
    else:
        yield contextlib.nullcontext


def main() -> int:
    """Parse the arguments, run the job, print the result line."""
    parser = argparse.ArgumentParser(description="one benchmark process (see module docstring)")
    jobs = ["gpt", "stack", "stack100", "tiny", "bert", "bertpad", "llama"]
    parser.add_argument("--job", required=True, choices=jobs)
    parser.add_argument("--config", required=True, choices=CONFIGS)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--quick", action="store_true", help="tiny model sizes")
    parser.add_argument("--record", default=None, help="recording path for the memtui agent")
    parser.add_argument("--rss-at", default="", help="comma-separated step numbers")
    parser.add_argument("--profile", default=None, help="write cProfile stats of the loop here")
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: the process's CPU time, every thread of it (the agent's "
        "emitter included), which other processes' load on the machine stretches far less",
    )
    args = parser.parse_args()
    rss_at = {int(item) for item in args.rss_at.split(",") if item}

    from models import build_job

    agent = None
    if args.config in MEMTUI_CONFIGS:
        import memtui_agent

        # Started before the model exists, as `memtui run` does when the job imports torch.
        nan_check, activations = MEMTUI_CONFIGS[args.config]
        agent = memtui_agent.start(
            record=args.record,
            socket=False,
            nan_check=nan_check,
            activations=activations,
            metrics_port=0 if args.config == "metrics" else None,
        )
        if agent is None:
            raise SystemExit("memtui agent did not start")
    scraper = None
    if args.config == "metrics":
        assert agent is not None  # "metrics" is one of MEMTUI_CONFIGS
        if agent.metrics is None:
            raise SystemExit("the metrics endpoint did not start")
        scraper = _scraper(agent.metrics.port)
    if args.config == "traceml":
        import traceml_ai

        traceml_ai.init(mode="auto")
    job = build_job(args.job, args.quick)
    rss_start = rss_bytes()
    profiler = cProfile.Profile() if args.profile else None
    with _outer(args.config, job) as wrap:
        if profiler is not None:
            profiler.enable()
        times, samples = _loop(job, args.steps, rss_at, wrap, CLOCKS[args.clock])
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        rss_end = rss_bytes()
        if args.config == "profiler":
            # Leaving the profiler's context post-processes every recorded event: 20 s and more
            # for the many-module model. That is a cost after training, not per-step overhead,
            # and it would stretch the whole benchmark, so the process reports and ends here.
            _report(args, times, rss_start, rss_end, samples)
            os._exit(0)
    if scraper is not None:
        scraper.kill()
        scraper.wait()
    if agent is not None:
        import memtui_agent

        memtui_agent.stop()
    _report(args, times, rss_start, rss_end, samples)
    return 0


def _scraper(port: int) -> Any:
    """Another process that fetches /metrics every `SCRAPE_SECONDS`, as Prometheus would."""
    import subprocess

    code = (
        "import time, urllib.request\n"
        "while True:\n"
        f"    urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read()\n"
        f"    time.sleep({SCRAPE_SECONDS})\n"
    )
    return subprocess.Popen([sys.executable, "-c", code])


def _report(
    args: argparse.Namespace,
    times: list[float],
    rss_start: int,
    rss_end: int,
    samples: dict[int, int],
) -> None:
    """Print the result line the parent looks for, and flush it (the caller may `_exit`)."""
    import torch

    result = {
        "job": args.job,
        "config": args.config,
        "step_s": times,
        "rss_start": rss_start,
        "rss_end": rss_end,
        "rss_at": {str(number): value for number, value in samples.items()},
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
