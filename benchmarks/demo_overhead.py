"""Overhead of the agent on `memtui demo`, measured A/B interleaved in one run.

Prints the median training-loop time with and without the agent, their ratio, the recording's
bytes per step and the median Step frame size. Run on demand:

    python benchmarks/demo_overhead.py [--pairs 5] [--steps 40]

Absolute times are not comparable across machines or runs; the ratio is the result.
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
    """Run the interleaved pairs and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    job = ["-m", "memtui_agent.demo.tiny_lm", "--steps", str(args.steps), "--quiet"]
    with tempfile.TemporaryDirectory() as folder:
        recording = Path(folder) / "demo.memtui"
        plain_env = dict(os.environ)
        agent_env = dict(os.environ, MEMTUI_RECORD=str(recording))
        plain, monitored = [], []
        for _ in range(args.pairs):
            plain.append(_loop_seconds([sys.executable, *job], plain_env))
            monitored.append(
                _loop_seconds(
                    [sys.executable, "-m", "memtui_agent.runner", "--module", *job[1:]], agent_env
                )
            )
        from memtui_agent import schema, wire
        from memtui_agent.wire import FrameDecoder

        data = recording.read_bytes()
        steps = [m for m in FrameDecoder().feed(data) if isinstance(m, schema.Step)]
        frame_sizes = sorted(len(wire.encode(step)) for step in steps)
    base, agent = statistics.median(plain), statistics.median(monitored)
    print(f"{'configuration':<28}{'median loop s':>14}{'ratio':>8}")
    print(f"{'no monitoring':<28}{base:>14.3f}{1.0:>8.3f}")
    print(f"{'memtui agent (defaults)':<28}{agent:>14.3f}{agent / base:>8.3f}")
    print(
        f"recording: {len(data)} bytes for {len(steps)} steps = {len(data) / len(steps):.0f} B/step"
    )
    print(f"Step frame: median {frame_sizes[len(frame_sizes) // 2]} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
