"""The GPU path through the same code a GPU run uses, on data in the documented formats.

No GPU here: `torch.cuda.memory_stats()` dictionaries are written with the keys the caching
allocator documents, and NVML is a stand-in module with pynvml's call signatures.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cli_harness import scrubbed_env

from memtui.model.recording import read_recording
from memtui.model.step_rows import gap_rows, pile_rows
from memtui_agent.memory.allocator import (
    allocator_from_stats,
    expandable_segments_enabled,
    fragmentation_message,
)
from memtui_agent.memory.nvml import NvmlReader, nvml_index
from memtui_protocol import schema

GIB = 2**30


def stats(**values: int) -> dict[str, int]:
    """A memory_stats() dictionary: flat "<stat>.<pool>.<metric>" keys, as torch returns them."""
    base = {
        "allocated_bytes.all.current": 6 * GIB,
        "allocated_bytes.all.peak": 9 * GIB,
        "reserved_bytes.all.current": 10 * GIB,
        "reserved_bytes.all.peak": 10 * GIB,
        "active_bytes.all.current": 6 * GIB + 512,
        "inactive_split_bytes.all.current": 3 * GIB,
        "allocation.all.allocated": 1000,
        "allocation.all.freed": 900,
        "allocated_bytes.all.allocated": 50 * GIB,
        "allocated_bytes.all.freed": 44 * GIB,
        "segment.all.allocated": 12,
        "segment.all.freed": 2,
        "num_alloc_retries": 0,
        "num_ooms": 0,
    }
    base.update(values)
    return base


def test_counters_and_per_step_deltas_from_memory_stats() -> None:
    first = stats()
    second = stats(
        **{
            "allocation.all.allocated": 1400,
            "allocation.all.freed": 1350,
            "segment.all.allocated": 15,
            "num_alloc_retries": 2,
            "allocated_bytes.all.peak": 9 * GIB,
        }
    )
    step1 = allocator_from_stats(first)
    assert (step1.allocated, step1.reserved, step1.peak_allocated) == (6 * GIB, 10 * GIB, 9 * GIB)
    assert step1.inactive_split == 3 * GIB and step1.active == 6 * GIB + 512
    assert step1.peak_exact is True  # the first step's peak is its own
    step2 = allocator_from_stats(second, first)
    assert (step2.allocations, step2.frees, step2.segment_allocs) == (400, 450, 3)
    assert step2.alloc_retries == 2 and step2.ooms == 0
    # No new high: the running peak only bounds this step's peak.
    assert step2.peak_exact is False
    step3 = allocator_from_stats(stats(**{"allocated_bytes.all.peak": 11 * GIB}), second)
    assert step3.peak_exact is True


def test_cpu_build_gives_no_counters_not_zeros() -> None:
    empty = allocator_from_stats({})
    assert empty.allocated is None and empty.reserved is None and empty.peak_exact is None


def test_fragmentation_alert_needs_cache_and_retries() -> None:
    fragmented = allocator_from_stats(stats(num_alloc_retries=3), stats())
    message = fragmentation_message(fragmented, expandable=False)
    assert message is not None and "4.00 GiB reserved but not allocated" in message
    assert "expandable_segments:True" in message
    already = fragmentation_message(fragmented, expandable=True)
    assert already is not None and "already on" in already
    # A large cache without retries is just the cache.
    assert fragmentation_message(allocator_from_stats(stats(), stats()), False) is None


def test_expandable_segments_detected_in_either_variable() -> None:
    assert expandable_segments_enabled(
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}
    )
    assert expandable_segments_enabled({"PYTORCH_ALLOC_CONF": "expandable_segments:true"})
    assert not expandable_segments_enabled({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})


def test_gap_rows_and_other_pile_on_a_gpu_step() -> None:
    allocator = allocator_from_stats(stats()).__class__(
        allocated=6 * GIB,
        reserved=10 * GIB,
        peak_allocated=9 * GIB,
        process_gpu=11 * GIB,
        device_used=30 * GIB,
        device_total=80 * GIB,
    )
    piles = schema.Piles(2 * GIB, 2 * GIB, GIB, 0)
    peak = schema.Piles(2 * GIB, 2 * GIB, GIB, 3 * GIB)
    step = schema.Step(
        step=1, t_start=0, t_end=1, end=piles, max=peak, peak=peak, allocator=allocator
    )
    rows = {row.label: row for row in gap_rows(step)}
    assert rows["torch allocated"].delta == GIB  # other: allocated minus tracked at close
    assert rows["torch reserved"].delta == 4 * GIB  # cache and fragmentation
    assert rows["process GPU (NVML)"].delta == GIB  # context, libraries
    assert rows["device used"].delta == 19 * GIB  # other processes
    assert rows["device total"].delta == 50 * GIB
    other = next(row for row in pile_rows(step) if row.name == "other")
    assert other.at_peak == 9 * GIB - 8 * GIB


class FakeNvml:
    """pynvml's calls used by NvmlReader, over a made-up device."""

    def __init__(self, processes: list[tuple[int, int | None]], fail_init: bool = False) -> None:
        self.processes = processes
        self.fail_init = fail_init
        self.handles: list[Any] = []

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise OSError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self.handles.append(index)
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes) -> Any:
        self.handles.append(uuid)
        return uuid

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        return SimpleNamespace(used=30 * GIB, total=80 * GIB, free=50 * GIB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes]


def test_nvml_process_memory_matched_by_pid() -> None:
    nvml = FakeNvml([(111, 3 * GIB), (4242, 11 * GIB)])
    memory = NvmlReader(nvml, environ={}).read(0, pid=4242)
    assert (memory.process_gpu, memory.device_used, memory.device_total) == (
        11 * GIB,
        30 * GIB,
        80 * GIB,
    )
    assert memory.note is None


def test_nvml_in_a_pid_namespace_falls_back_to_device_used_and_says_so() -> None:
    memory = NvmlReader(FakeNvml([(98765, 11 * GIB)]), environ={}).read(0, pid=12)
    assert memory.process_gpu == 30 * GIB
    assert memory.note is not None and "PID namespace" in memory.note


def test_missing_nvml_is_a_note_not_an_error() -> None:
    memory = NvmlReader(FakeNvml([], fail_init=True), environ={}).read(0)
    assert memory.process_gpu is None and memory.device_total is None
    assert memory.note is not None and "NVML unavailable" in memory.note


def test_cuda_visible_devices_maps_cuda_index_to_nvml() -> None:
    assert nvml_index(0, None) == 0
    assert nvml_index(1, "3,5") == 5
    assert nvml_index(0, "GPU-8f2e-uuid,GPU-aaaa") == "GPU-8f2e-uuid"
    nvml = FakeNvml([])
    NvmlReader(nvml, environ={"CUDA_VISIBLE_DEVICES": "2,7"}).read(1)
    NvmlReader(nvml, environ={"CUDA_VISIBLE_DEVICES": "GPU-abc"}).read(0)
    assert nvml.handles == [7, b"GPU-abc"]


OOM_OBSERVED = """
import torch, memtui_agent
with memtui_agent.monitor(record="rec.memtui", socket=False) as agent:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
    # What the CUDA allocator's out-of-memory observer reports before the exception:
    agent.parts.closer.gpu_events.observe(0, 2 * 2**30, 70 * 2**30, 512 * 2**20)
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
"""


@pytest.mark.slow
def test_oom_observer_details_reach_the_final_frame(tmp_path: Path) -> None:
    env = scrubbed_env(tmp_path / "rt")
    result = subprocess.run(
        [sys.executable, "-c", OOM_OBSERVED],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    end = read_recording(tmp_path / "rec.memtui").end
    assert end is not None and end.oom and end.requested == 2 * GIB
    assert end.alerts[0].kind == "oom"
    assert "512.00 MiB was free on the device" in end.alerts[0].message


def test_allocator_activity_lines_for_the_cursor_step() -> None:
    from memtui.model.step_rows import allocator_lines

    allocator = allocator_from_stats(stats(num_alloc_retries=1), stats())
    step = schema.Step(
        step=2,
        t_start=0,
        t_end=1,
        end=schema.Piles(),
        max=schema.Piles(),
        peak=schema.Piles(),
        allocator=allocator,
    )
    lines = allocator_lines(step)
    assert lines[0].startswith("this step: 0 allocations") and "1 retries" in lines[0]
    assert "fragmentation): 3.00 GiB" in lines[1]
    assert "running peak" in lines[2]
    assert allocator_lines(msgspec_replace(step)) == ()


def msgspec_replace(step: schema.Step) -> schema.Step:
    """The same step on a CPU job: no allocator counters at all."""
    import msgspec

    return msgspec.structs.replace(step, allocator=schema.Allocator())
