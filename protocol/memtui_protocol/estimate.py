"""What `memtui estimate` asks of its children and what they answer (torch-free).

The viewer never imports torch, so the estimate runs in children of the agent's package:
`python -m memtui_agent.estimate.count_params SPEC` (parameters counted on the meta device) and
`python -m memtui_agent.estimate.fake_step REQUEST_JSON` (two training steps on fake tensors).
This module holds their names, the request and the result, shared by both sides.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from enum import Enum

COUNT_PARAMS_MODULE = "memtui_agent.estimate.count_params"
FAKE_STEP_MODULE = "memtui_agent.estimate.fake_step"
EXIT_FAILED = 2
"""Both children's exit code for a failure they explained in one line on stderr."""


class OptimizerKind(str, Enum):
    """Optimizers `--optimizer` names: torch.optim classes with their usual settings."""

    SGD = "sgd"
    MOMENTUM = "momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    ADAFACTOR = "adafactor"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"
    NADAM = "nadam"
    RADAM = "radam"
    ADAMAX = "adamax"


class Autocast(str, Enum):
    """`--autocast` dtypes."""

    BF16 = "bf16"
    FP16 = "fp16"


class Variant(str, Enum):
    """The runs one request can ask for; each is a fresh model, optimizer, ledger and tracker."""

    AS_GIVEN = "as_given"
    DOUBLE_BATCH = "double_batch"
    """The batch concatenated with itself along dim 0: the slope for the largest batch."""
    CHECKPOINTED = "checkpointed"
    """As given, plus checkpointing (if the request has none): what it would save."""
    BLOCKS = "blocks"
    """Not a training run: each repeated block's saved bytes, inputs and FLOPs, one forward
    and backward outside the agent's hooks (`--budget`'s plan ranks blocks by it)."""


class WhatIf(str, Enum):
    """`memtui estimate --what-if`: one change to the request, each measured as its own run.

    The rows a step on fake tensors can measure; the table's other rows (an 8-bit optimizer
    state, ZeRO and FSDP sharding) are arithmetic over these (memtui.reports.what_if).
    """

    BATCH_X2 = "batch_x2"
    """Twice the batch (dim 0 of every tensor doubled)."""
    ACCUM_X2 = "accum_x2"
    """Twice the accumulation: the same microbatch, twice as many per optimizer step."""
    AUTOCAST_BF16 = "autocast_bf16"
    WEIGHTS_BF16 = "weights_bf16"
    """The model cast to bfloat16 (`model.to(torch.bfloat16)`), its float inputs too."""
    ADAMW = "adamw"
    MOMENTUM = "momentum"
    ADAFACTOR = "adafactor"


def with_what_if(request: FakeStepRequest, what_if: WhatIf) -> tuple[FakeStepRequest, Variant]:
    """The request (and variant) that measures one what-if row: one field changed."""
    changed = {
        WhatIf.ACCUM_X2: {"accum": request.accum * 2},
        WhatIf.AUTOCAST_BF16: {"autocast": Autocast.BF16},
        WhatIf.WEIGHTS_BF16: {"weights_bf16": True},
        WhatIf.ADAMW: {"optimizer": OptimizerKind.ADAMW},
        WhatIf.MOMENTUM: {"optimizer": OptimizerKind.MOMENTUM},
        WhatIf.ADAFACTOR: {"optimizer": OptimizerKind.ADAFACTOR},
    }.get(what_if, {})
    variant = Variant.DOUBLE_BATCH if what_if is WhatIf.BATCH_X2 else Variant.AS_GIVEN
    return replace(request, variants=[variant], what_ifs=[], **changed), variant  # type: ignore[arg-type]


@dataclass
class FakeStepRequest:
    """What to run; passed whole to the child as one JSON argument."""

    model: str
    batch: str
    optimizer: OptimizerKind = OptimizerKind.ADAMW
    autocast: Autocast | None = None
    checkpointing: bool = False
    variants: list[Variant] = field(default_factory=lambda: [Variant.AS_GIVEN])
    checkpoint_modules: list[str] = field(default_factory=list)
    """Modules (qualified names) to wrap in activation checkpointing: a plan measured."""
    accum: int = 1
    """Microbatches per optimizer step (`--accum K`): K forwards and backwards of the batch,
    each loss divided by K, gradients accumulating, then one `optimizer.step()`."""
    loss: str | None = None
    """`--loss module:callable`: `callable(output, batch)` returns the loss (docs/estimate.md)."""
    weights_bf16: bool = False
    """The model cast to bfloat16 before training (a what-if row)."""
    what_ifs: list[WhatIf] = field(default_factory=list)
    """`--what-if`: the rows measured after the variants, one run each."""

    def to_json(self) -> str:
        """The child's argument."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> FakeStepRequest:
        """Parse the child's argument (the viewer built it, so errors are bugs, not input)."""
        raw = json.loads(text)
        return cls(
            model=raw["model"],
            batch=raw["batch"],
            optimizer=OptimizerKind(raw["optimizer"]),
            autocast=Autocast(raw["autocast"]) if raw.get("autocast") else None,
            checkpointing=bool(raw.get("checkpointing")),
            variants=[Variant(v) for v in raw.get("variants", [Variant.AS_GIVEN.value])],
            checkpoint_modules=list(raw.get("checkpoint_modules", [])),
            accum=int(raw.get("accum", 1)),
            loss=raw.get("loss"),
            weights_bf16=bool(raw.get("weights_bf16")),
            what_ifs=[WhatIf(w) for w in raw.get("what_ifs", [])],
        )


@dataclass
class StepFigures:
    """One closed step as the ledger saw it (bytes)."""

    end: dict[str, int]
    max: dict[str, int]
    peak: dict[str, int]
    """The piles at the moment their total was highest."""


@dataclass
class FakeStepResult:
    """What one run measured: both steps, the steady step's top modules and dtypes."""

    variant: str
    params: int
    trainable: int
    batch_size: int | None
    first: StepFigures
    steady: StepFigures
    top_modules: list[tuple[str, int]]
    dtypes: dict[str, dict[str, int]]
    seconds: float
    loss_from: str | None = None
    """Where the loss was in the forward's output (`output[1]`, `output.loss`); None: the
    output was the loss."""
    what_if: str | None = None
    """The `WhatIf` row this run measured; None for the request's own variants."""
