"""What the driver sees (NVML): this process's GPU memory, the device's used and total.

Read at each step close on the training thread (`memory_readers.with_nvml`), with the other
figures of the step's frame, which is written before control returns to the job (a reading on
another thread would belong to some other moment of the step). The CUDA device index the job
uses is mapped to NVML's through `CUDA_VISIBLE_DEVICES` (indices or GPU UUIDs). The process
figure is matched by pid; inside a PID namespace (containers) NVML reports host pids that never
match, so the device's used memory stands in and the frame says so. A missing library or
driver, or no permission, gives one note and the CPU-only view, never an exception.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceMemory:
    """NVML's view of one device for this process."""

    process_gpu: int | None
    device_used: int | None
    device_total: int | None
    note: str | None = None


def nvml_index(cuda_index: int, visible: str | None) -> int | str:
    """The NVML index (or UUID string) behind the job's `cuda:<cuda_index>`."""
    if not visible:
        return cuda_index
    tokens = [token.strip() for token in visible.split(",") if token.strip()]
    if cuda_index >= len(tokens):
        return cuda_index
    token = tokens[cuda_index]
    return int(token) if token.isdigit() else token


class NvmlReader:
    """Lazily initialised NVML; `read()` never raises."""

    def __init__(self, module: Any = None, environ: dict[str, str] | None = None) -> None:
        self._nvml = module
        self._environ = environ if environ is not None else dict(os.environ)
        self._ready: bool | None = None
        self.note: str | None = None
        self._handles: dict[int, Any] = {}

    def _init(self) -> bool:
        if self._ready is not None:
            return self._ready
        try:
            if self._nvml is None:
                import pynvml

                self._nvml = pynvml
            self._nvml.nvmlInit()
            self._ready = True
        except Exception as exc:  # library not found, driver not loaded, no permission
            self._ready = False
            self.note = f"NVML unavailable ({type(exc).__name__}): process and device rows omitted"
        return self._ready

    def _handle(self, cuda_index: int) -> Any:
        if cuda_index not in self._handles:
            target = nvml_index(cuda_index, self._environ.get("CUDA_VISIBLE_DEVICES"))
            if isinstance(target, str):
                handle = self._nvml.nvmlDeviceGetHandleByUUID(target.encode())
            else:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(target)
            self._handles[cuda_index] = handle
        return self._handles[cuda_index]

    def read(self, cuda_index: int, pid: int | None = None) -> DeviceMemory:
        """Process, used and total bytes on the job's device (Nones and a note on failure)."""
        if not self._init():
            return DeviceMemory(None, None, None, self.note)
        pid = os.getpid() if pid is None else pid
        try:
            handle = self._handle(cuda_index)
            info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            used, total = int(info.used), int(info.total)
        except Exception as exc:
            return DeviceMemory(None, None, None, f"NVML read failed ({type(exc).__name__})")
        try:
            processes = list(self._nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except Exception as exc:
            note = f"NVML process list unavailable ({type(exc).__name__}): device used shown"
            return DeviceMemory(used, used, total, note)
        mine = [p.usedGpuMemory for p in processes if p.pid == pid and p.usedGpuMemory]
        if mine:
            return DeviceMemory(int(sum(mine)), used, total)
        if processes:
            note = (
                "this pid is not in NVML's process list (PID namespace?): device used memory "
                "stands in for the process"
            )
            return DeviceMemory(used, used, total, note)
        return DeviceMemory(None, used, total, "NVML lists no processes on this device")
