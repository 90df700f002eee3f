"""The repeated blocks the agent watches (`memtui_agent.job.blocks`): found as `memtui
estimate` finds them, their subtrees' name ids, their inputs (positional, keyword, a rotary
pair; plain tensors only) and their saved bytes summed from the modules' highs."""

from __future__ import annotations

import torch
from torch import nn

from memtui_agent.job.blocks import BlockWatch, block_ranges, repeated_blocks
from memtui_protocol import schema


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.small = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8)) for _ in range(3)
        )
        self.head = nn.Linear(8, 2)


def test_the_largest_container_by_parameters_gives_the_blocks() -> None:
    net = Net()
    assert repeated_blocks(net) == list(net.layers)
    assert repeated_blocks(nn.Linear(2, 2)) == []


def test_a_blocks_subtree_is_its_run_of_names() -> None:
    names = [name for name, _module in Net().named_modules()]
    ranges = block_ranges(names, 100, ["layers.0", "layers.1", "layers.2"])
    start = names.index("layers.0")
    assert ranges == {
        100 + start: 100 + start + 4,  # layers.0 and its 3 children
        100 + start + 4: 100 + start + 8,
        100 + start + 8: 100 + start + 12,
    }
    assert names[start + 4] == "layers.1" and names[start + 12] == "head"


class Wrapped(torch.Tensor):
    """A tensor subclass: its methods are the job's code, so its size is never read."""


def test_inputs_count_positional_keyword_and_pair_storages_once() -> None:
    watch = BlockWatch()
    watch.add({10: 14, 14: 18})
    hidden = torch.zeros(4, 8)
    cos, sin = torch.zeros(16), torch.zeros(16)
    watch.entered(10, (hidden, hidden[:2]), {"rotary": (cos, sin), "mask": None})
    watch.entered(10, (torch.zeros(1),), {})  # a smaller call: the most of one call is kept
    watch.entered(14, (torch.zeros(2, 8).as_subclass(Wrapped),), {"x": torch.zeros(3)})
    taken = watch.take({10: 100, 11: 50, 13: 7, 14: 1_000, 17: 3, 18: 99, 2: 5})
    assert taken == [schema.BlockBytes(10, 157, 128 + 64 + 64), schema.BlockBytes(14, 1_003, 12)]
    assert watch.take({10: 1}) == []  # a fresh start: no block ran since


def test_at_most_max_blocks_are_watched() -> None:
    from memtui_agent.job.blocks import MAX_BLOCKS

    watch = BlockWatch()
    watch.add({index: index + 1 for index in range(MAX_BLOCKS + 5)})
    assert len(watch.ranges) == MAX_BLOCKS
