"""What `memtui estimate` asks of its children and what they answer (torch-free).

The viewer never imports torch, so the estimate runs in children of the agent's package:
`python -m memtui_agent.estimate.count_params SPEC` (parameters counted on the meta device) and
`python -m memtui_agent.estimate.fake_step REQUEST_JSON` (two training steps on fake tensors).
This module holds their names, the request and the result, shared by both sides.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
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
