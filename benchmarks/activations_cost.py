"""What each `--activations` mode costs, against no monitoring, measured in the same run.

    python benchmarks/activations_cost.py       # gpt, stack, bert, bertpad, llama; 4 rounds
    python benchmarks/activations_cost.py --jobs stack --rounds 6 --steps 60
    python benchmarks/activations_cost.py --clock cpu   # CPU time per step, on a shared machine

Each (job, configuration) runs in a fresh interpreter (`worker.py`), rounds interleaved so that
machine noise spreads over every configuration alike; each process reports the median of its
step times after the first `--warmup` steps (the measured first steps of `auto` included in the
rest, as a user's run would have them). The ratio is the median over rounds of configuration
median / baseline median, printed with its spread (lowest and highest round).

Configurations: none (baseline), floor (the agent's hook set with empty bodies), default
(`auto`), every, full (`--nan-check full`), and on request metrics (the defaults plus the
Prometheus endpoint, scraped once a second: `--configs none,default,metrics`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from procs import MARKER

HERE = Path(__file__).parent
CONFIGS = ["none", "floor", "default", "every", "full"]


def run_worker(job: str, config: str, steps: int, threads: int, clock: str) -> list[float]:
    """Step times of one fresh process, read with `clock` (worker.py's `--clock`)."""
    command = [
        sys.executable,
        str(HERE / "worker.py"),
        "--job",
        job,
        "--config",
        config,
        "--steps",
        str(steps),
        "--clock",
        clock,
    ]
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    import os

    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **env}, check=False
    )
    for line in result.stdout.splitlines():
        if line.startswith(MARKER):
            return list(json.loads(line[len(MARKER) :].strip())["step_s"])
    raise SystemExit(f"{job}/{config} failed:\n{result.stderr[-2000:]}")


def main() -> int:
    """Interleave the rounds, print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="gpt,stack,bert,bertpad,llama")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: each step's CPU time of the whole process (its threads included) instead of "
        "its elapsed time, for a machine that other work shares",
    )
    args = parser.parse_args()
    jobs = args.jobs.split(",")
    configs = args.configs.split(",")
    medians: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for job in jobs:
            for config in configs:
                times = run_worker(job, config, args.steps, args.threads, args.clock)
                medians.setdefault((job, config), []).append(
                    statistics.median(times[args.warmup :])
                )
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{'job':<8}{'config':<10}{'ms/step':>9}{'ratio':>8}{'lowest':>8}{'highest':>8}")
    for job in jobs:
        base = medians[(job, "none")]
        for config in configs:
            own = medians[(job, config)]
            ratios = [mine / theirs for mine, theirs in zip(own, base, strict=True)]
            print(
                f"{job:<8}{config:<10}{statistics.median(own) * 1e3:>9.2f}"
                f"{statistics.median(ratios):>8.3f}{min(ratios):>8.3f}{max(ratios):>8.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
