"""The agent's own CPU time per step, timed inside one job at its entry points.

    python benchmarks/agent_cpu.py stack            # the 601-module model, defaults
    python benchmarks/agent_cpu.py bert every       # needs transformers
    python benchmarks/agent_cpu.py gpt --nan-check full

Wall-clock ratios (`activations_cost.py`) move with whatever else the machine runs; the CPU
time the agent's own code takes inside a step does far less. Each entry point the job's thread
runs (the root call hooks, the backward wrapper's start, the optimizer hooks, whose post hook
is the step's close) is wrapped with `time.process_time`; the job runs `--warmup` steps, then
`--steps` steps are timed, and the medians per step are printed with the step's own.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

ENTRY_POINTS = {
    "step_hooks.StepHooks": (
        "_backward_starts",
        "_backward_returned",
        "optimizer_pre",
        "optimizer_post",
    ),
    "root_calls.RootHooks": ("_pre", "_post"),
}
"""Methods timed, by class (`optimizer_post` holds the step's close). Both optimizer hooks are
wrapped alike: the agent recognises torch's step wrapper by the frame its hooks are called
from, one frame further up for both."""


def _timed(totals: dict[str, float], name: str, method: Callable[..., Any]) -> Any:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.process_time()
        try:
            return method(*args, **kwargs)
        finally:
            totals[name] += time.process_time() - started

    return timed


def main() -> int:
    """Parse, train, print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="benchmarks/models.py job: gpt, stack, bert, bertpad, llama")
    parser.add_argument("activations", nargs="?", default="auto")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--nan-check", default="default", help="off, default or full")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from memtui_agent.hooks import root_calls, step_hooks

    totals: dict[str, float] = collections.defaultdict(float)
    owners = {
        "step_hooks.StepHooks": step_hooks.StepHooks,
        "root_calls.RootHooks": root_calls.RootHooks,
    }
    for owner, names in ENTRY_POINTS.items():
        cls = owners[owner]
        for name in names:
            setattr(cls, name, _timed(totals, f"{cls.__name__}.{name}", getattr(cls, name)))
    from models import build_job

    import memtui_agent

    memtui_agent.start(
        record=None, socket=False, activations=args.activations, nan_check=args.nan_check
    )
    job = build_job(args.job, False)
    for _ in range(args.warmup):
        job.step()
    steps: list[float] = []
    agent: list[float] = []
    parts: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(args.steps):
        before = dict(totals)
        started = time.process_time()
        job.step()
        steps.append(time.process_time() - started)
        agent.append(sum(totals.values()) - sum(before.values()))
        for name, total in totals.items():
            parts[name].append(total - before.get(name, 0.0))
    print(
        f"{args.job} {args.activations}: step {statistics.median(steps) * 1e3:.2f} ms of CPU, "
        f"the agent's {statistics.median(agent) * 1e3:.3f} ms (medians over {args.steps} steps)"
    )
    for name, values in sorted(parts.items(), key=lambda item: -statistics.median(item[1])):
        print(f"  {name:<28}{statistics.median(values) * 1e3:8.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
