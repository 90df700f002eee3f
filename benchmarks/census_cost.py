"""What one census of live tensors costs on big structures (issue 32): time and the walk's memory.

    python benchmarks/census_cost.py            # a few seconds per case

A census walks what the job's names hold, bounded by `MAX_OBJECTS` references looked at and
`MAX_SECONDS`. Each case is walked with the default bounds, timed (the median of `--rounds`),
then once more under `tracemalloc` for the peak of what the walk itself allocates (its queue,
its visited set, paths): the job's objects are built before and not counted.

- `5M ints`: a 5,000,000-item list of ints (leaves: looked at, never followed);
- `1M objects`: a list of 1,000,000 small objects, each with one attribute (every one visited);
- `wide dict`: a dict of 200,000 str keys to small lists;
- `retained graphs`: a validation total accumulated over 200 batches without `no_grad`, its
  saved storages recorded as the agent's pack hook records them.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memtui_agent.hooks.saved_tensors import unpack
from memtui_agent.memory.census import MAX_OBJECTS, MAX_SECONDS, Census, take_census
from memtui_agent.memory.ledger import Ledger
from memtui_agent.startup.parts import build_parts
from memtui_protocol.config import AgentConfig


class Small:
    def __init__(self, value: Any) -> None:
        self.value = value


def _retained() -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    ledger = Ledger()

    def fail(component: str, exc: BaseException, effect: str = "") -> None:
        raise exc

    parts = build_parts(AgentConfig(), lambda message: None, fail, ledger)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
    total: Any = 0.0
    with torch.autograd.graph.saved_tensors_hooks(parts.tracker.hooks.counting.pack, unpack):
        for _ in range(200):
            total += nn.functional.cross_entropy(
                model(torch.randn(32, 128)), torch.randint(0, 10, (32,))
            )
    keep = {"ledger": ledger, "parts": parts, "model": model}
    return [("val_total", total)], {"saved": ledger.saved_by_node(), **keep}


def cases() -> dict[str, Callable[[], tuple[list[tuple[str, Any]], dict[str, Any]]]]:
    return {
        "5M ints": lambda: ([("big", list(range(5_000_000)))], {}),
        "1M objects": lambda: ([("objects", [Small(i) for i in range(1_000_000)])], {}),
        "wide dict": lambda: ([("table", {f"k{i}": [i] for i in range(200_000)})], {}),
        "retained graphs": _retained,
    }


def measure(
    roots: list[tuple[str, Any]], extra: dict[str, Any], rounds: int
) -> tuple[float, int, Census]:
    saved = extra.get("saved")
    times = []
    census = take_census(roots, saved=saved)
    for _ in range(rounds):
        started = time.perf_counter()
        census = take_census(roots, saved=saved)
        times.append(time.perf_counter() - started)
    tracemalloc.start()
    try:
        take_census(roots, saved=saved, max_seconds=3600)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return statistics.median(times), peak, census


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"bounds: {MAX_OBJECTS:,} references, {MAX_SECONDS} s")
    print(f"{'case':18s} {'seconds':>8s} {'looked at':>11s} {'stopped':>8s} {'walk peak':>10s}")
    for name, build in cases().items():
        roots, extra = build()
        seconds, peak, census = measure(roots, extra, args.rounds)
        stopped = census.stopped.value if census.stopped is not None else "-"
        print(
            f"{name:18s} {seconds:8.3f} {census.visited:11,d} {stopped:>8s} {peak / 2**20:7.1f} MiB"
        )
        del roots, extra


if __name__ == "__main__":
    main()
