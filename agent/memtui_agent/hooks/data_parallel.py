"""DDP's gradient buckets and FSDP2's gathered parameters, measured from the hooks.

Neither is one of the four piles (docs/design.md#memory-piles), and both are memory the job holds:
DDP keeps its gradient buckets (`job.distributed.DdpBuckets`), FSDP2 all-gathers a module's
parameters for its forward and backward and frees them after (`FsdpGathered`). FSDP's gathered
parameters are sampled as its modules' forwards return and as saved tensors are unpacked in
backward, so while FSDP is in use every step is measured (the activation gate's `fsdp`) and the
persistent piles are walked at every close. A failure turns all of it off, reported once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from memtui_agent.hooks.saved_tensors import unpack_samplers
from memtui_agent.hooks.switches import HookSwitches
from memtui_agent.job.distributed import DistributedMemory
from memtui_protocol import schema

if TYPE_CHECKING:  # for annotations only
    import torch


class DataParallelHooks:
    """Finds DDP and FSDP wrappers among the roots and measures them."""

    def __init__(self, switches: HookSwitches, on_fsdp: Callable[[bool], None]) -> None:
        """`on_fsdp(True)` when FSDP is found, `on_fsdp(False)` when its measurements stop;
        meanwhile `fsdp` is True and the unpack hook samples the gathered parameters."""
        self.memory = DistributedMemory()
        self._on_fsdp = on_fsdp
        self._enabled = switches
        self._disable = switches.disable
        self.fsdp = False
        """FSDP is in use: its gathered parameters are sampled by the hooks."""

    def discover(self, roots: Iterable[torch.nn.Module]) -> None:
        """Look for the wrappers among newly registered model roots."""
        if not self._enabled["distributed"]:
            return
        try:
            self.memory.discover(list(roots))
            if self.memory.fsdp.active and not self.fsdp:
                self._switch_fsdp(True)
        except Exception as exc:
            self._failed(exc)

    def module_returned(self, module: torch.nn.Module) -> None:
        """A module's forward returned: sample before FSDP's own post-forward hook reshards."""
        if self.memory.fsdp.is_fsdp_module(module):
            self.sample_gathered()

    def gathered_parameter(self, parameter: torch.Tensor) -> bool:
        """Whether a parameter autograd saves is FSDP's all-gathered one (sampled then)."""
        if not self.memory.fsdp.is_gathered_parameter(parameter):
            return False
        self.sample_gathered()
        return True

    def sample_gathered(self) -> None:
        """Sample FSDP's gathered parameters now (their high is the step's)."""
        try:
            self.memory.fsdp.sample()
        except Exception as exc:
            self._failed(exc)

    def at_close(self) -> schema.Distributed | None:
        """The wrappers' memory at a close (None without DDP or FSDP)."""
        if not self._enabled["distributed"]:
            return None
        try:
            return self.memory.at_close()
        except Exception as exc:
            self._failed(exc)
            return None

    def _failed(self, exc: BaseException) -> None:
        """Turn the DDP/FSDP measurements off everywhere they run, reported once."""
        self._switch_fsdp(False)
        self._disable("distributed", exc)

    def _switch_fsdp(self, on: bool) -> None:
        """FSDP found (or its measurements off): the gathered parameters are sampled by the
        unpack hook, and the agent's other parts are told (`on_fsdp`)."""
        self.fsdp = on
        self._on_fsdp(on)
        unpack_samplers[:] = [self.sample_gathered] if on else []
