"""memtui's own share of a measured step's heap (`steps.hook_share`): with it taken off, a
forward run under the agent's kind of pack hook reads as the same forward without hooks, on a
Llama-like model under bf16 autocast where the share alone is beyond the tolerance."""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from memtui_agent.memory.saved_form import held_form
from memtui_agent.memory.tensor_reads import next_sequence_number
from memtui_agent.steps.hook_share import Costs, HookShare, Kind, calibrate
from memtui_agent.steps.step_signature import MEMORY_TOLERANCE, heap_reader

HEAP = heap_reader()
pytestmark = pytest.mark.skipif(HEAP is None, reason="glibc's heap counter only (Linux)")


class Held:
    """What the agent's holders keep (`hooks.saved_tensors`): one tensor (`held_form`) in a
    slotted object."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class Block(nn.Module):
    """Attention and a SwiGLU, the way Llama's are written: views, dropped intermediates."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.gate = nn.Linear(width, 2 * width, bias=False)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        norm = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = self.qkv(norm).view(batch, seq, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        weights = F.softmax((q @ k.transpose(-2, -1)).float(), dim=-1).to(v.dtype)
        x = x + self.out((weights @ v).transpose(1, 2).reshape(batch, seq, width))
        out: torch.Tensor = x + self.down(F.silu(self.gate(x)) * self.up(x))
        return out


def _forward_heap(model: nn.Module, batch: torch.Tensor, share: HookShare | None) -> int:
    """Heap bytes the forward holds at the backward (less the share, when counted)."""
    assert HEAP is not None

    def pack(tensor: torch.Tensor) -> Held:
        assert share is not None
        origin = tensor._base if tensor._base is not None else tensor
        if type(origin) is nn.Parameter:
            share.held()
            return Held(tensor)
        node = next_sequence_number() - 1
        share.saved(tensor, node)
        return Held(held_form(tensor, node))

    def unpack(held: Held) -> torch.Tensor:
        return held.tensor

    if share is not None:
        share.reset()
    own = share.own_bytes() if share is not None else 0
    before = HEAP()
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if share else None
    if hooks is not None:
        hooks.__enter__()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(batch).float().pow(2).mean()
    if hooks is not None:
        hooks.__exit__(None, None, None)
    after = HEAP()
    # The share, and the counting's own containers (taken off as the agent's own: `own_bytes`).
    taken = share.at_backward() + share.own_bytes() - own if share is not None else 0
    loss.backward()
    assert before is not None and after is not None
    return after - before - taken


BLOCKS = 40
"""Enough blocks that the agent's share (its hook object per saved tensor, about 48 bytes) is
beyond the tolerance."""


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch's intra-op threads only multiply the CPU time of these tiny ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_a_measured_forward_less_the_agents_share_reads_as_an_unmeasured_one() -> None:
    costs = calibrate(HEAP)
    assert costs is not None
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(BLOCKS)))
    batch = torch.randn(2, 16, 32)
    bare = statistics.median(_forward_heap(model, batch, None) for _ in range(3))
    raw = statistics.median(
        _forward_heap(model, batch, HookShare(Costs(dict.fromkeys(Kind, 0.0)))) for _ in range(3)
    )
    share = HookShare(costs)
    hooked = statistics.median(_forward_heap(model, batch, share) for _ in range(3))
    # The agent's share alone is beyond the tolerance: without it no repeat is confirmed...
    assert abs(raw - bare) > MEMORY_TOLERANCE, (raw, bare)
    # ...and with it taken off, the two read alike, well within it.
    assert abs(hooked - bare) < MEMORY_TOLERANCE / 4, (hooked, bare)


def test_each_tensor_backing_saved_views_is_counted_once() -> None:
    """A base behind several saved views is one tensor autograd alone would keep."""
    costs = Costs(dict.fromkeys(Kind, 0.0) | {Kind.DROPPED_VIEW: 10.0, Kind.KEPT_VIEW: 1.0})
    share = HookShare(costs)
    leaf = torch.ones(4, 4, requires_grad=True)
    base = leaf * 2.0
    views = [base.t(), base[0]]
    for view in views:
        share.saved(view, next_sequence_number())  # saved for a node built next
    del base, views, view
    # Two views kept (1 each), both dropped (DROPPED_VIEW_ONLY - KEPT_VIEW = -1 each), their
    # one base dropped once (DROPPED_VIEW - DROPPED_VIEW_ONLY = 10).
    assert share.at_backward() == 2 * 1 + 2 * -1 + 10
    assert not share.on
