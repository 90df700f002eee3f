"""Overhead of the agent on `memtui demo`, configurations interleaved in one run.

Prints the median training-loop time without the agent and with it (NaN checks off, default,
full), each as a ratio to no monitoring, plus the recording's bytes per step and the median Step
frame size. Run on demand:

    python benchmarks/demo_overhead.py [--rounds 5] [--steps 40]

Absolute times are not comparable across machines or runs; the ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DONE = re.compile(r"done: (\d+) steps in ([0-9.]+)s")


def _loop_seconds(command: list[str], env: dict[str, str]) -> float:
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    match = DONE.search(result.stdout)
    if match is None:
        raise RuntimeError(f"no timing line in output of {command}: {result.stdout[-500:]}")
    return float(match.group(2))


def main() -> int:
    """Run the configurations round-robin and print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    job = ["-m", "memtui_agent.demo.tiny_lm", "--steps", str(args.steps), "--quiet"]
    agent = [sys.executable, "-m", "memtui_agent.runner", "--module", *job[1:]]
    configurations = {
        "no monitoring": ([sys.executable, *job], None),
        "agent, NaN checks off": (agent, "off"),
        "memtui agent (defaults)": (agent, "default"),
        "agent, full NaN checks": (agent, "full"),
    }
    times: dict[str, list[float]] = {name: [] for name in configurations}
    with tempfile.TemporaryDirectory() as folder:
        recording = Path(folder) / "demo.memtui"
        for _ in range(args.rounds):
            for name, (command, nan_check) in configurations.items():
                env = dict(os.environ)
                if nan_check is not None:
                    env.update(MEMTUI_RECORD=str(recording), MEMTUI_NAN_CHECK=nan_check)
                times[name].append(_loop_seconds(command, env))
        from memtui_agent import schema, wire

        data = recording.read_bytes()
        steps = [m for m in wire.FrameDecoder().feed(data) if isinstance(m, schema.Step)]
        frame_sizes = sorted(len(wire.encode(step)) for step in steps)
    base = statistics.median(times["no monitoring"])
    print(f"{'configuration':<28}{'median loop s':>14}{'ratio':>8}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<28}{median:>14.3f}{median / base:>8.3f}")
    print(f"recording: {len(data)} bytes, {len(steps)} steps: {len(data) / len(steps):.0f} B/step")
    print(f"Step frame: median {frame_sizes[len(frame_sizes) // 2]} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
