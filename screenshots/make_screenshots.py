"""Regenerate `screenshots/*.svg` from a real recorded demo run (never drawn by hand).

    python screenshots/make_screenshots.py

Runs `memtui demo --headless` to record the bundled training job, then opens the recording in
the TUI offscreen at two terminal sizes and saves what the screen shows. A second capture is taken
live, while a slowed-down demo is still training, one of a two-rank FSDP2 job's session
(`memtui run -o DIR -- torchrun`), replayed with both ranks, and `memtui diff --tui` of the demo
against the same demo with twice the batch under bf16 from its first step.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def record_demo(path: Path, *extra: str) -> subprocess.Popen[bytes]:
    """Start the demo job recording to `path` (headless; the job's output is discarded)."""
    command = [
        sys.executable,
        "-m",
        "memtui.commands.cli",
        "demo",
        "--headless",
        "-o",
        str(path),
        *extra,
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


FSDP_JOB = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.LayerNorm(256))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
for step in range(30):
    opt.zero_grad()
    model(torch.randn(32, 256)).pow(2).mean().backward()
    opt.step()
dist.destroy_process_group()
"""


def record_fsdp_session(folder: Path) -> Path:
    """A two-rank FSDP2 job on CPU (gloo) under `memtui run -o DIR -- torchrun`."""
    script = folder / "fsdp_train.py"
    script.write_text(FSDP_JOB)
    session = folder / "fsdp-session"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [
        sys.executable,
        "-m",
        "memtui.commands.cli",
        "run",
        "--headless",
        "-o",
        str(session),
        "--",
    ]
    command += [torchrun, "--standalone", "--nproc-per-node", "2", str(script)]
    subprocess.run(command, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return session


async def capture(
    source: object,
    name: str,
    size: tuple[int, int],
    settle: float,
    ranks: dict[str, object] | None = None,
) -> None:
    """Open the app on `source` offscreen and save its screen as `screenshots/<name>.svg`."""
    from memtui.tui.app import MemtuiApp

    app = MemtuiApp(source, ranks=ranks)  # type: ignore[arg-type]
    async with app.run_test(size=size) as pilot:
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            await pilot.pause(0.25)
            app.refresh_view()
        app.save_screenshot(filename=f"{name}.svg", path=str(HERE))
    print(f"wrote screenshots/{name}.svg")


async def capture_diff(first: Path, second: Path, name: str, size: tuple[int, int]) -> None:
    """`memtui diff --tui first second` offscreen, saved as `screenshots/<name>.svg`."""
    from memtui.commands.diff_command import read_run
    from memtui.model.run_diff import diff_runs
    from memtui.tui.diff_app import DiffApp

    run_a, name_a = read_run(str(first), None)
    run_b, name_b = read_run(str(second), None)
    app = DiffApp(diff_runs(run_a, run_b), (name_a, name_b))
    async with app.run_test(size=size) as pilot:
        await pilot.pause(0.5)
        app.save_screenshot(filename=f"{name}.svg", path=str(HERE))
    print(f"wrote screenshots/{name}.svg")


def main() -> int:
    """Record, then capture replay (two sizes), live, a diff of two runs and a two-rank
    session."""
    from memtui.input.sources import ReplaySource, TailSource

    with tempfile.TemporaryDirectory() as folder:
        finished = Path(folder) / "demo.memtui"
        if record_demo(finished).wait() != 0:
            print("the demo run failed", file=sys.stderr)
            return 1
        replay = ReplaySource(finished)
        replay.label = "demo.memtui"
        for size in ((160, 48), (80, 24)):
            asyncio.run(capture(replay, f"replay-{size[0]}x{size[1]}", size, settle=1.5))
        live_path = Path(folder) / "live.memtui"
        job = record_demo(live_path, "--steps", "400", "--sleep", "0.05")
        try:
            while not live_path.exists():
                time.sleep(0.1)
            tail = TailSource(live_path, lambda: job.poll() is not None)
            tail.label = "live.memtui"
            asyncio.run(capture(tail, "live-160x48", (160, 48), settle=6.0))
        finally:
            job.terminate()
            job.wait()
        from memtui.commands.tui_commands import session_sources

        changed = Path(folder) / "demo-bf16.memtui"
        if record_demo(changed, "--batch", "16", "--bf16-from", "1").wait() != 0:
            print("the second demo run failed", file=sys.stderr)
            return 1
        os.chdir(folder)  # the header names the runs as given: short relative paths
        asyncio.run(
            capture_diff(Path("demo.memtui"), Path("demo-bf16.memtui"), "diff-160x48", (160, 48))
        )
        os.chdir(HERE)
        ranks = session_sources(record_fsdp_session(Path(folder)))
        first = next(iter(ranks.values()))
        asyncio.run(capture(first, "ranks-fsdp2-160x48", (160, 48), settle=1.5, ranks=ranks))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TEXTUAL_ANIMATIONS", "none")
    sys.exit(main())
