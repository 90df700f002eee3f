"""Shared pieces of the TUI tests: the fixture recording's messages, a fake source, a fake job.

`tests/` is not a package and pytest runs with `--import-mode=importlib`, so the fixture builder
is loaded from its file here and everything reaches the tests as pytest fixtures.
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from cli_harness import MemtuiCli, run_memtui, scrubbed_env
from rich.console import Console
from textual.pilot import Pilot
from textual.widget import Widget

from memtui_protocol import schema

FIXTURES = Path(__file__).parent / "fixtures"

# The layers' rules (tests/layer_rules.py) hold for every test; pytester runs pytest inside a
# test (tests/integration/test_layer_rules.py proves the rules fail what they should).
pytest_plugins = ("layer_rules", "pytester")


@pytest.fixture(autouse=True)
def _own_runtime_folder(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every test's jobs and viewers meet in a runtime folder of their own (`MEMTUI_RUNTIME_DIR`,
    inherited by the processes a test starts): the suite runs in two workers at once, and one
    test's live job must never be another's `attach --list`. Tests of the default folder set or
    delete the variable themselves."""
    monkeypatch.setenv("MEMTUI_RUNTIME_DIR", str(tmp_path_factory.mktemp("runtime") / "rt"))


def _load_fixture_module(filename: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, FIXTURES / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fixture_builder = _load_fixture_module("make_fixture.py", "memtui_fixture_builder")
job_host_module = _load_fixture_module("job_host.py", "memtui_job_host")


def live_stream_messages() -> list[schema.Message]:
    """The fixture run as a live socket sees it while the job still runs: no `End` yet."""
    messages: list[schema.Message] = fixture_builder.demo_messages(with_end=False)
    return messages


class FakeSource:
    """A Source that hands prepared batches to the app, then (live) stays open until closed.

    A live fake keeps its worker thread alive the way a socket does. It must end on its own,
    because `asyncio.run` joins the executor's threads on exit: `close()` ends it, `until()`
    turning true ends it quietly (for apps run by someone else, e.g. `snap_compare`), and so does
    a deadline, so a forgotten close costs seconds, not a hung test run.
    """

    def __init__(
        self,
        messages: list[schema.Message],
        *,
        live: bool,
        label: str = "fake source",
        batch_size: int | None = None,
        lifetime: float = 20.0,
        until: Callable[[], bool] | None = None,
    ) -> None:
        self.live = live
        self.label = label
        self._messages = list(messages)
        self._batch_size = batch_size or max(len(messages), 1)
        self._lifetime = lifetime
        self._until = until
        self._more: queue.Queue[tuple[list[schema.Message], threading.Event]] = queue.Queue()
        self.delivered = threading.Event()
        """Set once every prepared batch has been handed to the sink."""
        self.closed = threading.Event()
        self.stopped_by_app = False

    def feed(self, messages: list[schema.Message]) -> threading.Event:
        """More frames from the 'job'; the event is set once they are in the app's inbox."""
        done = threading.Event()
        self._more.put((list(messages), done))
        return done

    def close(self) -> None:
        """The 'job' closes its socket."""
        self.closed.set()

    def run(
        self, sink: Callable[[list[schema.Message]], None], stop: threading.Event
    ) -> str | None:
        for start in range(0, len(self._messages), self._batch_size):
            sink(self._messages[start : start + self._batch_size])
        self.delivered.set()
        if not self.live:
            return None
        deadline = time.monotonic() + self._lifetime
        while not stop.is_set():
            try:
                batch, done = self._more.get(timeout=0.02)
            except queue.Empty:
                if self._until is not None and self._until():
                    return None
                if self.closed.is_set() or time.monotonic() > deadline:
                    return "the job closed its socket"
                continue
            sink(batch)
            done.set()
        self.stopped_by_app = True
        return None


class FakeJob:
    """Stands in for `JobProcess`: never a real process, so a test cannot kill anything."""

    def __init__(self, lines: list[str] | None = None) -> None:
        self.code: int | None = None
        self.lines = list(lines or [])
        self.terminated = False
        self.stopped = False

    def poll(self) -> int | None:
        return self.code

    def take_lines(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines

    def terminate(self) -> None:
        self.terminated = True
        self.stopped = True
        self.code = 143

    def wait(self) -> int:
        return self.code if self.code is not None else 0


JobRunner = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def run_python(tmp_path: Path) -> JobRunner:
    """`run_python(SOURCE, *args)`: `python -c SOURCE` in `tmp_path` (or `cwd=`), as the agent
    tests run their jobs: a private runtime folder (the agent's socket and sidecar), text output
    captured, a timeout instead of a hung test run."""

    def run(
        source: str, *args: str, cwd: Path | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        folder = cwd or tmp_path
        env = scrubbed_env(folder / "rt")
        return subprocess.run(
            [sys.executable, "-c", source, *args],
            cwd=folder, env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    return run


SHARED_PRELOAD = (
    "torch",
    "memtui_agent.startup.agent",
    "memtui_agent.hooks.tracker",
    "memtui_agent.output.emitter",
)
"""What the shared interpreter imports once, before its first job."""


@pytest.fixture(scope="session")
def _shared_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One interpreter for every `shared_python` job of the session (started at first use)."""
    host = job_host_module.JobHost(
        dict(os.environ), tmp_path_factory.mktemp("shared-host"), preload=SHARED_PRELOAD
    )
    try:
        yield host
    finally:
        host.close()


@pytest.fixture
def shared_python(tmp_path: Path, _shared_host: Any) -> JobRunner:
    """`run_python`, but the job runs in one interpreter shared by the session's jobs
    (tests/fixtures/job_host.py): torch is imported once, not once per job.

    The job still sees what `python -c SOURCE ARGS` shows it (its own `__main__`, argv, folder,
    `MEMTUI_RUNTIME_DIR`, output and exit status). A job that leaves process-global state
    behind (an agent started and never stopped, hooks, threads) or kills the interpreter fails
    its test; the next job gets a fresh interpreter. Jobs that need a fresh process (what
    happens at interpreter exit, forked or spawned children) keep `run_python`.
    """

    def run(
        source: str, *args: str, cwd: Path | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        folder = cwd or tmp_path
        env = {"MEMTUI_RUNTIME_DIR": str(folder / "rt")}
        outcome = _shared_host.run("job", source, folder, timeout, argv=args, env=env)
        if outcome.code is None or outcome.leaks:
            pytest.fail(f"{outcome.failure}\n--- its stdout:\n{outcome.stdout}", pytrace=False)
        return subprocess.CompletedProcess(
            [sys.executable, "-c", source, *args], outcome.code, outcome.stdout, outcome.stderr
        )

    return run


@pytest.fixture
def memtui_cli(tmp_path: Path) -> MemtuiCli:
    """`memtui_cli(*ARGS, **ENV)`: `memtui ARGS` run to its end in the test's folder, in the one
    scrubbed environment of `cli_harness` with the runtime folder `tmp_path / "rt"` (where the
    test's own jobs, started with `scrubbed_env(tmp_path / "rt")`, meet it) and ENV on top."""

    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return run_memtui(*args, cwd=tmp_path, env=scrubbed_env(tmp_path / "rt", **env))

    return run


@pytest.fixture
def torchrun_session(tmp_path: Path) -> Callable[..., tuple[dict[str, Any], str]]:
    """`torchrun_session(SOURCE, env={...})`: SOURCE as `job.py` under `memtui run --headless
    -o tmp_path/session -- torchrun --standalone --nproc-per-node 2 job.py tmp_path` (CPU, gloo).

    Checks the run succeeded with one recording per rank; returns the ranks of `memtui report
    session --json` and the run's stderr. `folder_exists=True` makes the folder beforehand.
    """

    def run(
        source: str, env: dict[str, str] | None = None, folder_exists: bool = False
    ) -> tuple[dict[str, Any], str]:
        script = tmp_path / "job.py"
        script.write_text(source)
        session = tmp_path / "session"
        if folder_exists:
            session.mkdir()
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        result = run_memtui(
            "run", "--headless", "-o", str(session), "--", torchrun, "--standalone",
            "--nproc-per-node", "2", str(script), str(tmp_path),
            cwd=tmp_path, env=scrubbed_env(tmp_path / "rt", **(env or {})),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        assert sorted(path.name for path in session.iterdir()) == [
            "rank-0.memtui",
            "rank-1.memtui",
        ]
        report = run_memtui("report", str(session), "--json", cwd=tmp_path, timeout=60)
        assert report.returncode == 0, report.stderr
        return json.loads(report.stdout)["ranks"], result.stderr

    return run


@pytest.fixture
def demo_messages() -> list[schema.Message]:
    """Hello, Names, 24 Steps, End: exactly what `demo.memtui` holds."""
    messages: list[schema.Message] = fixture_builder.demo_messages()
    return messages


@pytest.fixture
def live_messages() -> list[schema.Message]:
    """The fixture run without its End (a job still running)."""
    return live_stream_messages()


@pytest.fixture(scope="session")
def job_host() -> ModuleType:
    """`tests/fixtures/job_host.py`: one interpreter that runs many jobs (`JobHost`)."""
    return job_host_module


@pytest.fixture
def builder() -> ModuleType:
    """`tests/fixtures/make_fixture.py`, loaded as a module."""
    return fixture_builder


@pytest.fixture
def make_step() -> Callable[[int], schema.Step]:
    """One fixture-shaped Step with any step number."""
    make: Callable[[int], schema.Step] = fixture_builder.make_step
    return make


async def settle(pilot: Pilot[Any], screen: bool = True) -> None:
    """Wait until the app's source has handed over its frames, then draw them now.

    The app drains its inbox on a 2 Hz timer (`TICK_SECONDS`); tests call `refresh_view()`
    themselves so what they assert on never depends on where that timer happens to be.

    `screen`: settled means two equal screenshots in a row (what an SVG snapshot needs, about
    0.1 s per screenshot at 160x48); otherwise two equal layouts in a row (every widget's
    region and scrollable size), which is what tests of widget state and sizes need.
    """
    app: Any = pilot.app
    delivered = getattr(app.source, "delivered", None)
    if delivered is None:
        await app.workers.wait_for_complete()
    else:
        for _ in range(1000):
            if delivered.is_set():
                break
            await pilot.pause(0.01)
        assert delivered.is_set(), "the fake source never delivered its frames"
    await pilot.pause()
    # Redraw from scratch: the app cuts the timeline window to the chart's width when it takes
    # a snapshot, and a snapshot taken before the first layout (a replay read that fast) keeps
    # a 20-step window until something changes. That is an app bug (see the xfail in
    # test_tui_pilot.py); forcing the redraw keeps the snapshots deterministic meanwhile.
    app._rendered_version = -1
    app.refresh_view()
    # Then wait for the layout to settle: tables that just got their rows grow on a later
    # refresh, and on a loaded machine a single pause could catch a panel still empty (a CI
    # run saw the piles panel collapsed once). Two equal states in a row are the settled one.
    look = app.export_screenshot if screen else (lambda: _layout(app))
    previous = None
    for _ in range(50):
        await pilot.pause(0.02)
        state = look()
        if state == previous:
            break
        previous = state


def _layout(app: Any) -> list[tuple[int, Any, Any]]:
    """Where every widget on screen is and how much it holds: what a layout pass changes."""
    return [
        (id(widget), widget.region, widget.virtual_size)
        for widget in app.screen.walk_children(with_self=True)
    ]


async def close_source(pilot: Pilot[Any]) -> None:
    """End a live fake and let the app handle that before it shuts down.

    The source thread's last act is `call_from_thread(app._source_ended, ...)`; landing in the
    middle of the app's shutdown, that redraw finds no widgets and fails the app (NoMatches). The
    app does not guard against it (see the report), so tests let the call land first.
    """
    app: Any = pilot.app
    close = getattr(app.source, "close", None)
    if close is None:
        return
    close()
    if app.is_running:
        await app.workers.wait_for_complete()
        await pilot.pause()


def drive(
    app: Any,
    body: Callable[[Pilot[Any]], Any],
    *,
    size: tuple[int, int] = (160, 48),
) -> None:
    """Run `body(pilot)` against a settled app, closing a live fake before the app exits.

    `asyncio.run` joins the source's worker thread on the way out, so a live fake that nobody
    closes would hold the test until its deadline.
    """

    async def scenario() -> None:
        async with app.run_test(size=size) as pilot:
            try:
                await settle(pilot, screen=False)
                await body(pilot)
            finally:
                await close_source(pilot)

    asyncio.run(scenario())


def plain(widget: Widget) -> str:
    """What a Static-like widget renders right now, as text at its own width."""
    out = io.StringIO()
    console = Console(width=max(widget.size.width, 20), file=out, color_system=None)
    console.print(widget.render())
    return out.getvalue()


class TuiKit:
    """What the pilot and snapshot tests share: fakes, settling, driving, reading a widget."""

    settle = staticmethod(settle)
    close_source = staticmethod(close_source)
    drive = staticmethod(drive)
    plain = staticmethod(plain)
    FakeJob = FakeJob

    def __init__(self) -> None:
        self.sources: list[FakeSource] = []

    def source(self, messages: list[schema.Message], **options: Any) -> FakeSource:
        """A FakeSource that is closed at teardown whatever the test did."""
        source = FakeSource(messages, **options)
        self.sources.append(source)
        return source


@pytest.fixture
def tui() -> Iterator[TuiKit]:
    """Fakes and helpers for tests that run the app."""
    kit = TuiKit()
    yield kit
    for source in kit.sources:
        source.close()
