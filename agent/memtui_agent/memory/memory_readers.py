"""The process's and the machine's memory as the agent reads it at each step close: the host's
(RSS every step, a few microseconds from /proc; the machine's memory through psutil at most once
a second) and NVML's GPU process and device figures (GPU jobs only).

Both are read on the training thread as the step closes (`steps.step_closer`), with the rest of
the close's measurements, because the step's frame is written before control returns to the job.
Kept apart from the close so each reader is cached, tested and replaced in one place.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

# Imported with this module, when the agent starts, never at a close: importing psutil
# allocates about 180 KiB that stay, and where a close did it (the first one, after its heap
# reading) they counted as the next step's forward, so the step after that could not confirm
# it repeated it and said its activations were not known (an attached job's third recorded
# step, issue 32). tests/integration/test_agent_imports.py checks that a close imports nothing.
import psutil

from memtui_agent.memory.descriptors import OwnedFd
from memtui_protocol import schema

_process: Any = None
_statm: tuple[int, OwnedFd] | None = None
"""(pid, descriptor) of this process's /proc/self/statm, opened once: a read is a few
microseconds, against about 30 (psutil opens and parses the file at every call). The number is
checked to still be the agent's before each read and the close (`descriptors`)."""
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def process_rss() -> int:
    """Resident set size of this process: /proc/self/statm where Linux has it, else psutil."""
    global _statm
    pid = os.getpid()
    try:
        if _statm is not None and (_statm[0] != pid or not _statm[1].ours()):
            _statm[1].forget()  # a forked child's copy, or a number the job closed and reused
            _statm = None
        if _statm is None:
            _statm = (pid, OwnedFd(os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC)))
        descriptor = _statm[1].fd
        assert descriptor is not None
        return int(os.pread(descriptor, 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError, AssertionError):
        return _psutil_rss()


def close_readers() -> None:
    """Close the kept /proc file (the agent is leaving; a later read opens it again), if its
    number is still the agent's."""
    global _statm
    statm, _statm = _statm, None
    if statm is not None and statm[0] == os.getpid():
        statm[1].close()


def _psutil_rss() -> int:
    """RSS through a cached psutil handle (no /proc)."""
    global _process
    if _process is None:
        _process = psutil.Process()
    return int(_process.memory_info().rss)


SYSTEM_MEMORY_SECONDS = 1.0
_system: tuple[float, Any] = (float("-inf"), None)


def host_now() -> schema.Host:
    """Process RSS (every step) and the machine's memory (at most once a second).

    Runs on the training thread as the step closes. `psutil.virtual_memory()` costs about
    95 us (it parses /proc/meminfo) against 28 us for RSS, and the machine's figure moves
    slowly, so it is re-read only once a second.
    """
    global _system
    now = time.monotonic()
    if now - _system[0] >= SYSTEM_MEMORY_SECONDS:
        _system = (now, psutil.virtual_memory())
    system = _system[1]
    return schema.Host(rss=process_rss(), system_total=system.total, system_used=system.used)


_nvml: Any = None


def with_nvml(allocator: schema.Allocator, device_index: int | None) -> schema.Allocator:
    """Add NVML's process/device figures (GPU jobs only; never raises)."""
    global _nvml
    if device_index is None or allocator.allocated is None:
        return allocator
    if _nvml is None:
        from memtui_agent.memory.nvml import NvmlReader

        _nvml = NvmlReader()
    memory = _nvml.read(device_index)
    return msgspec.structs.replace(
        allocator,
        process_gpu=memory.process_gpu,
        device_used=memory.device_used,
        device_total=memory.device_total,
        nvml_note=memory.note,
    )
