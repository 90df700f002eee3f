"""The job host (tests/fixtures/job_host.py) fails each job on its own, and clearly.

Tests that share an interpreter must stay attributable: a job that raises fails with its own
traceback and the host goes on; a job that kills the host, runs past its time or leaves
process-global state behind fails with a sentence that says so, and the next job gets a fresh
host. These hosts import nothing heavy, so each start costs a bare interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture
def host(tmp_path: Path, job_host: ModuleType) -> Iterator[Any]:
    """A torch-free host in `tmp_path/host`."""
    folder = tmp_path / "host"
    folder.mkdir()
    started = job_host.JobHost(dict(os.environ), folder)
    try:
        yield started
    finally:
        started.close()


def run(host: Any, tmp_path: Path, name: str, source: str, timeout: float = 60) -> Any:
    cwd = tmp_path / name
    cwd.mkdir()
    return host.run(name, source, cwd, timeout=timeout)


def test_a_job_runs_as_python_c_would(host: Any, tmp_path: Path) -> None:
    """Its own `__main__`, folder, argv and output (C-level writes to fd 1 and 2 included)."""
    source = """
import os, sys
print("out", os.getcwd(), sys.argv, __name__, "leftover" in globals())
os.write(2, b"raw stderr\\n")
leftover = 1
"""
    first = run(host, tmp_path, "first", source)
    second = run(host, tmp_path, "second", source)
    assert first.error is None and second.error is None
    assert first.stdout == f"out {tmp_path / 'first'} ['-c'] __main__ False\n"
    assert second.stdout == f"out {tmp_path / 'second'} ['-c'] __main__ False\n"
    assert first.stderr == second.stderr == "raw stderr\n"
    assert host.starts == 1


def test_a_job_that_raises_fails_alone_with_its_traceback(host: Any, tmp_path: Path) -> None:
    failed = run(host, tmp_path, "boom", "print('before')\nraise ValueError('boom')\n")
    assert failed.stdout == "before\n"
    assert failed.error is not None
    assert 'File "<job boom>", line 2, in <module>' in failed.error
    assert "raise ValueError('boom')" in failed.error  # the job's source line, as Python shows it
    assert failed.error.rstrip().endswith("ValueError: boom")
    after = run(host, tmp_path, "after", "print('fine')\n")
    assert (after.error, after.stdout, host.starts) == (None, "fine\n", 1)


def test_a_job_that_kills_its_host_fails_clearly(host: Any, tmp_path: Path) -> None:
    died = run(
        host,
        tmp_path,
        "dies",
        "import os, sys\nprint('last words', file=sys.stderr)\nos._exit(3)\n",
    )
    assert died.error is not None
    assert died.error.startswith("scenario dies: the job host died (exit code 3)")
    assert "last words" in died.stderr
    after = run(host, tmp_path, "after", "print('fine')\n")
    assert (after.error, after.stdout, host.starts) == (None, "fine\n", 2)


def test_a_job_past_its_timeout_fails_with_its_stacks(host: Any, tmp_path: Path) -> None:
    hung = run(host, tmp_path, "hangs", "import time\ntime.sleep(60)\n", timeout=1)
    assert hung.error is not None
    assert "scenario hangs: the job host died" in hung.error
    assert "ran past its 1 s timeout" in hung.error
    assert 'File "<job hangs>", line 2 in <module>' in hung.stderr  # faulthandler's dump
    after = run(host, tmp_path, "after", "print('fine')\n")
    assert (after.error, host.starts) == (None, 2)


def test_a_job_that_leaves_state_behind_fails_and_retires_its_host(
    host: Any, tmp_path: Path
) -> None:
    """A leftover thread (as an agent that never joined its emitter would leave) is named."""
    source = """
import threading
stop = threading.Event()
threading.Thread(target=stop.wait, name="left-behind", daemon=True).start()
"""
    leaked = run(host, tmp_path, "leaks", source)
    assert leaked.error is not None
    assert "scenario leaks left process-global state behind:" in leaked.error
    assert "left-behind" in leaked.error
    after = run(host, tmp_path, "after", "print('fine')\n")
    assert (after.error, host.starts) == (None, 2)


def test_the_fingerprint_sees_torch_hooks_and_live_modules(job_host: ModuleType) -> None:
    """What the agent's host compares after each job: global module hooks, the saved-tensor
    hooks stack and live modules all show up as a difference."""
    import torch

    before = job_host._fingerprint()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    model = torch.nn.Linear(2, 2)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        during = job_host._difference(before, job_host._fingerprint())
    handle.remove()
    assert any(line.startswith("nn.modules.module._global_forward_hooks: ") for line in during)
    assert "saved-tensor hooks on top: False -> True" in during
    assert any(line.startswith("live modules and optimizers: ") for line in during)
    del model
    assert job_host._difference(before, job_host._fingerprint()) == []
