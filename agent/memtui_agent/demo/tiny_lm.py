"""Tiny GPT-like language model trained on synthetic tokens, for ``memtui demo``.

This script exists so that a memory monitor has something realistic to watch without
needing a dataset, a download or a big GPU. It is deliberately small but structured like a
real training job, so that every memory pile a viewer distinguishes gets filled:

* **Weights** -- embeddings, attention, MLP and LayerNorm parameters, including an output
  head whose weight is *tied* to the token embedding, so the same storage must be counted
  once rather than twice.
* **Gradients** -- produced by ``backward()`` and accumulated over several microbatches
  (``--accum``), then freed by ``zero_grad(set_to_none=True)`` at the start of each step.
* **Optimizer state** -- AdamW allocates its ``exp_avg``/``exp_avg_sq`` buffers lazily at the
  first ``optimizer.step()``, so the pile appears partway through step 1.
* **Activations** -- saved tensors from the forward pass that live until ``backward()``.
* **bf16 autocast activations** -- from ``--bf16-from`` onward the forward pass runs under
  ``torch.autocast``, so activations switch dtype mid-run and the change is visible.

It is run as ``python -m memtui_agent.demo.tiny_lm [args]`` and intentionally imports
nothing from memtui, so it behaves exactly like an arbitrary user script would.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention built from plain ``nn.Linear`` layers.

    A fused ``qkv`` projection plus an output ``proj`` mirrors common GPT implementations,
    so the parameter and activation shapes look like those of a real model.
    """

    def __init__(self, dim: int, heads: int) -> None:
        """Create the projections.

        Args:
            dim: Model width; must be divisible by ``heads``.
            heads: Number of attention heads.
        """
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over previous positions only.

        Args:
            x: Input of shape ``(batch, seq, dim)``.

        Returns:
            Tensor of the same shape as ``x``.
        """
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, t, d) -> (b, heads, t, head_dim): the layout SDPA expects.
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        out: torch.Tensor = self.proj(y)  # a Module call is typed Any by torch
        return out


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention then MLP, each with a residual.

    Pre-norm keeps training stable at the fairly high learning rate used here, so loss
    falls visibly within a few dozen steps.
    """

    def __init__(self, dim: int, heads: int) -> None:
        """Create the sub-layers.

        Args:
            dim: Model width.
            heads: Number of attention heads.
        """
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        # Named submodules give readable parameter names (mlp.fc.weight, mlp.proj.weight).
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("fc", nn.Linear(dim, 4 * dim)),
                    ("gelu", nn.GELU()),
                    ("proj", nn.Linear(4 * dim, dim)),
                ]
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply attention and MLP with residual connections.

        Args:
            x: Input of shape ``(batch, seq, dim)``.

        Returns:
            Tensor of the same shape as ``x``.
        """
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyLM(nn.Module):
    """Small GPT-like decoder-only language model with a tied output head.

    The head shares its weight with the token embedding so that a memory viewer has a
    genuinely shared parameter to deduplicate.
    """

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        """Build the model and initialise weights GPT-style.

        Args:
            vocab: Vocabulary size.
            seq: Maximum sequence length (size of the position embedding).
            dim: Model width.
            layers: Number of transformer blocks.
            heads: Number of attention heads per block.
        """
        super().__init__()
        self.seq = seq
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying: one storage, two uses
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        """Use small normal init so the initial loss sits near ``ln(vocab)``.

        Args:
            module: Submodule visited by ``nn.Module.apply``.
        """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Compute next-token logits.

        Args:
            idx: Token ids of shape ``(batch, seq)``.

        Returns:
            Logits of shape ``(batch, seq, vocab)``.
        """
        t = idx.shape[1]
        if t > self.seq:
            raise ValueError(f"sequence length {t} exceeds model maximum {self.seq}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def make_batch(
    gen: torch.Generator, batch: int, seq: int, vocab: int, noise: float = 0.1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate a batch of a learnable synthetic sequence.

    Each token is ``(prev * 3 + 1) % vocab`` except that, with probability ``noise``, it is
    replaced by a random token. The rule is easy enough that loss drops quickly, and the
    noise keeps it from collapsing to zero so the curve stays interesting. Data is made on
    the CPU with a seeded generator so runs are reproducible on any device.

    Args:
        gen: Seeded CPU generator driving all randomness.
        batch: Number of sequences.
        seq: Length of the model input; ``seq + 1`` tokens are generated.
        vocab: Vocabulary size.
        noise: Probability that a token ignores the rule.

    Returns:
        ``(inputs, targets)``, each of shape ``(batch, seq)``, targets shifted by one.
    """
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
    random_tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    is_noise = torch.rand(batch, seq + 1, generator=gen) < noise
    for i in range(1, seq + 1):
        rule = (tokens[:, i - 1] * 3 + 1) % vocab
        tokens[:, i] = torch.where(is_noise[:, i], random_tokens[:, i], rule)
    return tokens[:, :-1], tokens[:, 1:]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse command-line options.

    Args:
        argv: Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Parsed options, with ``bf16_from`` defaulted to the second half of training.
    """
    parser = argparse.ArgumentParser(
        prog="tiny_lm",
        description="Train a tiny GPT-like model on synthetic tokens (memtui demo job).",
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=2, help="microbatches per step")
    parser.add_argument("--batch", type=int, default=8, help="sequences per microbatch")
    parser.add_argument("--seq", type=int, default=64, help="sequence length")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="torch device (default: cuda if available, else cpu)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for model and data")
    parser.add_argument(
        "--bf16-from",
        type=int,
        default=None,
        help="first step (1-based) run under bf16 autocast (default: steps//2 + 1)",
    )
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
    parser.add_argument("--quiet", action="store_true", help="suppress per-step output")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.accum < 1:
        parser.error("--steps and --accum must be at least 1")
    if args.bf16_from is None:
        args.bf16_from = args.steps // 2 + 1
    return args


def main(argv: list[str] | None = None) -> int:
    """Train the model and report per-step loss.

    Args:
        argv: Arguments without the program name; ``None`` means ``sys.argv[1:]``.

    Returns:
        Process exit status (0 on success).
    """
    args = parse_args(argv)
    device = torch.device(args.device)
    device_type = device.type  # autocast wants "cuda"/"cpu", not "cuda:0"

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    model = TinyLM(args.vocab, args.seq, args.dim, args.layers, args.heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if not args.quiet:
        n_params = sum(p.numel() for p in model.parameters())  # tied weight counted once
        print(
            f"tiny_lm: {n_params:,} parameters on {device} (pid {os.getpid()}), "
            f"{args.steps} steps x {args.accum} microbatches, bf16 from step {args.bf16_from}",
            flush=True,
        )

    model.train()
    loss_value = math.nan
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        step_start = time.perf_counter()
        use_bf16 = step >= args.bf16_from
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for _ in range(args.accum):
            inputs, targets = make_batch(gen, args.batch, args.seq, args.vocab)
            inputs, targets = inputs.to(device), targets.to(device)
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=use_bf16):
                logits = model(inputs)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
            # Dividing by accum makes the accumulated gradient the mean over microbatches.
            (loss / args.accum).backward()
            step_loss += loss.item() / args.accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if device_type == "cuda":
            torch.cuda.synchronize(device)  # honest per-step timing
        loss_value = step_loss
        if not args.quiet:
            elapsed = time.perf_counter() - step_start
            print(
                f"step {step}/{args.steps}  loss {loss_value:.4f}  bf16={use_bf16}  {elapsed:.2f}s",
                flush=True,
            )
        if args.sleep > 0:
            time.sleep(args.sleep)

    total = time.perf_counter() - start
    print(f"done: {args.steps} steps in {total:.2f}s, final loss {loss_value:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
