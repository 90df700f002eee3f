"""The pytest hooks: which tests run under the agent, and how a broken rule fails one.

A test runs under memtui's agent when it carries `@pytest.mark.memtui(...)` or the run was given
`--memtui`; no other test is touched (nothing is imported for them). The agent starts in the
test's process right before the test's call and stops right after it (`memtui_agent.start` /
`stop`, a recording in a folder of the session's), so the test's own code runs as it would
without memtui: the agent's rules hold (it never runs the test's code, its failures are its own,
reported once). What memtui itself could not do (start, read its recording) fails a marked test
with that reason, since its rules were not checked; an unmarked test is never failed by memtui.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import TYPE_CHECKING

import pluggy
import pytest

if TYPE_CHECKING:  # the viewer and the agent are imported for a monitored test only
    from memtui.reports.check_rules import Limits
    from memtui_pytest.verdict import Verdict

MARKER = "memtui"
_VERDICT: pytest.StashKey[Verdict] = pytest.StashKey()
_LIMITS: pytest.StashKey[Limits] = pytest.StashKey()
_FOLDER: pytest.StashKey[Path] = pytest.StashKey()
MAX_LISTED = 10
"""Tests `--memtui` lists in its summary, highest peak first."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("memtui", "memory of PyTorch training (memtui)")
    group.addoption(
        "--memtui",
        action="store_true",
        default=False,
        help="run every test under memtui's agent and list the highest peaks (tests marked "
        "memtui are checked with or without it)",
    )
    group.addoption(
        "--memtui-keep",
        metavar="DIR",
        default=None,
        help="keep every monitored test's recording in DIR (default: only a failed test's, "
        "in a temporary folder named in its failure)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "memtui(max_peak=None, max=None, no_leak=False, no_nan=False, max_not_known=0): run "
        "the test under memtui's agent and fail it when it breaks one of memtui check's rules "
        "(sizes as '64MiB' or bytes; max={'activations': '8MiB'}; docs/check.md)",
    )


def _monitored(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARKER) is not None or bool(item.config.getoption("memtui"))


def _folder(config: pytest.Config) -> Path:
    folder = config.stash.get(_FOLDER, None)
    if folder is None:
        keep = config.getoption("memtui_keep")
        if keep:
            folder = Path(keep)
            folder.mkdir(parents=True, exist_ok=True)
        else:
            folder = Path(tempfile.mkdtemp(prefix="memtui-pytest-"))
        config.stash[_FOLDER] = folder
    return folder


def _recording_name(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[-150:] + ".memtui"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A marker memtui cannot read errors the test before it runs (one line): a gate that
    checked nothing would pass."""
    if not _monitored(item):
        return
    from memtui.reports.check_rules import Limits
    from memtui_pytest.marker import MarkerError, limits_of

    marker = item.get_closest_marker(MARKER)
    try:
        item.stash[_LIMITS] = limits_of(marker.args, marker.kwargs) if marker else Limits()
        return
    except MarkerError as exc:
        why = str(exc)
    pytest.fail(f"memtui: {why}", pytrace=False)  # outside the except: no chained traceback


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, pluggy.Result[None], None]:
    limits = item.stash.get(_LIMITS, None)
    if limits is None:
        yield
        return
    marked = item.get_closest_marker(MARKER) is not None
    import memtui_agent
    from memtui_agent.startup.api import current
    from memtui_pytest.verdict import Verdict, judge

    if current() is not None:
        yield
        why = "an agent already monitors this process (memtui run): the test was not measured"
        item.stash[_VERDICT] = Verdict(marked, f"memtui: {why}", None, 0)
        return
    path = _folder(item.config) / _recording_name(item.nodeid)
    agent = memtui_agent.start(path, socket=False, argv=[item.nodeid])
    if agent is None:
        yield
        why = "its agent did not start (the reason is on stderr): the test was not measured"
        item.stash[_VERDICT] = Verdict(marked, f"memtui: {why}", None, 0)
        return
    outcome = yield
    failure = outcome.exception
    try:
        memtui_agent.stop(exit_code=1 if failure is not None else 0, error=failure)
        verdict = judge(path, limits)
    except Exception as exc:  # memtui's own failure: said, never the test's
        why = f"memtui: the test's recording could not be judged ({type(exc).__name__}: {exc})"
        verdict = Verdict(marked, why, None, 0)
    if verdict.broken or item.config.getoption("memtui_keep"):
        verdict = Verdict(
            verdict.broken,
            f"{verdict.text}\nrecording: {path} (memtui report {path})",
            verdict.peak,
            verdict.steps,
        )
    else:
        path.unlink(missing_ok=True)
    item.stash[_VERDICT] = verdict


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    outcome = yield
    verdict = item.stash.get(_VERDICT, None)
    if call.when != "call" or verdict is None:
        return
    report = outcome.get_result()
    report.user_properties += [("memtui_peak", verdict.peak), ("memtui_steps", verdict.steps)]
    if not verdict.broken:
        return
    if report.passed:
        report.outcome = "failed"
        report.longrepr = verdict.text
    else:
        report.sections.append(("memtui", verdict.text))


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """With `--memtui`: the tests of highest peak, and where the recordings are."""
    if not config.getoption("memtui"):
        return
    from memtui_protocol.units import format_bytes

    measured = []
    for report in terminalreporter.getreports("passed") + terminalreporter.getreports("failed"):
        peak = dict(report.user_properties).get("memtui_peak")
        steps = dict(report.user_properties).get("memtui_steps")
        if isinstance(steps, int):
            measured.append((peak if isinstance(peak, int) else -1, steps, report.nodeid))
    if not measured:
        return
    terminalreporter.write_sep("=", "memtui: peaks (piles + DDP/FSDP buffers)")
    for peak, steps, nodeid in sorted(measured, reverse=True)[:MAX_LISTED]:
        shown = format_bytes(peak) if peak >= 0 else "not known"
        terminalreporter.write_line(f"{shown:>12}  {steps:>4} steps  {nodeid}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's temporary folder goes when no recording is left in it."""
    folder = config.stash.get(_FOLDER, None)
    if folder is not None and not config.getoption("memtui_keep"):
        try:
            if not any(os.scandir(folder)):
                shutil.rmtree(folder)
        except OSError:
            pass
