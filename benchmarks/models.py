"""The models the overhead benchmark trains, defined here rather than borrowed from the tests.

Two shapes bound the agent's cost from both sides. `GPTLike` does a lot of arithmetic per module
call, so per-hook costs disappear under matrix multiplies: it is the case users see most. `Stack`
is hundreds of tiny Linear+LayerNorm blocks on small tensors, so every forward, backward and
saved-tensor hook is a large fraction of the step: it is the worst case for hook overhead.

Sizes are chosen for a 2-core CPU: a `GPTLike` AdamW step at the full size takes well over
100 ms there, so the fixed costs of a step close are measured against a realistic step time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTSize:
    """Hyper-parameters of `GPTLike` and of its batch."""

    vocab: int
    dim: int
    layers: int
    heads: int
    seq: int
    batch: int


GPT_FULL = GPTSize(vocab=2048, dim=256, layers=4, heads=4, seq=128, batch=4)
GPT_QUICK = GPTSize(vocab=256, dim=64, layers=4, heads=4, seq=32, batch=4)


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused qkv projection, as in most GPT code."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            part.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for part in self.qkv(x).split(d, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return out


class GPTLike(nn.Module):
    """Decoder-only language model: token and position embeddings, blocks, a tied head."""

    def __init__(self, size: GPTSize) -> None:
        super().__init__()
        self.tokens = nn.Embedding(size.vocab, size.dim)
        self.positions = nn.Embedding(size.seq, size.dim)
        self.blocks = nn.ModuleList(Block(size.dim, size.heads) for _ in range(size.layers))
        self.norm = nn.LayerNorm(size.dim)
        self.head = nn.Linear(size.dim, size.vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.norm(x))
        return out


class TinyBlock(nn.Module):
    """A Linear and a LayerNorm with a residual: three modules, a few microseconds of math."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.norm(self.linear(x))
        return out


class Stack(nn.Sequential):
    """`blocks` TinyBlocks in a row: 3 * blocks + 1 modules, the hook-bound worst case."""

    def __init__(self, blocks: int, width: int) -> None:
        super().__init__(*(TinyBlock(width) for _ in range(blocks)))


@dataclass
class Job:
    """A model, its AdamW optimizer and one fixed batch: everything a step needs."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    inputs: torch.Tensor
    targets: torch.Tensor
    language_model: bool

    def step(self) -> torch.Tensor:
        """One fp32 optimizer step; returns the (still attached to nothing) detached loss."""
        self.optimizer.zero_grad(set_to_none=True)
        output = self.model(self.inputs)
        if self.language_model:
            loss = F.cross_entropy(output.flatten(0, 1), self.targets.flatten())
        else:
            loss = F.mse_loss(output, self.targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


class BertJob(Job):
    """A small Hugging Face BERT (6 layers, hidden 64, batch 8x32): the per-module Python
    cost of a real library's model, where each module call is cheap."""

    def step(self) -> torch.Tensor:
        """One step through the model's own loss (labels passed in)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss: torch.Tensor = self.model(input_ids=self.inputs, labels=self.targets).loss
        loss.backward()
        self.optimizer.step()
        return loss.detach()


PADDED_LENGTHS = tuple(range(8, 56, 4))
"""The sequence lengths `BertPaddedJob` cycles through: a batch padded to its longest text."""


@dataclass
class BertPaddedJob(BertJob):
    """`BertJob` fed batches padded per batch (`DataCollatorWithPadding`): its 12 lengths in
    turn, so each shape repeats every 12 steps. `--activations auto` measures each length once
    (and on audit steps) and carries it afterwards; a run of more than 12 steps shows both."""

    batches: list[torch.Tensor] = field(default_factory=list)
    steps_done: int = 0

    def step(self) -> torch.Tensor:
        """One step on the next length's batch."""
        if not self.batches:
            self.batches = _padded_batches(self.inputs)
        self.inputs = self.batches[self.steps_done % len(self.batches)]
        self.steps_done += 1
        return super().step()


def _padded_batches(inputs: torch.Tensor) -> list[torch.Tensor]:
    """One batch per padded length, made from `inputs`' rows (repeated where it is longer)."""
    rows = inputs.shape[0]
    return [
        inputs.repeat(1, -(-length // inputs.shape[1]))[:rows, :length] for length in PADDED_LENGTHS
    ]


def bert_job() -> Job:
    """`BertJob`, built from a config (nothing downloaded); needs `transformers`."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=64,
    )
    model = BertForSequenceClassification(config)
    inputs = torch.randint(0, 1000, (8, 32))
    targets = torch.randint(0, 2, (8,))
    return BertJob(model, torch.optim.AdamW(model.parameters()), inputs, targets, False)


class LlamaJob(Job):
    """A small Hugging Face Llama (4 layers, hidden 64, batch 2x32) trained under bf16 autocast
    on the CPU: hundreds of small saved tensors, views and dropped intermediates."""

    def step(self) -> torch.Tensor:
        """One step through the model's own loss, its forward under autocast."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss: torch.Tensor = self.model(input_ids=self.inputs, labels=self.targets).loss
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def llama_job() -> Job:
    """`LlamaJob`, built from a config (nothing downloaded); needs `transformers`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)
    inputs = torch.randint(0, 1000, (2, 32))
    return LlamaJob(model, torch.optim.AdamW(model.parameters()), inputs, inputs, False)


def build_job(name: str, quick: bool) -> Job:
    """The named job ("gpt", "stack", "stack100", "tiny", "bert", "bertpad" or "llama"), seeded
    so every process is equal.

    "stack" is 200 blocks (601 modules; 20 blocks with `quick`), "stack100" 33 blocks (exactly
    100 modules, for the recording-size section) and "tiny" 8 blocks, small enough to run
    10,000 steps in seconds.
    """
    torch.manual_seed(0)
    if name == "bert":
        return bert_job()
    if name == "llama":
        return llama_job()
    if name == "bertpad":
        job = bert_job()
        return BertPaddedJob(job.model, job.optimizer, job.inputs, job.targets, False)
    if name == "gpt":
        size = GPT_QUICK if quick else GPT_FULL
        model: nn.Module = GPTLike(size)
        inputs = torch.randint(0, size.vocab, (size.batch, size.seq))
        targets = torch.randint(0, size.vocab, (size.batch, size.seq))
        return Job(model, torch.optim.AdamW(model.parameters()), inputs, targets, True)
    blocks = {"stack": 20 if quick else 200, "stack100": 33, "tiny": 8}[name]
    width, batch = 32, 8
    model = Stack(blocks, width)
    inputs = torch.randn(batch, width)
    targets = torch.randn(batch, width)
    return Job(model, torch.optim.AdamW(model.parameters(), lr=1e-4), inputs, targets, False)
