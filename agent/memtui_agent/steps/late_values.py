"""A closed step's loss and GradScaler scale that still live in GPU memory.

The step's frame is written on the training thread as the step closes (so a kill right after
`optimizer.step()` never loses it), but reading a CUDA tensor there would wait for the device:
a host sync the agent must not add. Instead each value is copied into pinned host memory with a
non-blocking copy, an event is recorded behind the copies, and the values are read (from host
memory, no wait) once `event.query()` says the copies are done: at a later step's close, or at
the end of the job, where waiting is harmless. The values then travel as a `schema.StepLate` in
that later frame. So on CUDA at most the last step's loss can be lost to a SIGKILL, never the
step itself. Devices other than CPU and CUDA have no event here: their tensors are read with
`.item()` one close later, when the value has long been computed.
"""

from __future__ import annotations

from typing import Any

from memtui_agent.steps.frame import HostValues
from memtui_protocol import schema


def on_host(value: Any) -> bool:
    """Whether reading `value` needs no device sync (a CPU tensor, a number or None)."""
    device = getattr(value, "device", None)
    return device is None or device.type == "cpu"


def host_float(value: Any) -> float | None:
    """A host-resident value as a float (`.item()` of a CPU tensor does not sync anything)."""
    if value is None:
        return None
    return float(value.item()) if hasattr(value, "item") else float(value)


class LateValues:
    """Non-blocking host copies of one step's device values, readable once their event fired."""

    def __init__(self, step: int, losses: list[Any], scale: Any) -> None:
        import torch

        self.step = step
        events: dict[Any, Any] = {}
        self._losses = [self._copy(torch, value, events) for value in losses]
        self._scale = self._copy(torch, scale, events) if scale is not None else None
        for device, event in events.items():
            event.record(torch.cuda.current_stream(device))
        self._events = list(events.values())

    @staticmethod
    def _copy(torch: Any, value: Any, events: dict[Any, Any]) -> Any:
        device = getattr(value, "device", None)
        if device is None or device.type != "cuda":
            return value  # a host value, or a device without events here: read later
        if device not in events:
            events[device] = torch.cuda.Event()
        # D2H with non_blocking lands in pinned memory: the copy is queued, nothing waits.
        return value.detach().to("cpu", non_blocking=True)

    def ready(self) -> bool:
        """Whether every copy has landed (`Event.query()` never waits)."""
        return all(event.query() for event in self._events)

    def wait(self) -> None:
        """Block until the copies land: only at the end of the job, never per step."""
        for event in self._events:
            event.synchronize()

    def values(self) -> schema.StepLate:
        """The step's loss (sum of its losses) and scale, once `ready()` (or after `wait()`)."""
        loss = sum(host_float(value) or 0.0 for value in self._losses) if self._losses else None
        return schema.StepLate(step=self.step, loss=loss, scale=host_float(self._scale))


def device_values(losses: list[Any], scale: Any, scale_after: Any) -> bool:
    """Whether any of a step's values lives on a device (so it must be read late)."""
    return not (on_host(scale) and on_host(scale_after) and all(on_host(v) for v in losses))


def read_values(
    step: int, losses: list[Any], scale: Any, scale_after: Any
) -> tuple[HostValues, LateValues | None]:
    """A closed step's loss and scales: read now when all of them are on the host, else sent
    to the host behind an event and carried by a later frame (none of them read now)."""
    if device_values(losses, scale, scale_after):
        return HostValues(), LateValues(step, losses, scale)
    loss = float(sum(host_float(value) or 0.0 for value in losses)) if losses else None
    return HostValues(loss, host_float(scale), host_float(scale_after)), None
