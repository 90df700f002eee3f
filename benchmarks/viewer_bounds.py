"""What the viewer's commands cost on large recordings: time, peak memory and output size.

    python benchmarks/viewer_bounds.py report --steps 200000      # report --json and text
    python benchmarks/viewer_bounds.py tensorboard --kinds 3000   # export with many alert kinds

Each command runs in a fresh interpreter under `/usr/bin/time -v` (peak RSS is its "Maximum
resident set size"), on a synthetic recording written first (`viewer_bench.synthetic_step`:
a GPU job's step shape). Targets, printed for information and never asserted:

- `report --json` streams its steps, so its peak stays near what the recording's fold holds,
  not a multiple of the document it prints;
- `export --format tensorboard` writes work linear in steps plus alerts: a recording whose every
  step raises a kind of its own (a newer agent's kinds, kept as written) once wrote every kind
  at every step, steps x kinds values (2.3 MB of recording made 238 MB of events).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import viewer_bench

from memtui_protocol import schema, wire


def measured(argv: list[str]) -> tuple[float, int, int]:
    """(seconds, peak RSS in bytes, stdout bytes) of `python -m memtui ARGV`."""
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "memtui", *argv]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, check=False)
    seconds = time.perf_counter() - started
    stderr = result.stderr.decode(errors="replace")
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    if result.returncode not in (0, 3) or found is None:
        raise SystemExit(f"memtui {' '.join(argv)} failed ({result.returncode}): {stderr[-2000:]}")
    return seconds, int(found.group(1)) * 1024, len(result.stdout)


def report_cost(steps: int, folder: Path) -> None:
    path = folder / "long.memtui"
    size = viewer_bench.write_recording(path, steps)
    print(f"recording: {steps:,} steps, {size / 1e6:.1f} MB")
    for argv in (["report", str(path), "--json"], ["report", str(path)]):
        seconds, peak, output = measured(argv)
        print(
            f"  memtui {' '.join(argv[:1] + argv[2:]):<16} {seconds:7.1f} s   "
            f"peak RSS {peak / 1e6:8.1f} MB   output {output / 1e6:7.1f} MB"
        )


def write_many_kinds(path: Path, steps: int, kinds: int) -> int:
    """A finished recording of `steps` steps; step i raises one alert of kind `kind-(i % kinds)`
    (kinds a newer agent might send: the reader keeps each as written)."""
    with open(path, "wb") as handle:
        handle.write(wire.preamble())
        handle.write(wire.encode(viewer_bench.hello()))
        handle.write(wire.encode(viewer_bench.names()))
        for number in range(1, steps + 1):
            step = viewer_bench.synthetic_step(number)
            alert = schema.Alert(kind=f"kind-{number % kinds}", message=f"alert at step {number}")
            handle.write(wire.encode(msgspec.structs.replace(step, alerts=[alert])))
        end = schema.End(time=viewer_bench.STARTED_UNIX + steps, status="ok", code=0, step=steps)
        handle.write(wire.encode(end))
    return path.stat().st_size


def tensorboard_cost(steps: int, kinds: int, folder: Path) -> None:
    path = folder / "kinds.memtui"
    size = write_many_kinds(path, steps, kinds)
    print(f"recording: {steps:,} steps, {kinds:,} alert kinds, {size / 1e6:.2f} MB")
    out = folder / "tb"
    seconds, peak, _ = measured(["export", str(path), "--format", "tensorboard", "-o", str(out)])
    events = sum(file.stat().st_size for file in out.rglob("events.out.tfevents.*"))
    print(
        f"  export --format tensorboard  {seconds:7.1f} s   peak RSS {peak / 1e6:8.1f} MB   "
        f"events {events / 1e6:8.2f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser("report", help="report --json and text of a long recording")
    report.add_argument("--steps", type=int, default=200_000)
    board = commands.add_parser("tensorboard", help="export a recording of many alert kinds")
    board.add_argument("--steps", type=int, default=3_000)
    board.add_argument("--kinds", type=int, default=3_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="memtui-bench-") as folder:
        if args.command == "report":
            report_cost(args.steps, Path(folder))
        else:
            tensorboard_cost(args.steps, args.kinds, Path(folder))


if __name__ == "__main__":
    main()
