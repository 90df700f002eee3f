"""The job host (tests/fixtures/job_host.py) fails each job on its own, and clearly.

Tests that share an interpreter must stay attributable: a job that raises fails with its own
traceback and the host goes on; a job that kills the host, runs past its time or leaves
process-global state behind fails with a sentence that says so, and the next job gets a fresh
host. These hosts import nothing heavy, so each start costs a bare interpreter.
"""

from __future__ import annotations

import gc
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


def run(
    host: Any, tmp_path: Path, name: str, source: str, timeout: float = 60, **options: Any
) -> Any:
    cwd = tmp_path / name
    cwd.mkdir()
    return host.run(name, source, cwd, timeout=timeout, **options)


@pytest.mark.slow  # starts an interpreter
def test_a_job_runs_as_python_c_would(host: Any, tmp_path: Path) -> None:
    """Its own `__main__`, folder, argv, environment and output (C-level writes to fd 1 and 2
    included); a warning an earlier job saw shows again."""
    source = """
import os, sys, warnings
print("out", os.getcwd(), sys.argv, __name__, "leftover" in globals(), os.environ.get("JOB_VAR"))
os.write(2, b"raw stderr\\n")
warnings.warn("once per location")
leftover = 1
"""
    first = run(host, tmp_path, "first", source, argv=("a", "b"), env={"JOB_VAR": "set"})
    second = run(host, tmp_path, "second", source)
    assert first.failure is None and second.failure is None
    assert first.stdout == f"out {tmp_path / 'first'} ['-c', 'a', 'b'] __main__ False set\n"
    assert second.stdout == f"out {tmp_path / 'second'} ['-c'] __main__ False None\n"
    for result in (first, second):
        assert result.stderr.startswith("raw stderr\n")
        assert "UserWarning: once per location" in result.stderr
    assert host.starts == 1


@pytest.mark.parametrize(
    ("ending", "code", "stderr"),
    [("sys.exit()", 0, ""), ("sys.exit(3)", 3, ""), ("sys.exit('bye')", 1, "bye\n")],
)
@pytest.mark.slow  # starts an interpreter
def test_a_job_ends_with_the_exit_status_python_would_give(
    host: Any, tmp_path: Path, ending: str, code: int, stderr: str
) -> None:
    ended = run(host, tmp_path, "ends", f"import sys\n{ending}\n")
    assert (ended.code, ended.stderr, ended.error) == (code, stderr, None)
    assert (ended.failure is None) == (code == 0)


@pytest.mark.slow  # starts an interpreter
def test_a_job_that_raises_fails_alone_with_its_traceback(host: Any, tmp_path: Path) -> None:
    failed = run(host, tmp_path, "boom", "print('before')\nraise ValueError('boom')\n")
    assert failed.stdout == "before\n"
    assert failed.code == 1 and failed.failure == failed.error
    assert failed.error is not None and failed.error == failed.stderr  # as Python prints it
    assert failed.error.startswith(
        'Traceback (most recent call last):\n  File "<job boom>", line 2'
    )
    assert "raise ValueError('boom')" in failed.error  # the job's source line, as Python shows it
    assert failed.error.rstrip().endswith("ValueError: boom")
    after = run(host, tmp_path, "after", "print('fine')\n")
    assert (after.failure, after.stdout, host.starts) == (None, "fine\n", 1)


@pytest.mark.slow  # starts an interpreter
def test_a_job_that_kills_its_host_fails_clearly(host: Any, tmp_path: Path) -> None:
    died = run(
        host,
        tmp_path,
        "dies",
        "import os, sys\nprint('last words', file=sys.stderr)\nos._exit(3)\n",
    )
    assert died.code is None and died.failure is not None
    assert died.failure.startswith("scenario dies: the job host died (exit code 3)")
    assert "last words" in died.stderr
    after = run(host, tmp_path, "after", "print('fine')\n")
    assert (after.failure, after.stdout, host.starts) == (None, "fine\n", 2)


@pytest.mark.slow  # starts an interpreter
def test_a_job_past_its_timeout_fails_with_its_stacks(host: Any, tmp_path: Path) -> None:
    hung = run(host, tmp_path, "hangs", "import time\ntime.sleep(60)\n", timeout=1)
    assert hung.failure is not None
    assert "scenario hangs: the job host died" in hung.failure
    assert "ran past its 1 s timeout" in hung.failure
    assert 'File "<job hangs>", line 2 in <module>' in hung.stderr  # faulthandler's dump
    after = run(host, tmp_path, "after", "print('fine')\n")
    assert (after.failure, host.starts) == (None, 2)


@pytest.mark.slow  # starts an interpreter
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
    assert leaked.code == 0 and leaked.failure is not None
    assert "it left process-global state behind:" in leaked.failure
    assert any("left-behind" in line for line in leaked.leaks)
    after = run(host, tmp_path, "after", "print('fine')\n")
    assert (after.failure, host.starts) == (None, 2)


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


def test_the_fingerprint_sees_a_job_monkeypatching_torch_or_the_agent(
    job_host: ModuleType,
) -> None:
    """A function a job defined, left on torch.Tensor or in the agent's modules, is named."""
    import torch

    from memtui_agent.steps import health

    namespace: dict[str, Any] = {}
    exec(compile("def patched(self): pass", "<job patcher>", "exec"), namespace)
    before = job_host._fingerprint()
    original_close = health.HealthMonitor.close
    # Planted as a job would: attributes and methods the types do not declare, on purpose.
    torch.Tensor.memtui_test_patch = namespace["patched"]  # type: ignore[attr-defined]
    health.HealthMonitor.close = namespace["patched"]  # type: ignore[method-assign]
    try:
        during = job_host._difference(before, job_host._fingerprint())
    finally:
        del torch.Tensor.memtui_test_patch  # type: ignore[attr-defined]
        health.HealthMonitor.close = original_close  # type: ignore[method-assign]
    assert during == [
        "job code installed in torch or the agent: [] -> "
        "['memtui_agent.steps.health.HealthMonitor.close', 'torch.Tensor.memtui_test_patch']"
    ]
    assert job_host._difference(before, job_host._fingerprint()) == []


def test_a_descriptor_only_garbage_holds_is_not_state_left_behind(job_host: ModuleType) -> None:
    """Unreachable objects holding descriptors (the frames of a failed test keep its job's two
    pipes, in a cycle) are closed by the fingerprint's own collection: the fingerprint counts
    after it, or the next one differs by as many (`open fds: 19 -> 17` on a loaded machine,
    after a test_attach.py failure)."""
    import torch  # noqa: F401  # loaded, as in the suite: the fingerprint reads its state too

    enabled = gc.isenabled()
    gc.disable()  # the cycle stays until the fingerprint collects it
    try:
        read, write = os.pipe()
        cycle: list[Any] = [os.fdopen(read, "rb"), os.fdopen(write, "wb")]
        cycle.append(cycle)
        del cycle
        before = job_host._fingerprint()
        assert job_host._difference(before, job_host._fingerprint()) == []
    finally:
        if enabled:
            gc.enable()
