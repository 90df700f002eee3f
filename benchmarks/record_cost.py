"""What writing each step's frame on the training thread costs (issue 14, D1).

    python benchmarks/record_cost.py            # 2,000 closes per variant, a few seconds

A step's frame is now built, encoded and appended to the recording with one `os.write` before
`optimizer.step()` returns to the job; before, the training thread only queued it and the
emitter thread did that work. This times `Emitter.put` for a realistic closed step (CPU loss,
dtype inventory, ten top modules, host RSS read at the close) in the same process, interleaved:
- "queue only": appending to a deque, which is what the old training thread paid;
- "frame, no file": building and encoding the frame (no recording);
- "frame + write": the same plus the `os.write` to a recording (what a step pays now);
and prints each as microseconds per step and as a ratio to a small CPU training step timed in
the same run (a 3-layer MLP, batch 32), the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memtui_agent.memory.memory_readers import host_now
from memtui_agent.output.emitter import Emitter
from memtui_agent.steps.activation_policy import Verdict
from memtui_agent.steps.frame import ClosedStep, CloseReading, LedgerReading, StepInputs
from memtui_protocol import schema


def closed_step(number: int) -> ClosedStep:
    """A closed step shaped like a real close: piles, dtypes, a loss tensor, top modules, the
    host read (as the close reads it, on this thread)."""
    piles = schema.Piles(1 << 20, 1 << 20, 2 << 20, 3 << 20)
    dtypes: dict[str, dict[str, schema.DtypeStat]] = {
        pile: {"float32": schema.DtypeStat(1 << 20, 12)} for pile in schema.Pile
    }  # fmt: skip
    top = [schema.ModuleBytes(index, 4096) for index in range(10)]
    ledger = LedgerReading(piles, piles, piles, dtypes, top)
    reading = CloseReading(number, ledger, schema.Allocator())
    inputs = StepInputs(
        step=number, t_start=0.0, t_end=0.0, reading=reading, verdict=Verdict(measured=True),
        microbatches=1, optimizer="AdamW#1", optimizer_step=number, host=host_now(),
    )  # fmt: skip
    return ClosedStep(inputs, [torch.tensor(0.5)])


def time_per_call(action: Any, count: int) -> float:
    """Median seconds per call over blocks of 50 calls."""
    blocks = []
    for _ in range(max(1, count // 50)):
        start = time.perf_counter()
        for _ in range(50):
            action()
        blocks.append((time.perf_counter() - start) / 50)
    return statistics.median(blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.Linear(512, 1))
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(32, 256)

    def train_step() -> None:
        optimizer.zero_grad()
        model(batch).pow(2).mean().backward()
        optimizer.step()

    hello = schema.Hello(
        format_version=schema.FORMAT_VERSION, agent_version="bench", pid=0, argv=[],
        started="", started_unix=0.0,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        recorded = Emitter(Path(folder) / "bench.memtui", None, hello, print)
        unrecorded = Emitter(None, None, hello, print)
        queue: deque[Any] = deque()
        steps = {"n": 0}

        def put(emitter: Emitter) -> None:
            steps["n"] += 1
            emitter.put(closed_step(steps["n"]))

        def queue_only() -> None:
            steps["n"] += 1
            queue.append(closed_step(steps["n"]))
            if len(queue) > 1000:
                queue.clear()

        variants = {
            "baseline: one MLP training step": train_step,
            "queue only (old training thread)": queue_only,
            "frame, no file": lambda: put(unrecorded),
            "frame + write (now)": lambda: put(recorded),
        }
        results: dict[str, list[float]] = {name: [] for name in variants}
        for _round in range(4):  # interleaved, so drift hits every variant alike
            for name, action in variants.items():
                results[name].append(time_per_call(action, args.count // 4))
        recorded.close()
        unrecorded.close()
    base = statistics.median(results["baseline: one MLP training step"])
    print(f"{'variant':36} {'us/step':>9} {'vs step':>9}")
    for name, values in results.items():
        value = statistics.median(values)
        print(f"{name:36} {value * 1e6:9.1f} {value / base:9.3f}")


if __name__ == "__main__":
    main()
