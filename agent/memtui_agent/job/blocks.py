"""A model's repeated blocks, the units users wrap in activation checkpointing, and what each
one saved and took as input on a measured step (`schema.BlockBytes`).

The blocks are the children with parameters of the model's largest `nn.ModuleList` or
`nn.Sequential` by parameter count (a transformer's layers, a ResNet's stages), the same rule
`memtui estimate` plans with. Found by reading the modules' own dictionaries (`_modules`,
`_parameters`), so no method a job's subclass could override runs.

A block's saved bytes are the sum of its modules' activation highs in the step (the ledger
files a storage under the module that saved it first, so each is counted once); its inputs are
the plain tensors passed to it (positional and keyword, and those in a tuple argument such as
a rotary `(cos, sin)` pair), the most of one call in the step, read by a pre-hook on each block
(`hooks.root_calls`) while the activation hooks are armed (a measured step). A storage saved
inside a block that came in as an input is what a checkpoint keeps, not what it frees: an input
shared by every block (rotary tables) is filed under the first block that saved it, and counted
in every block's inputs.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from memtui_protocol import schema

if TYPE_CHECKING:  # annotations only: built before the job imports torch
    import torch

MAX_BLOCKS = 1024
"""Blocks watched over every model: a frame's list stays bounded."""


def _children(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [child for child in vars(module).get("_modules", {}).values() if child is not None]


def _walk(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Every module under `module` once (shared ones once), from the modules' dictionaries."""
    seen: set[int] = set()
    stack = [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        stack.extend(reversed(_children(current)))


def _parameter_count(module: torch.nn.Module) -> int:
    """Elements of the distinct parameters under `module`, read by torch's own C method with
    `__torch_function__` off (a parameter subclass's Python code never runs)."""
    import torch

    numel = torch._C.TensorBase.numel
    counted: set[int] = set()
    total = 0
    with torch._C.DisableTorchFunctionSubclass():
        for current in _walk(module):
            for parameter in vars(current).get("_parameters", {}).values():
                if parameter is not None and id(parameter) not in counted:
                    counted.add(id(parameter))
                    total += numel(parameter)
    return total


def repeated_container(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's largest `nn.ModuleList`/`nn.Sequential` of at least two modules by
    parameter count (its layers); None when it has none."""
    import torch

    containers = [
        module
        for module in _walk(model)
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))
        and len(_children(module)) >= 2
    ]
    if not containers:
        return None
    return max(containers, key=_parameter_count)


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children with parameters of `repeated_container`, in order ([] when it has none):
    a parameter-free layer (activation, pooling, dropout) saves nothing worth recomputing."""
    container = repeated_container(model)
    if container is None:
        return []
    return [child for child in _children(container) if _parameter_count(child) > 0]


def block_ranges(names: list[str], first_id: int, blocks: list[str]) -> dict[int, int]:
    """Block name id -> the end (exclusive) of its subtree's ids, from a tree's qualified
    names in `named_modules()` order (depth first: a subtree's ids are contiguous).

    `names` are the tree's names from id `first_id` on; `blocks` the blocks' qualified names.
    """
    position = {name: index for index, name in enumerate(names)}
    ranges: dict[int, int] = {}
    for block in blocks:
        start = position.get(block)
        if start is None:
            continue
        end = start + 1
        inside = block + "."
        while end < len(names) and names[end].startswith(inside):
            end += 1
        ranges[first_id + start] = first_id + end
    return ranges


class BlockWatch:
    """The blocks of every registered model and their inputs in the current step."""

    def __init__(self) -> None:
        self.ranges: dict[int, int] = {}
        """Block name id -> end (exclusive) of its subtree's name ids."""
        self._inputs: dict[int, int] = {}
        self.error: Exception | None = None
        """Finding a tree's blocks failed: said once by the next close (`StepCloser`)."""

    def add(self, ranges: Mapping[int, int]) -> None:
        """A new model's blocks (`block_ranges`), up to `MAX_BLOCKS` in all."""
        for start, end in ranges.items():
            if len(self.ranges) >= MAX_BLOCKS:
                return
            self.ranges[start] = end

    def entered(
        self, module_id: int, args: tuple[object, ...], kwargs: Mapping[str, object]
    ) -> None:
        """A block's forward starts: the bytes of its plain tensor arguments, positional and
        keyword (what a checkpoint over it holds; each storage once), the most of one call
        kept. Exact types only: a tensor subclass's methods are the job's code."""
        import torch

        storages: dict[int, int] = {}
        for arg in (*args, *kwargs.values()):
            if type(arg) is torch.Tensor or type(arg) is torch.nn.Parameter:
                storage = arg.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
            elif type(arg) is tuple:  # rotary tables come as a (cos, sin) pair
                for item in arg:
                    if type(item) is torch.Tensor:
                        storage = item.untyped_storage()
                        storages[storage._cdata] = storage.nbytes()
        size = sum(storages.values())
        if size > self._inputs.get(module_id, 0):
            self._inputs[module_id] = size

    def take(self, module_max: Mapping[int, int]) -> list[schema.BlockBytes]:
        """The blocks this step ran, with their saved bytes summed from the modules' highs
        (`module_max`: name id -> high), and a fresh start for the next step."""
        inputs, self._inputs = self._inputs, {}
        if not inputs:
            return []
        saved = dict.fromkeys(inputs, 0)
        starts = sorted(start for start in inputs if start in self.ranges)
        for module, size in module_max.items():
            at = bisect_right(starts, module) - 1  # the last block starting at or before it
            if at >= 0 and module < self.ranges[starts[at]]:
                saved[starts[at]] += size
        return [schema.BlockBytes(start, saved[start], inputs[start]) for start in sorted(inputs)]
