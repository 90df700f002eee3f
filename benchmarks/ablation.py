"""Where the agent's overhead goes: each kind of hook taken out in turn, inside one process.

    python benchmarks/ablation.py                  # the many-small-modules model, 20 rounds
    python benchmarks/ablation.py --job gpt --rounds 10

`run.py` compares tools across fresh processes, which is right for a headline ratio but too
noisy to split a 1.7x into its parts. Here one process trains with the agent and alternates
blocks of steps (A B C ... A B C ...) between: no agent at all (every hook removed), the whole
agent, and the agent without its module hooks, without its gradient hooks, without its
saved-tensor hooks. The first step of each block is dropped (it pays for re-installing hooks);
the table shows each variant's median step and its ratio to no agent. A variant's distance from
"agent" is what that kind of hook costs, mechanism and body together.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

VARIANTS = {
    "none": "no agent (every hook removed)",
    "agent": "memtui agent (defaults)",
    "modules": "  without module hooks",
    "grads": "  without gradient hooks",
    "pack": "  without saved-tensor hooks",
}


def measure(
    job: Any, without: Callable[[str], Any], rounds: int, block: int
) -> dict[str, list[float]]:
    """Per-variant step times over `rounds` interleaved blocks of `block` steps."""
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    clock = time.perf_counter
    for _ in range(rounds):
        for name in VARIANTS:
            kind = {"none": "all", "agent": None}.get(name, name)
            with without(kind) if kind else contextlib.nullcontext():
                for index in range(block):
                    started = clock()
                    job.step()
                    if index:
                        times[name].append(clock() - started)
    return times


def main() -> int:
    """Parse the arguments, train, print the table."""
    parser = argparse.ArgumentParser(description="in-process ablation of the agent's hooks")
    parser.add_argument("--job", default="stack", choices=["gpt", "stack"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=4, help="steps per block (first dropped)")
    parser.add_argument("--nan-check", default="default", choices=["default", "full", "off"])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from models import build_job

    import memtui_agent
    from memtui_agent.startup.parts import AgentParts

    # Every hook armed on every step: the ablation takes them out one kind at a time.
    agent = memtui_agent.start(
        record=None, socket=False, nan_check=args.nan_check, activations="every"
    )
    if agent is None or not isinstance(agent.parts, AgentParts):
        raise SystemExit("memtui agent did not start")
    job = build_job(args.job, quick=False)
    for _ in range(8):  # warm-up: optimizer state, allocator, the agent's first sightings
        job.step()
    times = measure(job, agent.parts.tracker.without, max(1, args.rounds), max(2, args.block))
    memtui_agent.stop()
    base = statistics.median(times["none"])
    print(f"{args.job}, nan_check={args.nan_check}: {args.rounds} rounds of {args.block} steps")
    for name, label in VARIANTS.items():
        median = statistics.median(times[name])
        print(f"  {label:<32} {median * 1000:8.2f} ms  {median / base:6.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
