"""The `memtui report --json` document as typed structs, serialised strictly.

The contract is written down in `docs/report-format.md`; these structs are that contract in code,
so a key cannot be misspelt in one place and right in another. Output is strict JSON: msgspec
writes a NaN or infinite float (a diverged loss) as `null`, never the `NaN` token that
`json.dumps` prints and no JSON parser accepts. Extra keys beyond the contract are allowed and
listed in the document; fields that exist only for some recordings (`alloc_events`) are left out
rather than written as null (`msgspec.UNSET`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from memtui.model.leaks import CensusTally
from memtui_protocol.schema import NanOrigin

REPORT_FORMAT = "memtui-report"
REPORT_VERSION = 2
"""Bumped only when a key of the contract changes meaning or goes away; new keys do not.
2: a pile the step does not know is null in `end`, `max` and `peak` (and `peak.total`),
where version 1 held what the agent saw of it."""


class PileBytes(msgspec.Struct):
    """Bytes in each tracked pile (`schema.Pile` names); null where the step does not know
    the pile (docs/report-format.md)."""

    weights: int | None
    gradients: int | None
    optimizer_state: int | None
    activations: int | None


class PeakEntry(msgspec.Struct):
    """The composition at the moment of the step's highest tracked total (null: not known)."""

    total: int | None
    """The four piles' total at that moment."""
    piles: PileBytes
    held: int | None = None
    """The step's peak as every view states it: `total` plus DDP's buckets and FSDP's gathered
    parameters, which no pile counts (`memtui_protocol.peak`, docs/numbers.md)."""


class AllocatorEntry(msgspec.Struct):
    """Device counters at the close; null where the counter does not exist (CPU)."""

    allocated: int | None
    reserved: int | None
    peak_allocated: int | None
    process_gpu: int | None
    device_used: int | None
    device_total: int | None


class HostEntry(msgspec.Struct):
    """Host memory of the training process."""

    rss: int


class WorkersEntry(msgspec.Struct):
    """The job's DataLoader worker processes as last sampled before the close: their count,
    summed private memory (USS) and PSS (null where the system does not say it), and how much
    the USS grew since each worker's first sample. Never part of the piles or of `host.rss`."""

    count: int
    uss: int
    pss: int | None
    growth: int


class AlertEntry(msgspec.Struct, omit_defaults=True):
    """An alert inside its step's entry. `kind` is an `AlertKind` value (or a newer agent's
    kind, kept as written); `severity` its `Severity` (`error`, `warning`, `note`; a kind this
    version does not know: `warning`); `group` only when it follows an earlier alert."""

    kind: str
    severity: str
    message: str
    where: str | None
    group: int | None = None
    origin: NanOrigin | None = None
    """The call that made a non-finite alert's first NaN/Inf, when the agent watched it."""
    began: int | None = None


class RunAlert(msgspec.Struct, omit_defaults=True):
    """An alert in the run-wide list: the same, with its step."""

    step: int | None
    kind: str
    severity: str
    message: str
    where: str | None
    group: int | None = None
    origin: NanOrigin | None = None
    began: int | None = None


class ModuleEntry(msgspec.Struct):
    """Saved-activation bytes of one module."""

    module: str
    bytes: int


class LeakEntry(msgspec.Struct):
    """What one holder keeps alive (docs/design.md#leaks). `kind` is a `LeakKind` value (or a
    newer agent's kind, kept as written)."""

    holder: str
    kind: str
    bytes: int
    tensors: int
    per_step: int
    first_step: int
    graphs_not_known: int = 0
    """Graphs it keeps whose saved tensors are not known (`bytes` is then a lower bound)."""
    fix: str | None = None
    """The fix the agent proposed (`Leak.fix`); null in recordings of agents before it."""
    every: int | None = None
    """Its cadence (`Leak.every`): it grew at every `every`-th step (1: each); null when not
    known (a growth too slow to see step by step, irregular, or an older recording)."""
    nodes: int = 0
    """Autograd nodes its graphs keep alive (`Leak.nodes`)."""
    nodes_per_step: int = 0
    """Nodes they grew by per step (`Leak.nodes_per_step`): what a `graph_history` grows by."""


class CensusEntry(msgspec.Struct):
    """The census of live tensors a step's close ran: its cost (part of the step's time)."""

    seconds: float
    objects: int
    complete: bool
    stopped: str | None = None
    """Why it ended early: `objects` or `seconds` (its bounds), `error`; None when it did not."""


class KeptHolderEntry(msgspec.Struct):
    """One holder of tensors the job keeps outside every pile (`Kept.holders`)."""

    holder: str
    bytes: int
    tensors: int


class KeptEntry(msgspec.Struct):
    """Tensors the job keeps that no pile holds, as the step's census found them."""

    bytes: int | None
    """Unique storages of all holders; null when the census stopped at its bound."""
    tensors: int
    holders: list[KeptHolderEntry]
    """The largest holders (at most 16), largest first."""


class StepEntry(msgspec.Struct):
    """One closed step (see "What a step is" in the document)."""

    step: int
    optimizer: str | None
    optimizer_step: int | None
    closed_by: str
    skipped: bool
    microbatches: int
    end: PileBytes
    max: PileBytes
    peak: PeakEntry
    dtypes: dict[str, dict[str, int]]
    dtype_tensors: dict[str, dict[str, int]]
    allocator: AllocatorEntry
    host: HostEntry
    loss: float | None
    scale: float | None
    grad_norm: float | None
    duration_s: float
    activations_measured: bool
    activations_from: int | None
    activations_why_at: int | None
    top_activations: list[ModuleEntry]
    distributed: dict[str, Any] | None
    alerts: list[AlertEntry]
    alloc_events: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    leaks: list[LeakEntry] | msgspec.UnsetType = msgspec.UNSET
    """Only on a step whose close took a census that named growing holders."""
    census: CensusEntry | msgspec.UnsetType = msgspec.UNSET
    """Only on a step whose close took a census."""
    kept: KeptEntry | msgspec.UnsetType = msgspec.UNSET
    """Only on a step whose close took a census: nothing proves it unchanged between them."""
    workers: WorkersEntry | msgspec.UnsetType = msgspec.UNSET
    """Only on a step of a job with DataLoader worker processes (as last sampled)."""


class JobEntry(msgspec.Struct):
    """Who the job was."""

    argv: list[str]
    pid: int
    torch: str
    device: str
    started: str
    recording: str


class ExitEntry(msgspec.Struct):
    """How the job ended (`status`: an `ExitStatus` value)."""

    status: str
    code: int | None
    error: str | None
    step: int | None
    phase: str | None
    oom: bool | msgspec.UnsetType = msgspec.UNSET
    requested: int | msgspec.UnsetType | None = msgspec.UNSET
    piles: PileBytes | msgspec.UnsetType | None = msgspec.UNSET
    alloc_events: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class OutOfMemoryEntry(msgspec.Struct):
    """Out of memory explained (`memtui.model.out_of_memory`): the job died of out-of-memory
    (`cause` "oom") or a step's peak passed `--budget` (`cause` "over_budget"); null where a
    figure is not known."""

    cause: str
    step: int | None
    phase: str | None
    requested: int | None
    requested_where: str | None
    budget: int | None
    peak: int | None
    piles: PileBytes | None
    piles_at: str
    piles_step: int | None
    top_modules: list[ModuleEntry]
    modules_step: int | None
    reserved_unallocated: int | None
    expandable_segments: bool | None
    batch_fraction: float | None
    batch_fraction_why: str | None
    batch_step: int | None


class PeakPhases(msgspec.Struct):
    """The first update's peak apart from the steady state's (steps 2 and later)."""

    first_step: int | None
    steady: int | None


class AgentErrorEntry(msgspec.Struct):
    """A part of the agent that turned itself off, and why."""

    component: str
    message: str


class Report(msgspec.Struct, kw_only=True):
    """The whole document."""

    format: str = REPORT_FORMAT
    version: int = REPORT_VERSION
    job: JobEntry
    steps: list[StepEntry]
    optimizers: dict[str, int]
    step_rule: str | None
    alerts: list[RunAlert]
    leaks: list[LeakEntry]
    censuses: CensusTally | None
    """Every census of the run (how many, their time in all and the longest, the most objects
    one visited, how many their bound stopped); None when none ran."""
    exit: ExitEntry
    peaks: PeakPhases
    agent_errors: list[AgentErrorEntry]
    warnings: list[str]
    out_of_memory: OutOfMemoryEntry | None = None
    """Why the job ran out of memory or over its budget, and what would fit; null when
    neither happened."""


def strict_json(document: Any) -> str:
    """`document` (structs, dicts, lists, numbers) as indented strict JSON: NaN/Inf -> null."""
    from memtui.terminal_text import json_safe

    encoded = msgspec.json.format(msgspec.json.encode(document), indent=2).decode("utf-8")
    return json_safe(encoded)  # C1, bidi and zero-width characters as \u escapes
