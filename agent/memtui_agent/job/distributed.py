"""Memory that data-parallel wrappers hold outside the four piles: DDP's gradient buckets and
FSDP2's gathered (unsharded) parameters.

DDP (`DistributedDataParallel`) allocates one flat buffer per gradient bucket when it is built
(and again when it rebuilds its buckets after the first iteration). Together the buckets hold
every dense trainable parameter's gradient once, so their size is the parameters' bytes,
whatever the bucketing (reducer.cpp: `at::empty({total_length})` per bucket, the sum of its
variables' numels). With `gradient_as_bucket_view=True` the `.grad` tensors are views into them,
so while gradients exist the gradients pile already counts that memory; without it the buckets are
a second copy of the gradients, which allocator-side `other` would otherwise hide.

FSDP2 (`fully_shard`) keeps each parameter as a DTensor whose local tensor is this rank's shard
(the ledger counts the shard, through `__tensor_flatten__`), and all-gathers the full parameters
into per-parameter buffers before a module's forward and backward, freeing them afterwards by
resizing their storages to zero. Those buffers are neither weights (the shard is) nor
activations, although autograd saves views of them: they are measured here by reading the
gathered storages' current sizes (zero when resharded) at the moments they are largest: when
forward leaves an FSDP module (global hooks run before FSDP's own post-forward reshard) and when
backward unpacks a saved tensor (FSDP has gathered the module being differentiated). It uses
FSDP2's parameter groups (`_get_fsdp_state()._fsdp_param_group.fsdp_params`), which are private:
any failure turns the measurement off with one agent error, never the job.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

from memtui_agent.memory.ledger import local_tensor
from memtui_protocol import schema

if TYPE_CHECKING:  # for annotations only: FSDP is imported only by jobs that use it
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel


def _unique_nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages of `tensors` (each storage once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = local_tensor(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    seen.pop(0, None)
    return sum(seen.values())


class DdpBuckets:
    """DDP wrappers among the watched roots and the size of their gradient buckets."""

    def __init__(self) -> None:
        self._wrappers: list[tuple[weakref.ref[DistributedDataParallel], int]] = []
        """Each DDP wrapper (weakly) and its bucket bytes, fixed once DDP is built."""

    def discover(self, roots: list[torch.nn.Module]) -> None:
        """Remember the DDP wrappers among newly registered model roots."""
        ddp_type = _ddp_class()
        if ddp_type is None:
            return
        known = {id(ref()) for ref, _ in self._wrappers}
        for root in roots:
            for module in root.modules():
                if isinstance(module, ddp_type) and id(module) not in known:
                    size = sum(p.numel() * p.element_size() for p in _bucketed_parameters(module))
                    self._wrappers.append((weakref.ref(module), size))
                    known.add(id(module))

    def measure(self) -> tuple[int, bool, int] | None:
        """(bucket bytes, gradient_as_bucket_view, bucket bytes already counted as gradients)."""
        buckets = in_gradients = 0
        view = False
        found = False
        for ref, size in self._wrappers:
            wrapper = ref()
            if wrapper is None:
                continue
            found = True
            buckets += size
            if getattr(wrapper, "gradient_as_bucket_view", False):
                view = True
                params = _bucketed_parameters(wrapper)
                in_gradients += _unique_nbytes([p.grad for p in params if p.grad is not None])
        if not found:
            return None
        return buckets, view, min(in_gradients, buckets)


def _ddp_class() -> type[DistributedDataParallel] | None:
    """DDP's class if the job imported it (importing it here would cost the job time and RSS)."""
    module = sys.modules.get("torch.nn.parallel.distributed")
    return getattr(module, "DistributedDataParallel", None)


def _bucketed_parameters(wrapper: DistributedDataParallel) -> list[torch.Tensor]:
    """The parameters DDP reduces through buckets: trainable, dense, not ignored."""
    ignored = set(getattr(wrapper, "parameters_to_ignore", ()) or ())
    params = []
    seen: set[int] = set()
    for name, param in wrapper.module.named_parameters():
        if id(param) in seen or name in ignored or not param.requires_grad:
            continue
        seen.add(id(param))
        if param.is_sparse or getattr(wrapper, "sparse", False):
            continue
        params.append(param)
    return params


class _Group:
    """One FSDP parameter group: gathered and resharded together."""

    __slots__ = ("_params", "storages")

    def __init__(self, params: list[object]) -> None:
        # Weakly: a model the job drops must not be kept alive by the agent.
        self._params = [weakref.ref(param) for param in params]
        self.storages: list[torch.UntypedStorage] = []

    @property
    def params(self) -> list[object]:
        """FSDP's parameter objects of the group that are still alive."""
        return [param for param in (ref() for ref in self._params) if param is not None]

    def refresh(self) -> None:
        storages = []
        for param in self.params:
            for output in getattr(param, "all_gather_outputs", None) or ():
                storages.append(output.untyped_storage())
        self.storages = storages

    def gathered(self) -> int:
        if not self.storages:
            self.refresh()
            if not self.storages:
                return 0
        if self.storages[0].nbytes() == 0:
            return 0
        seen: dict[int, int] = {}
        for storage in self.storages:
            seen[storage.data_ptr()] = storage.nbytes()
        seen.pop(0, None)
        return sum(seen.values())


class FsdpGathered:
    """FSDP2's gathered parameters: bytes now and the highest sampled in the step."""

    def __init__(self) -> None:
        self.active = False
        self._groups: list[_Group] = []
        self._module_ids: set[int] = set()
        self._unsharded_ids: set[int] = set()
        self.now = 0
        self.max = 0

    def discover(self, roots: list[torch.nn.Module]) -> None:
        """Find the FSDP2-sharded modules among newly registered model roots."""
        fsdp_type = _fsdp_class()
        if fsdp_type is None:
            return
        for root in roots:
            for module in root.modules():
                if not isinstance(module, fsdp_type) or id(module) in self._module_ids:
                    continue
                self._module_ids.add(id(module))
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    self._groups.append(_Group(list(group.fsdp_params)))
                self.active = True

    def is_fsdp_module(self, module: torch.nn.Module) -> bool:
        """Whether forward is leaving a module FSDP gathers parameters for."""
        return id(module) in self._module_ids

    def is_gathered_parameter(self, parameter: torch.Tensor) -> bool:
        """Whether `parameter` is one of FSDP's unsharded parameters (created lazily by FSDP)."""
        if id(parameter) in self._unsharded_ids:
            return True
        for group in self._groups:
            for param in group.params:
                unsharded = getattr(param, "_unsharded_param", None)
                if unsharded is not None:
                    self._unsharded_ids.add(id(unsharded))
        return id(parameter) in self._unsharded_ids

    def sample(self) -> None:
        """Read the gathered bytes now and raise the step's high-water mark."""
        now = 0
        for group in self._groups:
            now += group.gathered()
        self.now = now
        if now > self.max:
            self.max = now

    def refresh(self) -> None:
        """Re-read the gathered buffers' storages (once per step: FSDP may re-create them)."""
        for group in self._groups:
            group.refresh()

    def take(self) -> tuple[int, int]:
        """(bytes at close, highest in the step); the next step's mark starts from now."""
        self.sample()
        result = (self.now, self.max)
        self.max = self.now
        return result


def _fsdp_class() -> type[FSDPModule] | None:
    """FSDP2's module class if the job imported it (`torch.distributed.fsdp` pulls in DTensor:
    seconds of imports no job without FSDP should pay)."""
    module = sys.modules.get("torch.distributed.fsdp")
    return getattr(module, "FSDPModule", None)


class DistributedMemory:
    """Both measurements, as one `schema.Distributed` per step."""

    def __init__(self) -> None:
        self.ddp = DdpBuckets()
        self.fsdp = FsdpGathered()

    def discover(self, roots: list[torch.nn.Module]) -> None:
        """Look for DDP and FSDP2 wrappers among newly registered model roots."""
        self.ddp.discover(roots)
        self.fsdp.discover(roots)

    def at_close(self) -> schema.Distributed | None:
        """The step's figures, or None for a job with neither wrapper."""
        ddp = self.ddp.measure()
        fields: dict[str, Any] = {}
        if ddp is not None:
            fields.update(ddp_buckets=ddp[0], ddp_bucket_view=ddp[1], ddp_in_gradients=ddp[2])
        if self.fsdp.active:
            now, high = self.fsdp.take()
            self.fsdp.refresh()
            fields.update(fsdp_gathered=now, fsdp_gathered_max=high)
        return schema.Distributed(**fields) if fields else None
