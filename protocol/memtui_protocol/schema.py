"""Every message the agent emits, shared by the agent and the viewer.

This module is the single source of truth for the wire and the recording: a recording is the
preamble followed by exactly the messages a socket viewer receives, so live and replay feed the
same model. It depends only on the standard library and msgspec, because it is imported both
inside the training process (where torch is present) and by `memtui replay`/`report` (where torch
may not be installed).

Compatibility rules: new fields get defaults and go last; a change that an older reader cannot
ignore bumps `FORMAT_VERSION`, which readers check before decoding anything else.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import msgspec

FORMAT_VERSION = 1
"""Version of the framing and of the message set below."""

MAX_ITEMS = 4096
"""The most entries a reader accepts in one list or map of a message (alerts, dtypes, top
modules, allocation events, argv). msgspec checks a declared length before it builds anything,
so a 15 MiB frame of tiny items is refused instead of costing gigabytes of Python objects. The
agent's own lists are far smaller (10 top modules, 10 allocation lines, a few alerts)."""
MAX_NAMES = 1 << 20
"""The most names one `Names` frame may carry (a writer splits larger sets over frames)."""
_BOUNDED = msgspec.Meta(max_length=MAX_ITEMS)


class TextEnum(str, Enum):
    """A str Enum that prints as its value (`f"{kind}"` is `oom`, not `AlertKind.OOM`).

    Members compare equal to their strings, so code and recordings that hold the plain string
    (older agents, msgspec decoding a `str` field) meet the enum without conversion.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Pile(TextEnum):
    """The tracked memory piles (docs/design.md#memory-piles), in display order.

    `other` is derived from the allocator, never tracked, so it is not one of them.
    """

    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"


PILES: tuple[str, ...] = tuple(pile.value for pile in Pile)
"""The piles' names in display order (the field names of `Piles`), derived from `Pile`."""


class AlertKind(TextEnum):
    """Every kind of alert the agent and the viewer emit: one spelling each.

    On the wire `Alert.kind` stays a plain string, so a kind added by a newer agent still
    decodes (`AlertKind.parse` gives None for it and viewers show the string as it is).
    """

    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_ACTIVATION = "nonfinite_activation"
    NONFINITE_GRADIENT = "nonfinite_gradient"
    SKIPPED_STEP = "skipped_step"
    CLIP_BEFORE_UNSCALE = "clip_before_unscale"
    FIRST_STEP_FORECAST = "first_step_forecast"
    FIRST_STEP_GROWTH = "first_step_growth"
    OVER_BUDGET = "over_budget"
    OOM = "oom"
    FRAGMENTATION = "fragmentation"
    CHECKPOINT_LIMIT = "checkpoint_limit"
    STEP_RULE = "step_rule"
    ACTIVATIONS_VARY = "activations_vary"
    COMPILED = "compiled"
    """The job runs `torch.compile`d code: `--activations auto` measures every step from here
    (switching the agent's hooks between steps would make dynamo compile the model again)."""
    DIVERGENCE = "divergence"
    """The loss or the global gradient norm grew by orders of magnitude in a few steps (a
    warning, raised while the values are still finite; `Alert.began` is the climb's first step)."""
    LEAK = "leak"
    """Memory no pile explains grows step after step; `where` names what holds it."""
    ATTACHED = "attached"
    """`memtui attach` injected the agent into a running job (its first recorded step)."""
    SNAPSHOT = "snapshot"
    """A PyTorch memory snapshot opened as a recording: what its device held."""
    GROUPED = "grouped"
    """Viewer-side: alerts that follow from an earlier one, folded into one row."""

    @classmethod
    def parse(cls, text: str) -> AlertKind | None:
        """The member for a kind read from a recording; None for one this version does not
        know (a newer agent's), which readers keep as its string."""
        try:
            return cls(text)
        except ValueError:
            return None


class Severity(TextEnum):
    """How much an alert asks of the user, one per `AlertKind` (`ALERT_SEVERITY`).

    Members are listed worst first; `rank` orders them so (0 is the worst).
    """

    ERROR = "error"
    """The run is wrong: a number went NaN/Inf, memory ran out or will, memory leaks."""
    WARNING = "warning"
    """Worth acting on, or a figure to read with care: the run may still be right."""
    NOTE = "note"
    """How the run went in the ordinary course (a healthy run raises these): counted by the
    viewers, listed only when asked for."""

    @property
    def rank(self) -> int:
        """0 for an error, 1 for a warning, 2 for a note: sort by it, worst first."""
        return _SEVERITY_RANK[self]


_SEVERITY_RANK: dict[Severity, int] = {severity: rank for rank, severity in enumerate(Severity)}

ALERT_SEVERITY: dict[AlertKind, Severity] = {
    AlertKind.NONFINITE_LOSS: Severity.ERROR,
    AlertKind.NONFINITE_ACTIVATION: Severity.ERROR,
    AlertKind.NONFINITE_GRADIENT: Severity.ERROR,
    AlertKind.OOM: Severity.ERROR,
    AlertKind.OVER_BUDGET: Severity.ERROR,
    AlertKind.LEAK: Severity.ERROR,
    AlertKind.FRAGMENTATION: Severity.WARNING,
    AlertKind.SKIPPED_STEP: Severity.WARNING,
    AlertKind.CLIP_BEFORE_UNSCALE: Severity.WARNING,
    AlertKind.DIVERGENCE: Severity.WARNING,
    # The activations pile of a checkpointing job is under what the job holds (the checkpoint's
    # own hooks replace memtui's): a figure on screen to read with care, raised only by jobs that
    # checkpoint (once per variant), so not a note every healthy run carries.
    AlertKind.CHECKPOINT_LIMIT: Severity.WARNING,
    AlertKind.FIRST_STEP_FORECAST: Severity.NOTE,
    AlertKind.FIRST_STEP_GROWTH: Severity.NOTE,
    AlertKind.ACTIVATIONS_VARY: Severity.NOTE,
    AlertKind.COMPILED: Severity.NOTE,
    AlertKind.ATTACHED: Severity.NOTE,
    AlertKind.STEP_RULE: Severity.NOTE,
    AlertKind.SNAPSHOT: Severity.NOTE,
    # Folded follow-ons of a non-finite alert (every step after the weights were poisoned):
    # errors like those they fold, listed after the alert they follow from.
    AlertKind.GROUPED: Severity.ERROR,
}
"""Each alert kind's one severity (docs/report-format.md#alert-kinds)."""

UNKNOWN_KIND_SEVERITY = Severity.WARNING
"""The severity of a kind this version does not know (a newer agent's): shown, never hidden
among the notes, and never called an error it may not be."""


def alert_severity(kind: str) -> Severity:
    """The severity of an alert kind as read from the wire (a member or its string); a kind
    this version does not know is `UNKNOWN_KIND_SEVERITY`."""
    member = AlertKind.parse(str(kind))
    return ALERT_SEVERITY[member] if member is not None else UNKNOWN_KIND_SEVERITY


class LeakKind(TextEnum):
    """What a leaking holder keeps alive (docs/design.md#leaks)."""

    RETAINED_GRAPH = "retained_graph"
    """Tensors whose autograd graph still holds its saved tensors (never backpropagated)."""
    TENSORS = "tensors"
    """Tensors alone: their graphs, if any, were freed by backward."""
    WORKERS = "workers"
    """Private memory of the job's DataLoader worker processes: pages of a dataset held as
    Python objects, copied into each worker as it reads them (`holder`: the dataset's
    attribute, `bytes`: the workers' growth, `tensors`: 0)."""
    GRAPH_HISTORY = "graph_history"
    """A tensor whose autograd history grows step after step (`total_loss += loss` after
    backward): every step's graph nodes stay chained and alive, their saved tensors freed by
    backward. What grows is the count of nodes (`Leak.nodes`), in host memory."""


class CensusStop(TextEnum):
    """Why a census of live tensors ended before it had walked everything (`CensusCost`)."""

    OBJECTS = "objects"
    """It looked at as many references as one census may."""
    SECONDS = "seconds"
    """It ran as long as one census may."""
    ERROR = "error"
    """An error inside it ended it (said once on stderr and in the recording); the next census
    runs as usual."""


class ActivationMode(TextEnum):
    """When the agent arms its saved-tensor hooks (issue 15; `memtui run --activations`).

    AUTO measures on the steps whose activations can differ from the last measured one and
    carries the figure to the steps that repeat it; EVERY measures every step; OFF never
    arms the hooks (activations read zero and `activations_measured` is false).
    """

    AUTO = "auto"
    EVERY = "every"
    OFF = "off"


class NanCheck(TextEnum):
    """How much NaN/Inf checking a step gets (`memtui run --nan-check`)."""

    DEFAULT = "default"
    """One fused check of the losses and gradients; module probes armed after an alarm."""
    FULL = "full"
    """Module outputs probed every step."""
    OFF = "off"


class ExitStatus(TextEnum):
    """How a job ended, as the report and the screen say it (`End.status` holds the first
    two; the rest are what a reader concludes when the final frame is missing)."""

    OK = "ok"
    ERROR = "error"
    KILLED = "killed"
    """No final frame and the process is gone."""
    RUNNING = "running"
    """No final frame yet and the process is alive."""
    STOPPED = "stopped"
    """Stopped from memtui (SIGTERM from the TUI's quit): the agent wrote no final frame."""
    DETACHED = "detached"
    """`memtui detach`: the agent left, the job carries on."""
    UNRECORDED = "unrecorded"
    """No final frame, and the agent recorded why its recording stopped early (a full disk):
    how the job ended is not known; its `AgentError` (`RECORDING_STOPPED`) says why."""


class Phase(str, Enum):
    """Where the training loop was when something happened."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    BETWEEN = "between steps"


class StepTrigger(str, Enum):
    """What closed a step (docs/design.md#steps)."""

    OPTIMIZER = "optimizer"
    """A top-level `optimizer.step()` returned, or a GradScaler skipped that optimizer."""
    BACKWARD = "backward"
    """No optimizer has stepped: each top-level `backward()` is a step."""


class Piles(msgspec.Struct, array_like=True, frozen=True):
    """Bytes in each tracked pile, sent as a 4-element array to keep frames small.

    A pile is None (`null` on the wire) where the step cannot state it: the activations of a
    step whose activations are not known, a pile's high or its value at the peak moment on a
    step that did not watch it throughout (docs/numbers.md#not-known). Never a guess, never 0
    for "not known"; the ledger's own counts are always ints.
    """

    weights: int | None = 0
    gradients: int | None = 0
    optimizer_state: int | None = 0
    activations: int | None = 0

    @property
    def total(self) -> int | None:
        """Sum of the four tracked piles; None when any of them is not known (a sum without
        one is not the total)."""
        return sum(self.counted()) if self.known else None

    @property
    def known(self) -> bool:
        """Whether every pile is stated."""
        return None not in (self.weights, self.gradients, self.optimizer_state, self.activations)

    def counted(self) -> tuple[int, int, int, int]:
        """The four piles of a composition every pile of which is counted (the agent's ledger,
        a `Tick`); raises ValueError on one that holds a pile not known, which such a
        composition never does."""
        weights, gradients, state, activations = (
            self.weights,
            self.gradients,
            self.optimizer_state,
            self.activations,
        )
        if weights is None or gradients is None or state is None or activations is None:
            raise ValueError("a counted composition holds a pile that is not known")
        return weights, gradients, state, activations

    def as_dict(self) -> dict[str, int | None]:
        """The piles keyed by their report names (None: not known)."""
        return {name: getattr(self, name) for name in PILES}


class DtypeStat(msgspec.Struct, array_like=True, frozen=True):
    """Bytes and number of unique storages of one dtype within one pile."""

    bytes: int
    count: int


class Allocator(msgspec.Struct, frozen=True, omit_defaults=True):
    """Device-side counters; every field is None where the counter does not exist (CPU).

    The first six are the report contract. The rest come from the caching allocator's own
    statistics: `active`, `peak_reserved`, `inactive_split` (bytes of split blocks that are free:
    fragmentation) at close; the event counts are per step (differences of cumulative counters).
    `peak_exact` says whether `peak_allocated` is this step's own peak (see allocator.py).
    `nvml_note` explains a missing or approximate process figure (PID namespace, no NVML).
    """

    allocated: int | None = None
    reserved: int | None = None
    peak_allocated: int | None = None
    process_gpu: int | None = None
    device_used: int | None = None
    device_total: int | None = None
    active: int | None = None
    peak_reserved: int | None = None
    inactive_split: int | None = None
    peak_exact: bool | None = None
    phase_peaks: Annotated[dict[str, int], _BOUNDED] | None = None
    allocations: int | None = None
    frees: int | None = None
    alloc_bytes: int | None = None
    freed_bytes: int | None = None
    segment_allocs: int | None = None
    segment_frees: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    nvml_note: str | None = None


class Host(msgspec.Struct, frozen=True, omit_defaults=True):
    """Host memory of the training process and of the machine."""

    rss: int = 0
    system_total: int | None = None
    system_used: int | None = None


class NanOrigin(msgspec.Struct, frozen=True, omit_defaults=True):
    """The torch call that made a step's first NaN/Inf (`--nan-check full`, or the steps armed
    after an alarm; docs/design.md#nan-checks).

    `op` is torch's name for the call (`torch.log`), `file`/`line` the job's line that made it.
    `module` names the module whose forward ran it; None: outside any module (the loss).
    `in_input`: its data inputs were already non-finite (the batch held the NaN/Inf), so the
    call only met it first; `in_weights`: its parameters were (loaded or written so).
    """

    op: str
    file: str
    line: int
    module: str | None = None
    in_input: bool = False
    in_weights: bool = False


class Alert(msgspec.Struct, frozen=True, omit_defaults=True):
    """Something the user should act on. `kind` is one of the alert kinds of
    docs/report-format.md#alert-kinds.

    `group` is the step of an earlier alert this one follows from (e.g. every step after the
    weights turned non-finite), so viewers can fold it under that first alert. `origin`: the
    call that made the step's first NaN/Inf (non-finite alerts whose forward was watched).
    """

    kind: str
    """An `AlertKind` value; a plain string on the wire so newer kinds still decode."""
    message: str
    where: str | None = None
    group: int | None = None
    origin: NanOrigin | None = None
    """For non-finite alerts: the call that made the first NaN/Inf, when it was watched."""
    began: int | None = None
    """The step where what the alert reports began, when earlier than its own: a divergence's
    first step of growth, on the `divergence` alert and on the non-finite alerts that follow it
    while it lasts. None otherwise (and in older recordings)."""


class ModuleBytes(msgspec.Struct, array_like=True, frozen=True):
    """Saved-activation bytes attributed to one module (by id from a `Names` message)."""

    module: int
    bytes: int


class BlockBytes(msgspec.Struct, array_like=True, frozen=True):
    """One repeated block of a model (a child of its largest `nn.ModuleList`/`nn.Sequential`)
    on a step whose activations were measured: what a checkpoint over it would free and keep.

    `saved`: the activation bytes saved inside the block (its modules' highs, each storage
    counted once, under the module that saved it first); `inputs`: the bytes of the plain
    tensors passed to it, the most of one call (what a checkpoint over it holds).
    """

    module: int
    saved: int
    inputs: int


class AllocEvent(msgspec.Struct, array_like=True, frozen=True):
    """Allocator events of one size from one source line, folded (`--alloc-events`).

    `where` is `file:line function` of the innermost frame outside torch and the agent, or ""
    when the allocator recorded no stack for the event.
    """

    size: int
    count: int
    where: str


class AllocEvents(msgspec.Struct, frozen=True, omit_defaults=True):
    """The allocator's history ring drained at a step close (`--alloc-events`, CUDA only).

    Bounded: at most a few `largest` allocations and `segments` (segment growth: cudaMalloc or
    an expandable segment's new mapping), with totals for all of them. `oom` is the failed
    request (`count`: out-of-memory events in the step), `oom_free` what the device had free.
    `lost`: allocations of the step that the bounded ring did not keep (from the allocator's own
    counters); `overflowed`: the ring wrapped, so the step's earliest events are missing.
    """

    largest: Annotated[list[AllocEvent], _BOUNDED] = []
    segments: Annotated[list[AllocEvent], _BOUNDED] = []
    allocations: int = 0
    alloc_bytes: int = 0
    segment_allocs: int = 0
    segment_bytes: int = 0
    oom: AllocEvent | None = None
    oom_free: int | None = None
    lost: int = 0
    overflowed: bool = False


class Hello(msgspec.Struct, tag="hello", frozen=True, omit_defaults=True):
    """First message of every stream and recording: who the job is."""

    format_version: int
    agent_version: str
    pid: int
    argv: Annotated[list[str], _BOUNDED]
    started: str
    started_unix: float
    torch: str = ""
    device: str = "cpu"
    python: str = ""
    hostname: str = ""
    cwd: str = ""
    recording: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    budget: int | None = None
    process_create_time: float | None = None
    expandable_segments: bool | None = None
    """Whether the CUDA caching allocator was set up with `expandable_segments:True` when the
    agent started (`PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF`); None where torch sees no
    CUDA device, and in older recordings (not known)."""
    launch: str | None = None
    """The scheduler's launch this process belongs to (`memtui_protocol.launch`): a task of the
    same `srun` step keeps this recording when it starts into the same session folder."""


class Names(msgspec.Struct, tag="names", frozen=True):
    """Names sent once and referenced by id afterwards (`first_id` + position)."""

    kind: str
    first_id: int
    names: Annotated[list[str], msgspec.Meta(max_length=MAX_NAMES)]


class Distributed(msgspec.Struct, frozen=True, omit_defaults=True):
    """Memory data-parallel wrappers hold outside the four piles (`memtui_agent.job.distributed`).

    `ddp_buckets`: bytes of DDP's gradient buckets; `ddp_bucket_view`: whether the gradients
    are views into them (`gradient_as_bucket_view=True`); `ddp_in_gradients`: the part of the
    buckets the gradients pile already counts. `fsdp_gathered`: FSDP2's unsharded (all-gathered)
    parameters at close; `fsdp_gathered_max`: the highest sampled during the step.
    """

    ddp_buckets: int | None = None
    ddp_bucket_view: bool | None = None
    ddp_in_gradients: int | None = None
    fsdp_gathered: int | None = None
    fsdp_gathered_max: int | None = None

    def untracked_buckets(self) -> int:
        """DDP bucket bytes the gradients pile does not already count (all of them unless the
        gradients are views into the buckets)."""
        return max(0, (self.ddp_buckets or 0) - (self.ddp_in_gradients or 0))

    def untracked(self) -> int:
        """Bytes of these that no pile counts (to take out of the allocator's `other`)."""
        return self.untracked_buckets() + (self.fsdp_gathered_max or 0)


class Workers(msgspec.Struct, frozen=True, omit_defaults=True):
    """The job's DataLoader worker processes and their memory, as last sampled (off the
    training thread, about once a second) before the step closed. Never part of the piles nor
    of the process's RSS: each worker is a process of its own (docs/numbers.md#dataloader-workers).
    """

    count: int
    """Worker processes alive at the sample."""
    uss: int
    """Their private memory (unique set size) summed: what the machine frees if they exit."""
    growth: int
    """How much `uss` grew since each worker's baseline (its first sample after the first step
    close that followed its start), summed over the workers alive."""
    pss: int | None = None
    """Their proportional set size summed (shared pages split among the processes sharing
    them); None where the system does not say it."""
    sampled: float = 0.0
    """When they were sampled (Unix time)."""


class Leak(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one holder keeps alive and how fast it grows (docs/design.md#leaks).

    Sent in the frame of each step whose close took a census (`Step.leaks`); the latest entry
    per holder is the report's `leaks`.
    """

    holder: str
    """The shortest path from a name the user wrote: `history`, `model.encoder.cache`,
    `outputs (closure of make_hook.<locals>.store)`, `val_total (local of train)`."""
    kind: str
    """`LeakKind`: a retained graph, tensors, or a graph history."""
    bytes: int
    tensors: int
    per_step: int
    """Bytes it grew by per step between the last two censuses."""
    first_step: int
    """The step its growth began at."""
    graphs_not_known: int = 0
    """Autograd graphs it keeps alive whose saved tensors are not known (built while the
    agent's saved-tensor hooks were off: nothing recorded what they saved, and the agent never
    unpacks a graph to find out): `bytes` is then what the rest of it holds, a lower bound."""
    fix: str | None = None
    """The one-line fix that usually applies to a leak of this shape, as the agent words it
    (the same words end the holder's `leak` alert); None in recordings of agents before it was
    a field (readers then show no fix)."""
    every: int | None = None
    """Its cadence: it grew at every `every`-th close of the span the agent watched (1: at each
    close; 5: an evaluation every 5 steps), from the closes whose growth stood above the noise
    (two of them at least, at equal gaps). None: not known (a growth too slow to see close by
    close on a CPU's noisy heap, or irregular), or a recording from before this field."""
    nodes: int = 0
    """Autograd nodes its tensors' graphs keep alive, as the census walked them (0 in recordings
    of agents before it was a field, and where none is reached)."""
    nodes_per_step: int = 0
    """Nodes its graphs grew by per step between the last two censuses: what a `graph_history`
    leak grows by (the host bytes of a node are not known)."""


class CensusCost(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a census of live tensors cost the step whose close ran it (`memory/census.py`)."""

    seconds: float
    objects: int
    complete: bool = True
    """False when its bound stopped it: the holders named are real, more may exist."""
    stopped: str | None = None
    """`CensusStop`: which bound stopped it, or an error; None when it did not stop early."""


MAX_KEPT_HOLDERS = 16
"""Holders one `Kept` names at most (the largest); its totals count them all."""


class KeptHolder(msgspec.Struct, frozen=True):
    """One holder of tensors the job keeps that no pile counts (`Kept.holders`)."""

    holder: str
    """Named as a leak's holder is: the shortest path from a name the user wrote (`ema`,
    `trainer.shadow`, `x (local of train)`)."""
    bytes: int
    """Its storages no pile and no other holder counts, each once."""
    tensors: int
    """Its tensors whose storage it counts."""


class Kept(msgspec.Struct, frozen=True, omit_defaults=True):
    """Tensors the job keeps at a close that no pile holds, as a census at that close found
    them (docs/numbers.md#tensors-the-job-keeps): an EMA kept as a list of tensors, a buffer
    dict on the side, the batch and outputs the loop still refers to. Part of what `other`
    holds beside the piles. Only on the steps whose close took a census: nothing proves it
    unchanged between censuses, so no other step states it."""

    bytes: int | None
    """Unique storages of every holder (a view counted once, storages in a pile, held
    activations and gradients left out); None when the census stopped at its bound (then more
    holders may exist than those named)."""
    tensors: int
    holders: Annotated[list[KeptHolder], msgspec.Meta(max_length=MAX_KEPT_HOLDERS)] = []
    """The largest holders, largest first."""


LATE_SEARCH = 64
"""How far back a late value may point: the agent never keeps more steps pending."""
MAX_LATE = 4 * LATE_SEARCH
"""The most late values one frame carries. The agent's are at most `LATE_SEARCH` loss and scale
values plus a few deferred health checks (`health.MAX_DEFERRED`); a reader refuses a longer
list before building it, as it does every other list."""
MAX_LATE_ALERTS = 64
"""The most alerts one late value carries (a step's deferred health check raises a few)."""
MAX_LATE_BATCHES = 4
"""Late values with alerts a reader folds into one step (the agent sends one per step, from
its health check); later ones for that step are dropped, so a crafted stream naming one step
over and over costs each step a few copies of its alerts, never one per frame."""


class StepLate(msgspec.Struct, frozen=True, omit_defaults=True):
    """Values of an earlier step that were still on the GPU when its frame was written.

    A step's frame is written as its `optimizer.step()` returns, before control goes back to
    the job, so a kill right after a step never loses it. A loss or GradScaler scale held in
    device memory cannot be read then without waiting for the device; it is copied to the host
    behind an event instead, and carried by a later frame (`Step.late`, `End.late`) once there.
    Readers fold it into the step it names with `apply_late`. On a CPU job there is none.
    """

    step: int
    loss: float | None = None
    scale: float | None = None
    alerts: Annotated[list[Alert], msgspec.Meta(max_length=MAX_LATE_ALERTS)] = []
    grad_norm: float | None = None
    """The step's global gradient norm, read with its deferred health check (`Step.grad_norm`)."""


class Step(msgspec.Struct, tag="step", frozen=True, omit_defaults=True):
    """One closed optimizer step (or one GradScaler-skipped update).

    `end` is taken when the step closes; `max` is each pile's high-water mark during the step;
    `peak` is the pile composition at the moment the tracked total was highest. `dtypes` is the
    inventory at close for weights, gradients and optimizer state, and at the pile's high-water
    mark for activations (which are normally freed by the time the step closes).
    """

    step: int
    t_start: float
    t_end: float
    end: Piles
    max: Piles
    peak: Piles
    microbatches: int = 0
    skipped: bool = False
    dtypes: Annotated[dict[str, Annotated[dict[str, DtypeStat], _BOUNDED]], _BOUNDED] = {}
    allocator: Allocator = Allocator()
    host: Host = Host()
    loss: float | None = None
    scale: float | None = None
    alerts: Annotated[list[Alert], _BOUNDED] = []
    top_activations: Annotated[list[ModuleBytes], _BOUNDED] = []
    dropped: int = 0
    distributed: Distributed | None = None
    alloc_events: AllocEvents | None = None
    closed_by: StepTrigger = StepTrigger.OPTIMIZER
    optimizer: str | None = None
    """The optimizer whose `step()` closed this frame, as `AdamW#1` (class, index in order of
    first step); None when a backward closed it."""
    optimizer_step: int | None = None
    """This optimizer's own step count (1 for its first `step()`)."""
    activations_measured: bool = True
    """Whether this step's activations were measured (saved-tensor hooks armed, issue 15);
    False: carried from step `activations_from`, or not measured at all (`--activations off`).
    Recordings of older agents measured every step."""
    activations_from: int | None = None
    """The measured step whose activation figures this one repeats and carries; None with
    `activations_measured` False means they are not known (measured in part, or off)."""
    activations_why_at: int | None = None
    """For a step whose activations are not known: the step whose `activations_vary` alert says
    why (each cause is said once, at the first step it holds; later steps with the same cause
    point there). None otherwise, and under `--activations off`, which the user asked for."""
    late: Annotated[list[StepLate], msgspec.Meta(max_length=MAX_LATE)] = []
    """Device values of earlier steps that reached the host since (see `StepLate`)."""
    leaks: Annotated[list[Leak], _BOUNDED] = []
    """Holders whose memory grows, as a census at this close found them (see `Leak`)."""
    census: CensusCost | None = None
    """The census this close ran, if any: its cost is part of the step's time."""
    kept: Kept | None = None
    """Tensors the job keeps that no pile holds, as this close's census found them; None on
    the steps that took no census."""
    workers: Workers | None = None
    """The job's DataLoader worker processes as last sampled before the close; None when it
    has none (or none the agent saw start)."""
    grad_norm: float | None = None
    """The global L2 norm of every gradient the agent watches, as the optimizer used them (after
    any clipping and GradScaler's unscale), read by the health check's fused pass; the value
    `torch.nn.utils.clip_grad_norm_` returns over the same gradients. None when not known: no
    gradients, sharded ones (FSDP, DTensor: a rank's shard is not the global norm), a
    non-finite norm, the check off, or on a GPU while its copy travels (then in a later
    frame's `late`)."""
    blocks: Annotated[list[BlockBytes], _BOUNDED] = []
    """Each repeated block's saved and input bytes, on a step whose activations were measured
    (not carried): what `memtui estimate --from` plans activation checkpoints with."""


def apply_late(
    steps: list[Step], late: list[StepLate], batches: dict[int, int] | None = None
) -> list[tuple[int, Alert]]:
    """Fold late device values into the steps they name, in place (one fold for every reader).

    Returns the alerts that arrived late, with their step, for readers that index alerts. A
    value for a step the reader no longer holds (trimmed history, or older than the last
    `LATE_SEARCH` steps) is ignored.

    Linear in what it is given: the last `LATE_SEARCH` steps are indexed once per call, the
    values of one step are gathered first and the step is rebuilt once. A step keeps at most
    `MAX_ITEMS` alerts and takes late alerts from at most `MAX_LATE_BATCHES` calls, counted in
    `batches` (step number -> calls so far; the caller keeps it across calls, this function
    forgets the steps that have left the window).
    """
    added: list[tuple[int, Alert]] = []
    if not late:
        return added
    first = max(0, len(steps) - LATE_SEARCH)
    recent = {steps[index].step: index for index in range(first, len(steps))}  # latest wins
    batches = {} if batches is None else batches
    for number in [number for number in batches if number not in recent]:
        del batches[number]
    gathered: dict[int, tuple[float | None, float | None, float | None, list[Alert]]] = {}
    for values in late:
        index = recent.get(values.step)
        if index is None:
            continue
        loss, scale, norm, alerts = gathered.get(index, (None, None, None, []))
        gathered[index] = (
            values.loss if values.loss is not None else loss,
            values.scale if values.scale is not None else scale,
            values.grad_norm if values.grad_norm is not None else norm,
            alerts,
        )
        if values.alerts and batches.get(values.step, 0) < MAX_LATE_BATCHES:
            room = MAX_ITEMS - len(steps[index].alerts) - len(alerts)
            alerts.extend(values.alerts[: max(0, room)])
    for index, (loss, scale, norm, alerts) in gathered.items():
        step = steps[index]
        if alerts:
            batches[step.step] = batches.get(step.step, 0) + 1
        steps[index] = msgspec.structs.replace(
            step,
            loss=loss if loss is not None else step.loss,
            scale=scale if scale is not None else step.scale,
            grad_norm=norm if norm is not None else step.grad_norm,
            alerts=[*step.alerts, *alerts] if alerts else step.alerts,
        )
        added.extend((step.step, alert) for alert in alerts)
    return added


class AlertNow(msgspec.Struct, tag="alert", frozen=True):
    """An alert that cannot wait for its step to close (a forecast over budget, say)."""

    time: float
    step: int
    alert: Alert


class Tick(msgspec.Struct, tag="tick", frozen=True, omit_defaults=True):
    """Live piles between step closes, at most about once a second.

    Jobs without an optimizer (inference, evaluation) and very long steps still show progress.
    """

    time: float
    piles: Piles
    phase: str = Phase.BETWEEN.value
    step: int = 0
    host: Host = Host()


RECORDING_STOPPED = "recording"
"""`AgentError.component` of the failure that stopped the recording (a full disk): the agent's
last frame in the file when it could still write one, and what viewers are told."""

VIEWER_CLOSED = "viewer"
"""`AgentError.component` of the last frame a job sends a viewer it refuses (too many viewers)
or drops (too far behind); the message is the one line the viewer shows."""


class AgentError(msgspec.Struct, tag="agent_error", frozen=True):
    """A part of the agent failed and disabled itself; the job goes on."""

    time: float
    component: str
    message: str


class End(msgspec.Struct, tag="end", frozen=True, omit_defaults=True):
    """Last message: how the job ended (`status`: an `ExitStatus` value). Its absence means
    the process was killed.

    `alloc_events` (with `--alloc-events`) covers the step that never closed: the allocations
    since the last close, up to the out-of-memory that ended the job.
    """

    time: float
    status: str
    code: int | None = None
    error_type: str | None = None
    error: str | None = None
    step: int | None = None
    phase: str | None = None
    oom: bool = False
    piles: Piles | None = None
    alerts: Annotated[list[Alert], _BOUNDED] = []
    requested: int | None = None
    reserved_unallocated: int | None = None
    """CUDA out-of-memory: bytes the caching allocator had reserved but not allocated when the
    request failed (fragmentation), as torch's error stated them; None: not known (a CPU job,
    a message without the figure, an older recording)."""
    alloc_events: AllocEvents | None = None
    late: Annotated[list[StepLate], msgspec.Meta(max_length=MAX_LATE)] = []
    """Device values of the last steps, read as the job ended (see `StepLate`)."""
    leaks: Annotated[list[Leak], _BOUNDED] = []
    """The leaks named during the run, as a census found them when the job ended."""

    @property
    def interrupted(self) -> bool:
        """The job ended on Ctrl-C (a KeyboardInterrupt reached the top of its script)."""
        return self.error_type == "KeyboardInterrupt"

    def describe_error(self) -> str | None:
        """The error in one line, as every reader shows it: `Type: message`, or the type
        alone where the message is empty or just repeats it (`KeyboardInterrupt`)."""
        if self.error_type is None:
            return self.error
        if not self.error or self.error == self.error_type:
            return self.error_type
        return f"{self.error_type}: {self.error}"


Message = Hello | Names | Step | Tick | AgentError | End | AlertNow
"""Every message type, as a tagged union decoded by `wire`."""
