"""memtui's benchmarks in one command: training overhead, agent memory, viewer, recording size.

    python benchmarks/run.py                   # the full table (several minutes)
    python benchmarks/run.py --quick           # every section at tiny sizes, a smoke test (< 60 s)
    python benchmarks/run.py --profile-agent   # where the agent's time goes (cProfile)
    python benchmarks/run.py --setup-traceml   # install TraceML into its own venv, once

Every training measurement runs in a fresh interpreter (worker.py), because each tool installs
process-wide hooks. Configurations are interleaved round-robin (A B C A B C ...), so drift on a
shared machine hits all of them alike; each process reports per-step times, warm-up steps are
dropped, and the table shows the median over rounds of each process's median step and its ratio
to the no-monitoring baseline measured in the same run, with the range of the per-round ratios.
Absolute times are not comparable across machines or runs; the ratios are the result. Targets
are printed next to the numbers and marked PASS/MISS for information: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import procs
import training
import viewer_bench
from procs import DEFAULT_TRACEML_VENV, Failure, WorkerResult
from training import AGENT_CONFIGS, CONFIGS, JOBS, LABELS, SLOW, Cells, Sizes, say

MIB = 1 << 20
OVERHEAD_TARGETS = {
    ("gpt", "default"): 1.03,
    ("stack", "default"): 1.10,
    ("gpt", "full"): 1.15,
    ("stack", "full"): 1.15,
}
RSS_TARGET_MIB = 30.0
FLAT_TOLERANCE_MIB = 2.0
INGEST_TARGET = 5_000.0
OPEN_TARGET_S = 2.0
SEEK_TARGET_MS = 50.0
FRAME_TARGET = 1024


@dataclass(frozen=True)
class Plan:
    """Sizes of one run; `--quick` shrinks every one so the whole table takes under a minute."""

    training: Sizes
    flat_samples: tuple[int, int, int]
    ingest_frames: int
    ingest_repeats: int
    replay_steps: int
    seeks: int
    demo_steps: int
    record_steps: int


FULL = Plan(
    training=Sizes(
        quick=False,
        rounds=4,
        warmup={"gpt": 6, "stack": 10},
        measured={"gpt": 16, "stack": 30},
        slow_steps=2,
        timeout=600.0,
        parallel=1,
    ),
    flat_samples=(1_000, 5_000, 10_000),
    ingest_frames=50_000,
    ingest_repeats=3,
    replay_steps=100_000,
    seeks=200,
    demo_steps=40,
    record_steps=200,
)
QUICK = Plan(
    training=Sizes(
        quick=True,
        rounds=1,
        warmup={"gpt": 2, "stack": 3},
        measured={"gpt": 3, "stack": 5},
        slow_steps=2,
        timeout=120.0,
        parallel=2,
    ),
    flat_samples=(30, 150, 300),
    ingest_frames=2_000,
    ingest_repeats=1,
    replay_steps=2_000,
    seeks=20,
    demo_steps=3,
    record_steps=20,
)


def header(number: int, title: str) -> None:
    """A section header; the smoke test looks for these lines."""
    print(f"\n== {number}. {title} ==")


def table(head: list[str], rows: list[list[str]], left: int = 1) -> None:
    """Print `rows` under `head`: the first `left` columns left-aligned, numbers right-aligned.

    A row shorter than the header is a note (a skipped tool, a failure): its second cell is
    printed as is after the first column and does not widen the columns.
    """
    full = [row for row in [head, *rows] if len(row) == len(head)]
    widths = [max(len(row[i]) for row in full) for i in range(len(head))]
    for row in [head, *rows]:
        if len(row) < len(head):
            print(f"  {row[0]:<{widths[0]}}  {' '.join(row[1:])}")
            continue
        cells = [
            cell.ljust(width) if index < left else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        print("  " + "  ".join(cells).rstrip())


def mark(ok: bool) -> str:
    """Informational verdict next to a target."""
    return "PASS" if ok else "MISS"


def describe_job(job: str, quick: bool) -> str:
    """Shape of a benchmark model, for the tables."""
    if job == "gpt":
        from models import GPT_FULL, GPT_QUICK

        size = GPT_QUICK if quick else GPT_FULL
        return (
            f"{size.layers} blocks, dim {size.dim}, seq {size.seq}, batch {size.batch}, "
            f"vocab {size.vocab}, AdamW fp32"
        )
    blocks = 20 if quick else 200
    return f"{blocks} Linear+LayerNorm blocks, {3 * blocks + 1} modules, width 32, AdamW fp32"


def print_training(plan: Plan, cells: Cells, threads: int) -> None:
    """Section 1: median step, ratio to no monitoring, range of per-round ratios, target."""
    sizes = plan.training
    header(1, "Training overhead")
    print(
        f"{threads} torch thread(s) per process; {sizes.rounds} interleaved round(s), a fresh "
        "process per configuration per round; median step after warm-up"
    )
    for job, title in JOBS.items():
        base = cells[(job, "none")]
        base_median = base.median()
        steps = f"{sizes.measured[job]} steps after {sizes.warmup[job]} warm-up"
        print(f"\n{title}: {describe_job(job, sizes.quick)}; {steps}")
        rows = []
        for config, label in CONFIGS:
            cell = cells[(job, config)]
            median = cell.median()
            if median is None or base_median is None:
                rows.append([label, cell.failure or "no data"])
                continue
            ratios = [
                value / base.medians[index]
                for index, value in cell.medians.items()
                if index in base.medians
            ]
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else "-"
            target = OVERHEAD_TARGETS.get((job, config))
            ratio = median / base_median
            row = [label, f"{median * 1000:.1f} ms", f"{ratio:.3f}x", spread]
            row += [f"<= {target:.2f}x", mark(ratio <= target)] if target else ["", ""]
            rows.append(row)
        table(["configuration", "step", "ratio", "per round", "target", ""], rows)
        floor = cells[(job, "floor")].median()
        if floor is not None and base_median is not None:
            over = [
                f"{LABELS[config]} {median / floor:.3f}x"
                for config in ("default", "full")
                if (median := cells[(job, config)].median()) is not None
            ]
            print(
                f"  the hooks alone cost {floor / base_median:.3f}x; over that floor: "
                + ", ".join(over)
            )
        if (job, "memtracker") == SLOW and cells[SLOW].medians:
            measured = sizes.slow_steps - 1
            print(
                f"  torch MemTracker here: one process, {measured} step(s) after 1 warm-up; "
                "its cost grows with the module count, so more would not fit"
            )


def print_memory(plan: Plan, cells: Cells, threads: int, scratch: Path) -> None:
    """Section 2: RSS each tool adds after the training loop; the agent's RSS over many steps."""
    header(2, "Agent memory")
    print("Process RSS at the end of the section 1 loops (median over rounds) - no monitoring")
    rows = []
    for job, title in JOBS.items():
        base = cells[(job, "none")].rss_end
        for config, label in CONFIGS[1:]:
            values = cells[(job, config)].rss_end
            if not values or not base:
                continue
            rss = statistics.median(values) / MIB
            added = rss - statistics.median(base) / MIB
            row = [title, label, f"{rss:.0f} MiB", f"{added:+.1f} MiB"]
            if config in AGENT_CONFIGS:
                row += [f"<= {RSS_TARGET_MIB:.0f} MiB", mark(added <= RSS_TARGET_MIB)]
            else:
                row += ["", ""]
            rows.append(row)
    table(["model", "configuration", "RSS", "added", "target", ""], rows, left=2)
    print("  (TraceML's aggregator is a separate process: not counted)")
    first, _, last = plan.flat_samples
    runs = training.measure_flatness(plan.flat_samples, threads, plan.training, scratch)
    print(f"\nFlatness: {last:,} steps of an 8-block model (25 modules), agent recording")
    rows = []
    growth: dict[str, float] = {}
    for config, result in runs.items():
        if isinstance(result, Failure):
            rows.append([LABELS[config], f"failed: {result.reason}"])
            continue
        at = [result.rss_at[n] / MIB for n in plan.flat_samples]
        growth[config] = at[-1] - at[0]
        rows.append([LABELS[config], *(f"{value:.1f} MiB" for value in at)])
        rows[-1].append(f"{growth[config]:+.2f} MiB")
    steps = [f"RSS @{n:,}" for n in plan.flat_samples]
    table(["configuration", *steps, f"growth {first:,}->{last:,}"], rows)
    none, agent = runs["none"], runs["default"]
    if isinstance(none, WorkerResult) and isinstance(agent, WorkerResult):
        added = (agent.rss_at[last] - none.rss_at[last]) / MIB
        own = growth["default"] - growth["none"]
        print(
            f"  agent adds {added:+.1f} MiB at step {last:,} "
            f"(target <= {RSS_TARGET_MIB:.0f} MiB: {mark(added <= RSS_TARGET_MIB)}); "
            f"its growth beyond no monitoring: {own:+.2f} MiB "
            f"(flat = <= {FLAT_TOLERANCE_MIB:.0f} MiB: {mark(own <= FLAT_TOLERANCE_MIB)})"
        )


def print_viewer(plan: Plan, scratch: Path) -> None:
    """Section 3: how fast a Session folds frames in; `memtui replay` open and seek."""
    header(3, "Viewer")
    say(f"viewer: ingest {plan.ingest_frames:,} frames")
    ingest = viewer_bench.ingest_throughput(plan.ingest_frames, plan.ingest_repeats)
    say(f"viewer: replay a {plan.replay_steps:,}-step recording")
    replay = viewer_bench.replay_open_and_seek(
        scratch / "replay.memtui", plan.replay_steps, plan.seeks
    )
    rate_target = f">= {INGEST_TARGET:,.0f}/s"
    rows = [
        [
            f"Session.ingest: {ingest.frames:,} decoded Steps, batches of 256",
            f"{ingest.ingest_per_s:,.0f} frames/s",
            rate_target,
            mark(ingest.ingest_per_s >= INGEST_TARGET),
        ],
        [
            "wire decode + Session.ingest, 64 KiB chunks",
            f"{ingest.decode_ingest_per_s:,.0f} frames/s",
            rate_target,
            mark(ingest.decode_ingest_per_s >= INGEST_TARGET),
        ],
        [
            f"replay open: {replay.steps:,} steps, {replay.file_bytes / MIB:.1f} MiB",
            f"{replay.open_s:.2f} s",
            f"< {OPEN_TARGET_S:.0f} s",
            mark(replay.open_s < OPEN_TARGET_S),
        ],
        [
            "  ReplaySource.check()",
            f"{replay.check_s:.2f} s",
            "",
            "",
        ],
        [
            "  ReplaySource.run() into a Session",
            f"{replay.read_s:.2f} s",
            "",
            "",
        ],
        [
            f"replay seek: jump_to_step + snapshot, {plan.seeks} random, median",
            f"{replay.seek_median_ms:.2f} ms",
            f"< {SEEK_TARGET_MS:.0f} ms",
            mark(replay.seek_median_ms < SEEK_TARGET_MS),
        ],
        ["  slowest seek", f"{replay.seek_max_ms:.2f} ms", "", ""],
    ]
    table(["measurement", "result", "target", ""], rows)


@dataclass(frozen=True)
class RecordingSize:
    """What a recording spends per step."""

    file_bytes: int
    steps: int
    median_frame: int
    max_frame: int


def recording_size(path: Path) -> RecordingSize | Failure:
    """The file's bytes per step, and each Step frame's size as the agent encodes it."""
    from memtui_protocol import schema, wire

    try:
        data = path.read_bytes()
        messages = list(wire.FrameDecoder().feed(data))
    except (OSError, wire.WireError) as exc:
        return Failure(f"unreadable recording: {exc}")
    frames = sorted(len(wire.encode(m)) for m in messages if isinstance(m, schema.Step))
    if not frames:
        return Failure("no steps recorded")
    return RecordingSize(len(data), len(frames), frames[len(frames) // 2], frames[-1])


def print_recordings(plan: Plan, cells: Cells | None, threads: int, scratch: Path) -> None:
    """Section 4: bytes per step for the demo job, a 100-module model and section 1's jobs."""
    header(4, "Recording size")
    sizes = plan.training
    demo, hundred = scratch / "demo.memtui", scratch / "stack100.memtui"

    def run_demo() -> Failure | None:
        say(f"recording: demo job, {plan.demo_steps} steps under the runner")
        return procs.run_demo(plan.demo_steps, demo, threads, sizes.timeout)

    args = ["--job", "stack100", "--config", "default", "--steps", str(plan.record_steps)]
    note = f"recording: 100-module model, {plan.record_steps} steps"
    run_hundred = training.worker_task(
        note, [*args, "--record", str(hundred)], threads, sizes.timeout
    )
    demo_run, hundred_run = training.run_all([run_demo, run_hundred], sizes.parallel)
    measured: list[tuple[str, RecordingSize | Failure]] = [
        (
            "demo job (tiny_lm under the runner)",
            demo_run if isinstance(demo_run, Failure) else recording_size(demo),
        ),
        (
            "100-module model (33 blocks)",
            hundred_run if isinstance(hundred_run, Failure) else recording_size(hundred),
        ),
    ]
    if cells is not None:
        for job, title in JOBS.items():
            path = scratch / f"{job}-default-0.memtui"
            if path.exists():
                measured.append((f"{title} (section 1, defaults)", recording_size(path)))
    rows = []
    for label, size in measured:
        if isinstance(size, Failure):
            rows.append([label, size.reason])
            continue
        rows.append(
            [
                label,
                str(size.steps),
                f"{size.file_bytes:,} B",
                f"{size.file_bytes // size.steps} B",
                f"{size.median_frame} B",
                f"{size.max_frame} B",
                "median <= 1 KiB",
                mark(size.median_frame <= FRAME_TARGET),
            ]
        )
    table(["job", "steps", "file", "file/step", "median Step", "max Step", "target", ""], rows)
    print("  file/step includes hello and names; a Step's size is len(wire.encode(step))")


def main() -> int:
    """Parse the options and print the requested sections."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (< 60 s)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--sections", default="1,2,3,4", help="which sections, e.g. 1,3")
    parser.add_argument("--traceml-venv", type=Path, default=DEFAULT_TRACEML_VENV)
    parser.add_argument("--setup-traceml", action="store_true", help="install TraceML and exit")
    parser.add_argument("--profile-agent", action="store_true", help="cProfile the agent, exit")
    args = parser.parse_args()
    if args.setup_traceml:
        return procs.setup_traceml(args.traceml_venv)
    if args.profile_agent:
        describe = describe_job("stack", quick=False)
        return training.profile_agent(args.threads, steps=60, top=25, describe=describe)
    plan = QUICK if args.quick else FULL
    if args.rounds is not None:
        plan = replace(plan, training=replace(plan.training, rounds=max(1, args.rounds)))
    sections = {int(item) for item in args.sections.split(",") if item.strip()}
    measuring = bool(sections & {1, 2})
    traceml = procs.find_traceml(args.traceml_venv) if measuring else None
    print(
        "memtui benchmarks"
        + (" (--quick: tiny sizes, numbers not representative)" if args.quick else "")
        + f": Python {platform.python_version()}, torch {importlib.metadata.version('torch')}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
        + (f", TraceML {traceml.version}" if traceml is not None and traceml.usable else "")
    )
    with tempfile.TemporaryDirectory(prefix="memtui-bench-") as folder:
        scratch = Path(folder)
        cells = None
        if traceml is not None:
            cells = training.measure_training(plan.training, args.threads, traceml, scratch)
        if 1 in sections and cells is not None:
            print_training(plan, cells, args.threads)
        if 2 in sections and cells is not None:
            print_memory(plan, cells, args.threads, scratch)
        if 3 in sections:
            print_viewer(plan, scratch)
        if 4 in sections:
            print_recordings(plan, cells, args.threads, scratch)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
