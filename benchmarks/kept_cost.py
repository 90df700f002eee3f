"""What counting the tensors a job keeps costs a step, and what the between-roots hook costs.

    python benchmarks/kept_cost.py                       # gpt, stack; 40 steps each
    python benchmarks/kept_cost.py --jobs stack --steps 300
    python benchmarks/kept_cost.py --quick               # models.py's small sizes

Each job of `models.py` runs in this process under the agent (`build_parts`, `--activations
auto`): the closes that took a census (the third, then doubling gaps, `memory/kept.py`) say
what it cost (`Step.census`: seconds, references looked at) and what it found (`Step.kept`);
their step times are printed beside the median step. The job keeps an EMA of its model as a
list of tensors, as a distillation job does, so the census has something to name. Then the
between-roots hook (`hooks/module_scout.py`): what one root call pays for taking it out and
putting it back, timed over many pairs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from models import build_job

from memtui_agent.startup.parts import build_parts
from memtui_agent.steps.frame import ClosedStep
from memtui_protocol.config import AgentConfig
from memtui_protocol.units import format_bytes


def run(name: str, steps: int, quick: bool) -> None:
    """One job under the agent; the census closes against the median step."""
    job = build_job(name, quick=quick)
    frames: list[ClosedStep] = []

    def emit(item: object) -> None:
        if isinstance(item, ClosedStep):
            frames.append(item)

    parts = build_parts(AgentConfig(), emit, lambda *args: None)
    parts.install()
    ema = [parameter.detach().clone() for parameter in job.model.parameters()]
    times = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            job.step()
            times.append(time.perf_counter() - started)
            with torch.no_grad():
                torch._foreach_lerp_(ema, list(job.model.parameters()), 0.01)
    finally:
        parts.remove()
    median = statistics.median(times[3:])
    print(f"{name}: median step {median * 1e3:.1f} ms over {steps} steps")
    for frame in frames:
        cost, kept = frame.inputs.census, frame.inputs.kept
        if cost is None or kept is None:
            continue
        top = kept.holders[0] if kept.holders else None
        named = f"{top.holder} {format_bytes(top.bytes)}" if top else "-"
        print(
            f"  step {frame.inputs.step}: census {cost.seconds * 1e3:.1f} ms, "
            f"{cost.objects} references, step {times[frame.inputs.step - 1] * 1e3:.1f} ms; "
            f"kept {format_bytes(kept.bytes or 0)} in {kept.tensors} tensors (largest: {named})"
        )
    del ema


def scout_pair_cost(pairs: int) -> float:
    """Seconds one take-out-and-put-back of the between-roots hook costs."""
    parts = build_parts(AgentConfig(), lambda item: None, lambda *args: None)
    parts.install()
    scout = parts.tracker.hooks.roots._scout
    try:
        started = time.perf_counter()
        for _ in range(pairs):
            scout.off()
            scout.on()
        return (time.perf_counter() - started) / pairs
    finally:
        parts.remove()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="gpt,stack")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="models.py's small sizes")
    options = parser.parse_args()
    for name in options.jobs.split(","):
        run(name, options.steps, options.quick)
    print(f"between-roots hook: {scout_pair_cost(100_000) * 1e6:.2f} us per root call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
