"""`memtui estimate`: the resident training state a model needs before its first step.

Pure arithmetic over the bytes-per-parameter ledger (docs/numbers.md), so a user can see whether a
job fits before renting the GPUs, in the same piles `memtui run` later measures. Activations,
temporaries, communication buffers and fragmentation depend on batch, kernels and allocator;
guessing them would make the exact part look unreliable too, so they are named as excluded instead.
Standard library only (`memtui_protocol.units` is too): the viewer never imports torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from memtui_protocol.schema import Pile
from memtui_protocol.units import format_bytes


@dataclass(frozen=True)
class Scheme:
    """Bytes per parameter for one training recipe.

    `master` is a separate fp32 copy of the weights (only when the weights themselves are 16-bit);
    `state` is the optimizer's own per-parameter state (momentum, Adam's two moments). Both count
    as optimizer state, as in the ZeRO paper, because that is what stage 1 shards.
    """

    name: str
    weight: int
    gradient: int
    master: int
    state: int
    state_name: str

    @property
    def per_trainable(self) -> int:
        """Bytes for one trainable parameter, all four roles together."""
        return self.weight + self.gradient + self.master + self.state


SCHEMES: dict[str, Scheme] = {
    scheme.name: scheme
    for scheme in (
        Scheme("fp32-sgd", 4, 4, 0, 0, "no optimizer state"),
        Scheme("fp32-momentum", 4, 4, 0, 4, "momentum"),
        Scheme("fp32-adam", 4, 4, 0, 8, "moments (2 x fp32)"),
        Scheme("mixed-adam", 2, 2, 4, 8, "moments (2 x fp32)"),
    )
}
DEFAULT_SCHEME = "mixed-adam"

_COUNT = re.compile(
    r"^\s*((?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE]\+?[0-9]+)?)\s*([kKmMbBtT]?)\s*$"
)
"""A whole number, a decimal with a K/M/B/T suffix, or scientific notation (`7e9`, `1.5e9`)."""
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
MAX_COUNT = 10**15
"""The most parameters an estimate takes (a quadrillion: a thousand times today's largest
models), so every byte count it computes stays far inside int64."""
MAX_GPUS = 2**20


def parse_count(text: str) -> int:
    """`"1.5B"` -> 1_500_000_000; also `7B`, `10M`, `350k`, `1_000_000`.

    Decimal, not float, so `1.01B` is exactly 1_010_000_000 and the ledger's figures come out to
    the byte.

    Raises:
        ValueError: one sentence naming the accepted forms.
    """
    shown = text if len(text) <= 64 else text[:40] + "..."
    if text.strip().startswith("-"):
        raise ValueError(f"parameter count {shown!r} must not be negative")
    match = _COUNT.match(text) if len(text) <= 64 else None
    hint = "use a whole number, a K, M, B or T suffix or an exponent, e.g. 7B, 1.5B, 7e9, 10M"
    if match is None:
        raise ValueError(f"invalid parameter count {shown!r}: {hint}")
    try:
        value = Decimal(match.group(1).replace("_", "")) * _SCALE[match.group(2).lower()]
    except InvalidOperation:
        raise ValueError(f"invalid parameter count {shown!r}: {hint}") from None
    # Compared as a Decimal: `int()` of 9e999999999 would build a billion-digit number.
    if value > MAX_COUNT:
        raise ValueError(f"parameter count {shown!r} is over {MAX_COUNT:,} (a quadrillion)")
    if value != value.to_integral_value():
        raise ValueError(f"parameter count {shown!r} is not a whole number of parameters")
    return int(value)


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU in the piles the agent also measures, and the inputs that produced them."""

    weights: int
    gradients: int
    optimizer_state: int
    params: int
    trainable: int
    scheme: str
    gpus: int
    zero: int
    buffer_bytes: int = 0
    """Of the weights, the model's buffers (counted from `--model`): no gradient, no state."""

    @property
    def total(self) -> int:
        """The sum of the piles: the floor before a single activation is stored."""
        return self.weights + self.gradients + self.optimizer_state

    def piles(self) -> dict[str, int]:
        """The three piles (by `Pile`) and their total."""
        return {
            Pile.WEIGHTS: self.weights,
            Pile.GRADIENTS: self.gradients,
            Pile.OPTIMIZER_STATE: self.optimizer_state,
            "total": self.total,
        }

    def as_dict(self) -> dict[str, int | str]:
        """The `memtui estimate --json` object: the piles and their total (the contract), then
        the inputs that produced them, so a saved estimate says what it assumed."""
        return {
            **self.piles(),
            "params": self.params,
            "trainable": self.trainable,
            "scheme": self.scheme,
            "gpus": self.gpus,
            "zero": self.zero,
            "buffer_bytes": self.buffer_bytes,
        }


def shard(nbytes: int, gpus: int, sharded: bool) -> int:
    """One GPU's share of `nbytes` split `gpus` ways (or all of it when not `sharded`)."""
    # Ceiling: an uneven split leaves some rank holding the extra bytes, and that rank is the
    # one that runs out of memory first.
    return -(-nbytes // gpus) if sharded else nbytes


def estimate(
    params: int,
    trainable: int | None = None,
    scheme: str = DEFAULT_SCHEME,
    gpus: int = 1,
    zero: int = 0,
    buffer_bytes: int = 0,
) -> Estimate:
    """Weights, gradients and optimizer state per GPU under ideal, even ZeRO sharding.

    Frozen parameters cost only their weights: they have no gradient, no master copy and no
    optimizer state. That is why a 10M adapter on a 1B base needs 2.16 GB, not 1% of 16 GB.
    Stage 1 shards optimizer state across `gpus`, stage 2 also gradients, stage 3 also weights;
    plain data parallelism (stage 0) replicates everything, so more GPUs do not help it.

    `buffer_bytes` (a counted model's buffers) are weights that are not parameters: no gradient,
    no state.

    Raises:
        ValueError: for counts or options that describe no real job, in one sentence.
    """
    trainable = params if trainable is None else trainable
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}: choose from {', '.join(SCHEMES)}")
    if params < 0 or trainable < 0:
        raise ValueError("parameter counts must not be negative")
    if trainable > params:
        raise ValueError(f"--trainable {trainable:,} exceeds the {params:,} parameters in total")
    if not 1 <= gpus <= MAX_GPUS:
        raise ValueError(f"--gpus must be 1 to {MAX_GPUS:,}, not {gpus}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0, 1, 2 or 3, not {zero}")
    rule = SCHEMES[scheme]
    return Estimate(
        weights=shard(params * rule.weight + buffer_bytes, gpus, zero >= 3),
        gradients=shard(trainable * rule.gradient, gpus, zero >= 2),
        optimizer_state=shard(trainable * (rule.master + rule.state), gpus, zero >= 1),
        params=params,
        trainable=trainable,
        scheme=scheme,
        gpus=gpus,
        zero=zero,
        buffer_bytes=buffer_bytes,
    )


_SHARDED = {
    1: "optimizer state sharded",
    2: "optimizer state and gradients sharded",
    3: "optimizer state, gradients and weights sharded",
}


def _ledger(rule: Scheme) -> str:
    parts = [f"{rule.weight} weights", f"{rule.gradient} gradients"]
    if rule.master:
        parts.append(f"{rule.master} fp32 master")
    if rule.state:
        parts.append(f"{rule.state} {rule.state_name}")
    return " + ".join(parts)


def render_text(result: Estimate, source: str | None = None) -> str:
    """The table people read: bytes, GB and GiB side by side, then every assumption made.

    Both unit systems are shown because cards are sold in GB and PyTorch reports GiB; 16 GB is
    14.90 GiB, and that gap has been mistaken for a saving (or a leak) often enough.
    """
    rule, gpus, zero = SCHEMES[result.scheme], result.gpus, result.zero
    counted = f" (counted from {source} on the meta device)" if source else ""
    lines = [f"{result.params:,} parameters, {result.trainable:,} trainable{counted}", ""]
    lines.append(f"{'per GPU':<17}{'bytes':>18}{'decimal':>12}{'binary':>12}")
    for name, value in result.piles().items():
        decimal, binary = format_bytes(value, binary=False), format_bytes(value)
        lines.append(f"{name:<17}{value:>18,}{decimal:>12}{binary:>12}")
    lines += ["", "assumptions:"]
    lines.append(f"  scheme  {result.scheme}, {rule.per_trainable} bytes per trainable parameter:")
    lines.append(f"          {_ledger(rule)}")
    lines.append(f"          frozen parameters: {rule.weight} bytes each (weights only)")
    if result.buffer_bytes:
        lines.append(f"          buffers: {result.buffer_bytes:,} bytes, in the weights")
    if zero == 0:
        sharded = "nothing sharded" + (", every GPU holds a full replica" if gpus > 1 else "")
    elif gpus == 1:
        sharded = "one GPU, nothing to shard (same as stage 0)"
    else:
        sharded = f"{_SHARDED[zero]} {gpus} ways, ideal even split"
    noun = "GPU" if gpus == 1 else "GPUs"
    lines.append(f"  ZeRO    stage {zero} on {gpus} {noun}: {sharded}")
    lines.append("")
    lines.append("not included: activations, temporaries, communication buffers and fragmentation.")
    if zero >= 3 and gpus > 1:
        lines.append("ZeRO-3 also gathers each layer's full weights while it runs: a higher peak.")
    return "\n".join(lines)
