"""When to measure activations, and the exact figures a step that repeats a measured one carries.

Counting every saved tensor costs a Python call per saved tensor, per gradient and per module
call (benchmarks/ablation.py). In `auto` mode the full hook set is armed only for steps whose
activations can differ from one already measured: the first steps of an optimizer, a new input
signature, a recent alert or armed NaN probes, a budget nearly reached, and an audit step every
`audit_every` steps. Any other step repeats a measured one: same calls to the same root modules
with the same input shapes, dtypes, devices and modes, from the same persistent piles. Its
activation figures are carried from that step, which is exact for every job whose activations
depend on shapes only. An audit that finds a repeat measuring differently (MoE routing,
data-dependent masks) switches the job to measuring every step (`decision.decide` says so).

The policy is plain bookkeeping: at a close it says what the step matches (`Match`), and
`decision.decide` says what that means. The activation gate (`gate.ActivationGate`) asks it,
adds the reasons to measure it does not know (NaN probes, FSDP, a budget nearly reached, alerts),
arms or disarms the hooks, and is the only one to change its `mode`.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from memtui_agent.steps.activation_cause import Cause
from memtui_agent.steps.step_signature import Signature
from memtui_protocol import schema

if TYPE_CHECKING:  # torch is imported where a signature is made, not at import
    import torch

FIRST_STEPS = 3
"""Steps measured after an optimizer appears (its state and the graph settle in them)."""
AUDIT_EVERY = 100
KEEP_REFERENCES = 512
"""Measured signatures remembered. Dynamic padding makes one signature per padded length, a few
hundred in a text dataset: a job cycling through more than this measures the rest. About 3.7 KiB
each on a BERT (the figures, the calls' shapes, their tree): under 2 MiB when full."""
KEEP_CALLS = 8192
"""Root calls remembered over all signatures: bounds the memory of a job that calls its model
many times per step (an RL rollout), which then keeps fewer signatures."""
MAX_SIGNATURE_ITEMS = 64
"""Values looked at per root call; a call with more gets an opaque (never repeating) signature."""

CallSignature: TypeAlias = Hashable
"""What the policy tells one root call by: compared and remembered, never looked into (the gate
gives `(call_signature(...), foreign hooks on top)`)."""
CallModes: TypeAlias = "tuple[int, bool, bool, bool, torch.dtype]"
"""A root call's module (its id), training flag, grad mode, autocast on and its dtype."""
StartKey: TypeAlias = tuple[int, int, int, tuple[tuple[int, bool], ...]]
"""What a step starts from: weights, gradients and optimizer state bytes, and the live
optimizers (id, whether it holds state yet)."""
StepKey: TypeAlias = tuple[StartKey, tuple[CallSignature, ...]]
"""A step as remembered: its start and its root calls."""
Described: TypeAlias = Hashable | type
"""A bounded stand-in for one of the job's values in a signature (a class for what is only
told by its type: mypy sees no `__hash__` on `type[object]`)."""


@dataclass(frozen=True)
class Figures:
    """Everything a step says about its activations (what a repeating step carries), and the
    counters that show a later step repeats it (`step_signature`, the activations it started
    from: graphs held from earlier steps)."""

    step: int
    end_activations: int
    high: schema.Piles
    peak: schema.Piles
    dtypes: dict[str, schema.DtypeStat]
    top: tuple[schema.ModuleBytes, ...]
    signature: Signature | None = None
    start_activations: int = 0


class _Prefixes:
    """The remembered signatures' call sequences as a tree, so that a step's calls so far are
    checked against all of them in one dictionary lookup per root call (a scan of every
    signature at every call would cost as much as the hooks it saves, at a few hundred)."""

    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[CallSignature, _Prefixes] = {}
        self.count = 0

    def add(self, calls: tuple[CallSignature, ...]) -> None:
        node = self
        node.count += 1
        for call in calls:
            node = node.children.setdefault(call, _Prefixes())
            node.count += 1

    def remove(self, calls: tuple[CallSignature, ...]) -> None:
        node = self
        node.count -= 1
        for call in calls:
            child = node.children[call]
            child.count -= 1
            if not child.count:
                del node.children[call]
                return
            node = child


@dataclass(frozen=True)
class Match:
    """What the policy's bookkeeping found for a closing step; what it means is decided by
    `decision.decide`."""

    armed_throughout: bool = False
    """Measured whole: armed from before its first root call (or `every`)."""
    twin: Figures | None = None
    """The remembered step of the same key (the same start and calls), as it was before this
    close; for a step armed throughout only if a root module was called."""
    partial: bool = False
    """Measured in part, or a repeat of a prefix that then ran differently."""
    armed_for: Cause = Cause.MEASURED
    """Why a step armed throughout was armed (`Cause.MEASURED`: from its start)."""


@dataclass(frozen=True)
class Verdict:
    """How a closing step's activation figures came about."""

    measured: bool
    carried: Figures | None = None
    """The measured step whose figures this one repeats (None: measured, or not known)."""
    alert: schema.Alert | None = None
    note: schema.Alert | None = None
    """How the steps are measured from now on, said once apart from `alert` (`compiled`)."""
    why_at: int | None = None
    """Not known: the step whose alert says why (`activation_wording.SaidOnce.said_at`)."""

    def peak(self, measured: schema.Piles) -> schema.Piles:
        """The step's peak: the carried one for a repeat, else what the ledger measured."""
        return self.carried.peak if self.carried is not None else measured


@functools.cache
def _autocast_device() -> str:
    """The device type whose autocast state a signature holds: CUDA where the process has it.
    Asked once: `torch.cuda.is_available()` costs about 0.8 us, at every root call."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def call_signature(
    module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[CallModes, Described, Described]:
    """What of a root call can change its activations: the module, its training flag, grad
    and autocast modes, and each argument's shape, dtype, device and requires_grad (plain
    values as themselves)."""
    import torch

    budget = [MAX_SIGNATURE_ITEMS]
    device = _autocast_device()
    modes: CallModes = (
        id(module),
        module.training,
        torch.is_grad_enabled(),
        torch.is_autocast_enabled(device),
        torch.get_autocast_dtype(device),
    )
    return modes, _describe(args, 0, budget), _describe(kwargs, 0, budget)


def _describe(value: object, depth: int, budget: list[int]) -> Described:
    """One argument's part of a signature, spending `budget[0]` items at most.

    The signature holds bounded data only, never the job's objects: a signature is remembered
    for hundreds of steps, and a job passing a new 1 MiB string per step (a prompt, a file
    name, a batch's text) grew by 515 MiB while signatures kept them alive. Tensors become their
    shape, dtype, device and grad flag; scalars become `_scalar`'s bounded copy; other objects
    their type.

    A module-level function, not a closure over itself: a recursive closure is a reference
    cycle, garbage for the job's collector at every root call.
    """
    import torch

    budget[0] -= 1
    if budget[0] < 0:
        return object()  # too much to compare: this call never repeats
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.requires_grad)
    scalar = _scalar(value)
    if scalar is not _NOT_SCALAR:
        return scalar
    if depth < 3 and isinstance(value, (list, tuple)):
        return tuple(_describe(item, depth + 1, budget) for item in value)
    if depth < 3 and isinstance(value, dict):
        return tuple((_key(key), _describe(item, depth + 1, budget)) for key, item in value.items())
    return type(value)


MAX_KEPT_CHARS = 64
"""A string argument up to this long is kept as itself (a mode name, a short key); a longer one
as its type, length and hash, which tell two strings apart just as well for a candidate key
(the verdict confirms every repeat with the step's own counters)."""
MAX_KEPT_BITS = 64
_NOT_SCALAR = object()


def _scalar(value: object) -> Hashable:
    """A plain value's bounded stand-in (an int, float, bool, None or short str of the base
    type, never a subclass instance the job owns), or `_NOT_SCALAR`."""
    if value is None or value is True or value is False:
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        if len(value) <= MAX_KEPT_CHARS:
            return str.__getitem__(value, slice(None))  # a str of our own for a subclass
        return (str, len(value), str.__hash__(value))
    if isinstance(value, int):
        if value.bit_length() <= MAX_KEPT_BITS:
            return int.__index__(value)
        return (int, value.bit_length(), int.__hash__(value))
    if isinstance(value, float):
        return float.__float__(value)
    return _NOT_SCALAR


def _key(key: object) -> Described:
    """A dict key's bounded stand-in: a plain value as `_scalar` keeps it, else its type."""
    scalar = _scalar(key)
    return type(key) if scalar is _NOT_SCALAR else scalar


class ActivationPolicy:
    """Per-step decisions (arm or not) and the measured figures repeats are checked against."""

    def __init__(self, mode: schema.ActivationMode, audit_every: int = AUDIT_EVERY) -> None:
        self.mode = mode
        self.audit_every = audit_every
        self._references: OrderedDict[StepKey, Figures] = OrderedDict()
        self._prefixes: dict[StartKey, _Prefixes] = {}
        """Per start key, the call sequences of `_references` (`_Prefixes`)."""
        self._cursor: _Prefixes | None = None
        """Where this step's calls so far are in `_prefixes` (None: no signature begins so)."""
        self._kept_calls = 0
        self._measure_next = 0
        """Steps still to measure whatever their signature (first steps, after a surprise)."""
        self._measure_why = Cause.FIRST_STEPS
        """Why they are measured (the cause of the request that set their count)."""
        self._armed_for = Cause.MEASURED
        """Why the open step was armed (`Cause.MEASURED`: from its start)."""
        self._start: StartKey = (0, 0, 0, ())
        self._closed: StepKey | None = None
        """The key of the step that closed last (`forget_closed`)."""
        self._calls: list[CallSignature] = []
        self._armed_at_start = False
        self._armed_late = False
        self._whole_next: dict[StartKey, int] = {}
        """Start key -> steps from it still to measure whole, after one began like a
        remembered step and diverged (measured in part). Two each time: the steps from one start
        may alternate (a GAN's two windows begin with the same call), and the next one from it
        may not be the one that diverged; once both are remembered, neither diverges again."""

    # ----- within a step -----------------------------------------------------------------------

    def measure_next(self, steps: int, why: Cause = Cause.FIRST_STEPS) -> None:
        """Measure at least the next `steps` steps (a new optimizer, an alert: `why`)."""
        if steps > 0 and steps >= self._measure_next:
            self._measure_why = why
        self._measure_next = max(self._measure_next, steps)

    def begin(self, start: schema.Piles) -> None:
        """A new step starts from these persistent piles (the previous step's close); the
        live optimizers join the key at its first root call."""
        weights, gradients, state, _ = start.counted()
        self._start = (weights, gradients, state, ())
        self._calls = []
        self._armed_at_start = False
        self._armed_late = False
        self._armed_for = Cause.MEASURED

    def first_armed(self) -> None:
        """The step is armed before its first root call (the agent's very first step)."""
        self._armed_at_start = True

    def root_call(
        self,
        signature: CallSignature,
        step: int,
        must_measure: bool,
        optimizers: tuple[tuple[int, bool], ...] = (),
    ) -> bool:
        """A top-level call of a root module; True when the hooks must be armed from now on.

        `optimizers` (id of each live optimizer, and whether it holds state yet) is read at the
        step's first call: one built since the last close (a second training stage), or its
        first step, makes the step new.
        """
        first = not self._calls
        if first:
            self._start = (*self._start[:3], optimizers)
            self._cursor = self._prefixes.get(self._start)
        self._calls.append(signature)
        if self._cursor is not None:
            self._cursor = self._cursor.children.get(signature)
        if self.mode is not schema.ActivationMode.AUTO or self._armed_at_start or self._armed_late:
            return False  # `every` is always armed, `off` never; an armed step stays armed
        audit = step % self.audit_every == 0
        whole = first and self._whole_next.get(self._start, 0) > 0
        if whole:
            self._whole_next[self._start] -= 1
            if not self._whole_next[self._start]:
                del self._whole_next[self._start]
        if first and (must_measure or self._measure_next > 0 or audit or whole):
            self._armed_at_start = True
            if must_measure:
                self._armed_for = Cause.MUST_MEASURE
            elif self._measure_next > 0:
                self._armed_for = self._measure_why
            else:
                self._armed_for = Cause.AUDIT if audit else Cause.WHOLE_AFTER_PARTIAL
            return True
        if self._cursor is not None:  # the calls so far begin some remembered signature
            return False
        if first:
            self._armed_at_start = True  # a new signature: measured whole
            self._armed_for = Cause.NEW_SIGNATURE
        else:
            self._armed_late = True  # diverged from every repeat mid-step: measured in part
        return True

    @property
    def saw_calls(self) -> bool:
        """Whether a root module was called in the step (else nothing decides arming)."""
        return bool(self._calls)

    # ----- at the close ----------------------------------------------------------------------

    def close(self, step: int, figures: Figures, blind: bool = False) -> Match:
        """What the closing step matches; `figures` is what the ledger measured, remembered for
        the repeats of a step armed throughout. The mode is read here, never changed (the gate
        applies `decision.decide`'s).

        `blind`: the job's own saved-tensor hooks kept the step's tensors from the agent's, so
        `figures` are not its activations: nothing is remembered for repeats.
        """
        key: StepKey = (self._start, tuple(self._calls))
        self._closed = key
        self._measure_next = max(0, self._measure_next - 1)
        if self.mode is schema.ActivationMode.OFF or blind:
            return Match()
        armed_throughout = self.mode is schema.ActivationMode.EVERY or self._armed_at_start
        if armed_throughout and not self._armed_late:
            known = self._references.get(key)
            self._remember(key, figures)
            twin = known if self._calls else None
            return Match(armed_throughout=True, twin=twin, armed_for=self._armed_for)
        if not self._armed_late:
            known = self._references.get(key)
            if known is not None:
                self._references.move_to_end(key)
                return Match(twin=known)
        # Measured in part: the next from this start is measured whole.
        if self._armed_late and len(self._whole_next) < KEEP_REFERENCES:
            self._whole_next[self._start] = min(self._whole_next.get(self._start, 0) + 2, 8)
        return Match(partial=True)

    def forget_closed(self) -> None:
        """The step that just closed repeated a remembered one, but its counters did not confirm
        it (`decision`): that twin is forgotten, so the next step with the same calls is
        measured and becomes the twin. Without it a twin measured among the first steps (its
        heap still holding first-time allocations: 230 KB more on benchmarks' padded BERT) left
        every later repeat of its length "not known", one in six steps."""
        key = self._closed
        if key is None or key not in self._references:
            return
        del self._references[key]
        self._forget_calls(key)

    def _forget_calls(self, key: StepKey) -> None:
        """`key`'s calls out of the prefix trees (its figures already gone)."""
        start, calls = key
        tree = self._prefixes[start]
        tree.remove(calls)
        if not tree.count:
            del self._prefixes[start]
        self._kept_calls -= len(calls)

    def _remember(self, key: StepKey, figures: Figures) -> None:
        start, calls = key
        if key not in self._references:
            self._prefixes.setdefault(start, _Prefixes()).add(calls)
            self._kept_calls += len(calls)
        self._references[key] = figures
        self._references.move_to_end(key)
        while len(self._references) > 1 and (
            len(self._references) > KEEP_REFERENCES or self._kept_calls > KEEP_CALLS
        ):
            old, _ = self._references.popitem(last=False)
            self._forget_calls(old)
