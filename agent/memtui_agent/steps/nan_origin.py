"""Which operation made a step's first NaN/Inf, and on which line of the job.

A module's output check (`health`) names the module, not what inside it went wrong, and sees
nothing of a loss computed outside every module (`-torch.log(p).mean()`: the loss is Inf and no
module output is). While module outputs are checked (`--nan-check full`, or the steps armed
after an alarm) the op watch also sees every torch call of the forward and the loss:

- a `TorchFunctionMode` pushed on the training thread as a root module's forward starts, and
  idle from the moment a backward starts (`Tensor.backward`, `torch.autograd.backward/grad`
  pass through it) until the close pops it;
- per call with a floating-point output: one device flag for the output and one for each kind
  of input it read that no earlier call of the step produced (the job's data, and its
  parameters), kept on the device (`aminmax`, no host sync) and read at the close with the
  health check's single transfer; the source line is the first frame outside torch and the
  agent, kept as (file, line) beside the flag;
- bounded: at most `MAX_OPS` calls per step are flagged (a step with more says its origin is
  not known if the first NaN came later), and the tables are emptied at each close.

At the close the first flagged call whose output is non-finite is the origin. Every earlier
output was finite, so if one of its inputs was non-finite too that value came from outside the
step's torch calls: the batch (`in_input`), or the parameters (`in_weights`: poisoned by an
update). Otherwise that call made it: its name, its line, and the module whose forward ran it
(None: outside any module, i.e. the loss).

The watch returns what the job's call returned, untouched; the agent's own torch calls (its
module-output probes) are recognised by their frames and not flagged. A job that enters its
own torch function mode inside a step and leaves it after the close would find the agent's
mode above its own; the agent pops its mode only when it is on top, and stays idle otherwise.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from threading import get_ident
from types import FrameType
from typing import Any

import torch
from torch.compiler import is_compiling
from torch.nn import Parameter
from torch.overrides import TorchFunctionMode, resolve_name

from memtui_agent.memory.ledger import local_tensor
from memtui_protocol import schema

MAX_OPS = 4096
"""Calls flagged per step: the flags (three 0-dim device tensors a call) and sites stay
bounded whatever the step does."""

_SKIPPED_DIRS: tuple[str, ...] = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # memtui_agent
)
_AGENT_DIR = _SKIPPED_DIRS[1]
_BACKWARDS = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})

Site = tuple[Callable[..., Any], str, int, "int | None"]
"""(torch function, file, line, module id or None): one flagged call."""


@dataclass(frozen=True)
class Origin:
    """Where a step's first non-finite value came from (`first_origin`)."""

    op: str
    """The torch call, as torch names it (`torch.log`, `torch.nn.functional.linear`)."""
    file: str
    line: int
    module: int | None
    """The module whose forward made the call; None outside any module (the loss)."""
    in_input: bool = False
    """The call's data inputs were already non-finite: the batch held the NaN/Inf."""
    in_weights: bool = False
    """The call's parameters were already non-finite (an earlier update poisoned them)."""

    @property
    def source(self) -> str:
        """`train.py:42`: the file's name and the line."""
        return f"{os.path.basename(self.file)}:{self.line}"


def job_line(
    frame: FrameType | None, skipped: tuple[str, ...] = _SKIPPED_DIRS, agent: str = _AGENT_DIR
) -> tuple[FrameType | None, bool]:
    """The first frame from `frame` outward whose file is outside `skipped` (torch and the
    agent): the job's line that made the call (None if there is none); and whether an agent
    frame was passed on the way (the call is the agent's own, from a hook it runs)."""
    via_agent = False
    while frame is not None:
        file = frame.f_code.co_filename
        if not file.startswith(skipped):
            break
        if file.startswith(agent):
            via_agent = True
        frame = frame.f_back
    return frame, via_agent


def first_origin(
    outputs_ok: Sequence[float],
    inputs_ok: Sequence[float],
    weights_ok: Sequence[float],
    sites: Sequence[Site],
) -> Origin | None:
    """The origin from one step's read flags (truthy: finite), in call order; None when every
    flagged output was finite (the NaN came after the last flagged call, or outside torch)."""
    for index, ok in enumerate(outputs_ok):
        if ok:
            continue
        func, file, line, module = sites[index]
        return Origin(
            op=op_name(func),
            file=file,
            line=line,
            module=module,
            in_input=not inputs_ok[index],
            in_weights=not weights_ok[index],
        )
    return None


def op_name(func: Callable[..., Any]) -> str:
    """`torch.log`, `torch.Tensor.neg`: torch's own name for an overridable function."""
    try:
        name = resolve_name(func)
    except Exception:  # a function torch's table does not know
        name = None
    return str(name or getattr(func, "__name__", "an operation"))


_PLAIN = (torch.Tensor, Parameter)


def _floating(value: object) -> list[torch.Tensor]:
    """Floating-point tensors with elements at the first level of a call's input or output, as
    the agent may read them: a DTensor's local shard (the DTensor itself would run a
    collective), plain tensors only (a subclass's `__torch_function__` is the job's code; a
    meta tensor has no values)."""
    if isinstance(value, torch.Tensor):
        items: Sequence[object] = (value,)
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return []
    found = []
    for item in items:
        if not isinstance(item, torch.Tensor):
            continue
        tensor = local_tensor(item)
        if (
            type(tensor) in _PLAIN
            and tensor.is_floating_point()
            and not tensor.is_meta
            and tensor.numel()
        ):
            found.append(tensor)
    return found


def _probe(tensor: torch.Tensor) -> torch.Tensor:
    """0-dim float32 on the tensor's device: 0 if every element is finite, else NaN (large
    finite values stay finite: `low - low + high - high`, as `health._probe`)."""
    low, high = torch.aminmax(tensor.detach())
    return (low - low + high - high).to(torch.float32)


@dataclass
class OpFlags:
    """One step's flagged calls, taken at the close: device flags and their sites."""

    outputs: list[torch.Tensor]
    inputs: list[torch.Tensor | None]
    weights: list[torch.Tensor | None]
    sites: list[Site]
    missed: int
    """Calls past `MAX_OPS`, not flagged."""

    def stacked(self, device: torch.device) -> torch.Tensor:
        """[outputs finite..., data inputs finite..., parameters finite...] as 0/1 floats on
        `device`, one tensor for the close's single transfer."""
        zero = torch.zeros((), device=device)
        flags = [
            *self.outputs,
            *(f if f is not None else zero for f in self.inputs),
            *(f if f is not None else zero for f in self.weights),
        ]
        try:
            stacked = torch.stack(flags).to(device)
        except RuntimeError:  # flags on several devices
            stacked = torch.stack([f.to(device) for f in flags])
        # The 0-dim flags go now: a check waiting for its copy keeps only the one tensor.
        self.outputs, self.inputs, self.weights = [], [], []
        return torch.isfinite(stacked).float()

    def __len__(self) -> int:
        return 3 * len(self.sites)

    def origin(self, values: Sequence[float]) -> Origin | None:
        """The origin from this step's read values (`stacked`, on the host)."""
        count = len(self.sites)
        return first_origin(
            values[:count], values[count : 2 * count], values[2 * count :], self.sites
        )


class OpWatch(TorchFunctionMode):
    """The torch function mode that flags each call of a watched forward (module docstring)."""

    def __init__(self, stack: list[int]) -> None:
        """`stack`: the module stack the counting hooks keep (its top runs the call)."""
        super().__init__()
        self._stack = stack
        self.watching = False
        self.pushed_on: int | None = None
        """The thread whose torch function stack holds this mode."""
        self.broken = False
        """An error met while flagging: the watch is off for the rest of the job."""
        self._skipped = _SKIPPED_DIRS
        """Folders whose frames are not the job's line: torch, the agent, inductor's code."""
        self._reset()

    def _reset(self) -> None:
        self._outputs: list[torch.Tensor] = []
        self._inputs: list[torch.Tensor | None] = []
        self._weights: list[torch.Tensor | None] = []
        self._sites: list[Site] = []
        self._missed = 0
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}

    # ----- the job's calls ---------------------------------------------------------------------

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if is_compiling():
            # Traced by torch.compile: only the call, so the graph is the job's own (anything
            # more here would break it and run the region eagerly, with other numerics).
            return func(*args, **kwargs)
        if self.watching and func in _BACKWARDS:
            self.watching = False  # the forward and loss are over: the rest is the update's
        result = func(*args, **kwargs)
        if self.watching:
            try:
                self._see(func, args, kwargs, result)
            except Exception:
                self.watching = False
                self.broken = True
        return result

    def _see(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], result: object
    ) -> None:
        outputs = _floating(result)
        if not outputs:
            return
        if len(self._outputs) >= MAX_OPS:
            self._missed += 1
            return
        frame, agent = job_line(sys._getframe(2), self._skipped)
        if frame is None or agent:
            return  # no job frame, or the agent's own call (a probe in a module hook)
        data: torch.Tensor | None = None
        weights: torch.Tensor | None = None
        written = {id(tensor) for tensor in outputs}  # an in-place call's input is its output
        for value in (*args, *kwargs.values()):
            for tensor in _floating(value):
                if id(tensor) in written:
                    continue
                flag = self._flag(tensor)
                if type(tensor) is Parameter:  # `_floating` keeps plain types only
                    weights = flag if weights is None else weights + flag.to(weights.device)
                else:
                    data = flag if data is None else data + flag.to(data.device)
        out = None
        for tensor in outputs:
            flag = self._flag(tensor)
            out = flag if out is None else out + flag.to(out.device)
        assert out is not None
        stack = self._stack
        self._outputs.append(out)
        self._inputs.append(data)
        self._weights.append(weights)
        module = stack[-1] if stack else None
        self._sites.append((func, frame.f_code.co_filename, frame.f_lineno, module))

    def _flag(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor's flag, probed once per step while nothing writes to it (a weakref and
        its version counter: a new tensor at a reused id, or one written in place, is probed
        anew)."""
        known = self._known.get(id(tensor))
        if known is not None and known[1] == tensor._version and known[0]() is tensor:
            return known[2]
        flag = _probe(tensor)
        self._known[id(tensor)] = (weakref.ref(tensor), tensor._version, flag)
        return flag

    # ----- the agent's calls -------------------------------------------------------------------

    def start(self) -> None:
        """A watched forward begins on the calling thread: push the mode (if not there)."""
        if self.broken:
            return
        self._skipped = _SKIPPED_DIRS + _generated_code()
        ident = get_ident()
        if self.pushed_on is None:
            # Marked before the push: a Ctrl-C raised as the push returns leaves a mode that
            # `take` still finds and pops.
            self.pushed_on = ident
            torch._C._push_on_torch_function_stack(self)
        if self.pushed_on == ident and self._on_top():
            self.watching = True

    def take(self) -> OpFlags | None:
        """At the close: the step's flags (None if none), the tables emptied, the mode popped
        if it is on top of this thread's stack (otherwise it stays, idle, until a later close)."""
        self.watching = False
        if self.pushed_on is None and not self._outputs and not self._missed:
            return None  # a step not watched (the default's healthy steps): nothing to do
        if self.pushed_on == get_ident() and self._on_top():
            torch._C._pop_torch_function_stack()
            self.pushed_on = None
        taken = None
        if self._outputs or self._missed:
            taken = OpFlags(self._outputs, self._inputs, self._weights, self._sites, self._missed)
        self._reset()
        return taken

    def _on_top(self) -> bool:
        depth = torch._C._len_torch_function_stack()
        return depth > 0 and torch._C._get_function_stack_at(depth - 1) is self


def wire_origin(origin: Origin, module: str | None) -> schema.NanOrigin:
    """The origin as an alert carries it (`module`: the name of `origin.module`)."""
    return schema.NanOrigin(
        op=origin.op,
        file=origin.file,
        line=origin.line,
        module=module,
        in_input=origin.in_input,
        in_weights=origin.in_weights,
    )


def unseen_words(missed: int) -> str:
    """What a loss alert says when no flagged call made the NaN/Inf but calls past the bound
    ran unflagged: the origin is not known (never a guess, never silence)."""
    return (
        f"the call that made the first NaN/Inf is not known (the step's first {MAX_OPS:,} "
        f"torch calls were watched and were finite; {missed:,} more ran unwatched)"
    )


def origin_site(origin: schema.NanOrigin) -> str:
    """`torch.log at train.py:42`: the call and the job's line that made it."""
    return f"{origin.op} at {os.path.basename(origin.file)}:{origin.line}"


def origin_words(origin: schema.NanOrigin) -> str:
    """What a loss alert says of its origin: the call and its line, and where it ran."""
    site = origin_site(origin)
    inside = f"in module {origin.module}" if origin.module is not None else "outside any module"
    if origin.in_weights and not origin.in_input:
        return f"the weights were already non-finite (first read by {site}, {inside})"
    if origin.in_input:
        return f"the NaN/Inf was already in the input batch (first read by {site}, {inside})"
    if origin.module is None:
        return f"{site} made the first NaN/Inf, in the loss ({inside})"
    return f"{site} made the first NaN/Inf, {inside}"


def poisoned_by(step: int) -> str:
    """What a step after the weights went non-finite says instead of an origin."""
    return f"the weights were poisoned by step {step}'s update"


def _generated_code() -> tuple[str, ...]:
    """The folder of the code torch.compile's inductor wrote, once it has compiled (its calls
    into torch run from there; the job's line is the one that called the compiled region)."""
    utils = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if utils is None:
        return ()
    try:
        folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or utils.default_cache_dir()
    except Exception:  # its own error: the generated files are then named as they are
        return ()
    return (os.path.abspath(folder) + os.sep,)
