"""The rules of the test layers, a pytest plugin loaded by tests/conftest.py.

tests/unit and tests/tui hold only inner-loop tests; tests/integration every file with a test
that starts an interpreter, a job or a server (docs/development.md). These rules fail a test
instead of living in a reviewer's head, and tests/integration/test_layer_rules.py runs them
against tests made to break them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Generator, Iterator
from typing import Any

import pytest

UNMARKED_CPU_BUDGET_S = 5.0
"""An unmarked test (the inner loop, `pytest -m "not slow"`) may use this much CPU time, its
fixtures' setup included. CPU time, not wall time: a loaded machine stretches the wall clock of
every test, while what a test costs stays the same, so the check fails the same test quiet or
loaded and never a cheap test that only waited for a busy core."""
UNMARKED_TIMEOUT_S = 120
"""Wall-clock limit of an unmarked test (pytest-timeout; `slow` ones get the ini's 900 s): a
safety net against a hang, far above what the CPU budget allows even on a loaded machine."""
_CPU_AT_SETUP = pytest.StashKey[float]()


def _unmarked(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is None


FAST_LAYERS = ("unit", "tui")
"""tests/unit (pure functions and models: no interpreter, no App) and tests/tui (Textual's pilot
and SVG snapshots) hold only inner-loop tests; tests/integration holds every file with a test
that starts an interpreter, a job or a server (its cheap tests stay unmarked, in the inner
loop)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unmarked tests get the inner loop's timeout (a test's own `timeout` mark wins); a `slow`
    test in a fast layer is a misplaced file, said at collection."""
    for item in items:
        layer = item.path.parent.name
        if layer in FAST_LAYERS and not _unmarked(item):
            raise pytest.UsageError(
                f"{item.nodeid} is marked slow in tests/{layer}: a file with a slow test "
                "belongs in tests/integration"
            )
        if _unmarked(item) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNMARKED_TIMEOUT_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _one_torch_thread()
    item.stash[_CPU_AT_SETUP] = time.process_time()
    yield


def _one_torch_thread() -> None:
    """torch computes on the test's own thread, once it is imported. The CPU budget counts the
    whole worker process, and torch's intra-op pool spins while it waits for work, longer on a
    loaded machine: a census test of 0.25 s measured 5.1 s of CPU in a CI run on shared cores.
    Tests in this process run tiny tensors, where the pool adds only that spinning. (Jobs the
    tests start are other processes, with torch's own default.)"""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _starts_an_interpreter(args: Any) -> bool:
    """Whether a command line starts Python or memtui (a new interpreter: seconds of imports)."""
    command = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    if not command:
        return False
    program = os.path.basename(os.fsdecode(command[0]))
    return program == "memtui" or program.startswith("python") or command[0] == sys.executable


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """An unmarked test that starts an interpreter fails: it belongs with the `slow` tests.
    Fixtures may (the session's shared job host is started once for all tests)."""
    if not _unmarked(item):
        yield
        return
    original = subprocess.Popen.__init__

    def refuse(self: subprocess.Popen[Any], args: Any, *rest: Any, **options: Any) -> None:
        if _starts_an_interpreter(args):
            raise AssertionError(
                f"an unmarked test started an interpreter ({args!r}): mark it "
                "@pytest.mark.slow and put it in tests/integration"
            )
        original(self, args, *rest, **options)

    subprocess.Popen.__init__ = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = original  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """An unmarked test over its CPU budget fails, with what it used."""
    report = yield
    if report.when != "call" or not report.passed or not _unmarked(item):
        return report
    used = time.process_time() - item.stash.get(_CPU_AT_SETUP, time.process_time())
    if used > UNMARKED_CPU_BUDGET_S:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} used {used:.1f} s of CPU time, over the {UNMARKED_CPU_BUDGET_S:.0f} s "
            "an unmarked test may use: make it cheaper or mark it @pytest.mark.slow"
        )
    return report
