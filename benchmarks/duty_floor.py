"""What the per-step duties that keep a carried step's figures exact cost on their own, on a CPU.

    python benchmarks/duty_floor.py                 # gpt, stack, bert, bertpad, llama
    python benchmarks/duty_floor.py --jobs llama --blocks 6

A carried step under the defaults still does three things at every step: it reads glibc's heap
three times to prove the carry (at the step's start, its first backward and its close), it
reads the gradients pile, and it takes the gradient norm whose pass proves every gradient
finite. This script times those three duties alone, with the agent's own functions, in a job
that runs no agent: a root forward pre-hook, a wrapper on `Tensor.backward` and an optimizer
pre-hook call them at the moments the agent does. Everything else the agent does in a step
(its hooks, the gate's decision, the frame) comes on top, so the percentage printed is a floor
under the agent's cost per step, not an estimate of it.

One fresh process per job, torch on one thread (as `activations_cost.py` runs it); blocks of steps
alternate between the bare job and the job with the duties, and the step's CPU time
(`time.process_time`) is read in the bare blocks, the duties' in the others. Medians over all
blocks; the first step of each block is dropped.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

DUTIES = ("heap", "gradients", "norm")


@contextmanager
def _duties(job: Any, spent: dict[str, float]) -> Iterator[None]:
    """Run the duties at the agent's moments while inside, adding their CPU time to `spent`."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from memtui_agent.memory.gradient_batch import ParameterFacts, gather
    from memtui_agent.steps.grad_norm import group_norm
    from memtui_agent.steps.step_signature import heap_reader

    read = heap_reader()
    if read is None:
        raise SystemExit("glibc's malloc_info is not available here")
    parameters = [p for p in job.model.parameters() if p.requires_grad]
    facts = ParameterFacts.of(parameters)
    clock = time.process_time

    def timed(name: str, work: Callable[[], object]) -> None:
        started = clock()
        work()
        spent[name] += clock() - started

    def on_close(*_args: object) -> None:
        timed("heap", read)
        started = clock()
        batch = gather(parameters, facts)
        spent["gradients"] += clock() - started
        started = clock()
        if batch.groups is None:
            raise SystemExit("the gradients are not one plain group: no fast path to time")
        for (device, _dtype), members in batch.groups.items():
            group_norm(members, device).item()
        spent["norm"] += clock() - started

    original_backward: Callable[..., Any] = torch.Tensor.backward

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        timed("heap", read)
        return original_backward(self, *args, **kwargs)

    handles = [
        job.model.register_forward_pre_hook(lambda *_: timed("heap", read)),
        register_optimizer_step_pre_hook(on_close),
    ]
    torch.Tensor.backward = backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = original_backward  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()


def measure(job: Any, blocks: int, steps: int) -> tuple[list[float], dict[str, list[float]]]:
    """Bare step times and per-step duty times, over `blocks` alternating pairs of blocks."""
    clock = time.process_time
    bare: list[float] = []
    duties: dict[str, list[float]] = {name: [] for name in DUTIES}
    for _ in range(blocks):
        for number in range(steps + 1):
            started = clock()
            job.step()
            if number:
                bare.append(clock() - started)
        spent = dict.fromkeys(DUTIES, 0.0)
        with _duties(job, spent):
            for number in range(steps + 1):
                before = dict(spent)
                job.step()
                if number:
                    for name in DUTIES:
                        duties[name].append(spent[name] - before[name])
    return bare, duties


def _row(name: str, blocks: int, steps: int, warmup: int, quick: bool) -> str:
    """One job's line of the table, measured in this process."""
    import torch

    torch.set_num_threads(1)
    from models import build_job

    job = build_job(name, quick)
    for _ in range(warmup):
        job.step()
    bare, duties = measure(job, blocks, steps)
    step = statistics.median(bare)
    parts = {part: statistics.median(values) for part, values in duties.items()}
    total = statistics.median(map(sum, zip(*duties.values(), strict=True)))
    return (
        f"{name:<9}{step * 1e3:>9.2f}{parts['heap'] * 1e3:>8.3f}"
        f"{parts['gradients'] * 1e3:>8.3f}{parts['norm'] * 1e3:>8.3f}{total * 1e3:>8.3f}"
        f"{total / step:>9.1%}{step * 0.05 * 1e3:>8.3f}"
    )


def main() -> int:
    """Parse; measure each job in a fresh interpreter (a heap that other jobs fragmented reads
    slower: glibc walks every free chunk); print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="gpt,stack,bert,bertpad,llama")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20, help="steps per block")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny model sizes (a smoke test)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(_row(args.jobs, args.blocks, args.steps, args.warmup, args.quick), flush=True)
        return 0
    print(
        f"{'job':<9}{'step ms':>9}{'heap':>8}{'grads':>8}{'norm':>8}{'duties':>8}"
        f"{'of step':>9}{'5 % is':>8}",
        flush=True,
    )
    for name in args.jobs.split(","):
        command = [sys.executable, __file__, "--one", "--jobs", name]
        command += ["--blocks", str(args.blocks), "--steps", str(args.steps)]
        command += ["--warmup", str(args.warmup)] + (["--quick"] if args.quick else [])
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode:
            raise SystemExit(f"{name} failed:\n{result.stderr[-2000:]}")
        print(result.stdout.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
