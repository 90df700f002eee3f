"""Numerical health: non-finite losses, gradients and activations, found cheaply and exactly.

Healthy steps pay one fused check at step close: `torch._amp_foreach_non_finite_check_and_unscale_`
with a scale of one over every gradient (per device and dtype, as GradScaler groups them), plus a
finiteness check of the step's losses, read back with a single device-to-host transfer. These are
exact: norm-based checks overflow on large finite values (1e25 in fp32, 6e4 in fp16) and raise
false alarms.

Finding the origin costs more, so it is paid only when needed:

- On an alarm, which parameters have non-finite gradients is worked out at once (names in the
  alert's `where`), and whether the update left the weights themselves non-finite.
- Per-module output checks (one min/max reduction per module output and input, kept on the
  device and read at step close with the same single transfer)
  are armed for the next `ARMED_STEPS` steps after an alarm, or for every step in `full` mode. The
  first module in execution order whose output is non-finite while its inputs are finite is the
  origin (`nonfinite_activation`).

Trade-off: in the default mode a non-finite forward that happens once is reported (loss and
gradient alerts with parameter names) but its module is named only if it recurs while armed;
`full` mode names it the first time, at the price of a reduction over each module's inputs and
outputs.

Once the weights are non-finite every later step is non-finite too; those alerts carry `group`
(the step of the first alert) so they are shown under it instead of burying it.

The same pass reads the global gradient norm (`grad_norm`) and the step's mean loss, and the
divergence watch (`divergence`) reads both in step order: a divergence is said while the values
are finite, and the non-finite alerts that follow it name the step it began.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Sequence

import torch

from memtui_agent.memory.ledger import local_tensor
from memtui_agent.steps.divergence import DivergenceWatch
from memtui_agent.steps.grad_norm import group_norm
from memtui_agent.steps.nan_origin import (
    OpFlags,
    OpWatch,
    Origin,
    origin_site,
    origin_words,
    poisoned_by,
    unseen_words,
    wire_origin,
)
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, NanCheck

ARMED_STEPS = 20
MAX_NAMES = 5
DEFERRED_DEVICES = frozenset({"cuda"})
"""Devices whose check results are read late: reading them at the close would wait for the
device (a host sync the agent must not add). Tests swap in a stand-in device here."""
MAX_DEFERRED = 8
"""Checks waiting for their copy; past that the oldest is read with a wait (the device is
that many steps behind the host, so the wait costs the job nothing it was not waiting for)."""


def make_event(device: torch.device) -> torch.cuda.Event:
    """An event recorded behind the copies queued on `device`'s current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class _Deferred:
    """One step's check results on their way to the host (pinned copy behind an event)."""

    __slots__ = ("event", "host", "module_ids", "ops", "skipped", "step")

    def __init__(
        self,
        step: int,
        checks: torch.Tensor,
        skipped: bool,
        module_ids: list[int],
        ops: OpFlags | None,
    ) -> None:
        self.step = step
        self.skipped = skipped
        self.module_ids = module_ids
        self.ops = ops
        self.host = checks.to("cpu", non_blocking=True)
        self.event = make_event(checks.device)


def _floating(value: object) -> list[torch.Tensor]:
    """Floating-point tensors at the first level of a module's input or output."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor) and v.is_floating_point()]
    return []


_FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")


Groups = dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]
"""Tensors by (device, dtype), as the foreach kernels take them."""
ModuleFlag = tuple[int, torch.Tensor, "torch.Tensor | None"]
"""(module id, output flag, input flag or None): one module call's device flags."""
AnyModuleFlag = tuple[int, "torch.Tensor | None", "torch.Tensor | None"]
"""A `ModuleFlag`, or a deferred step's (module id, None, None): its flags were read already."""

_ones: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """A cached `[1.0]` on `device`: the fused check's inverse scale, read-only."""
    one = _ones.get(device)
    if one is None:
        one = _ones[device] = torch.ones(1, device=device)
    return one


def _checkable(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients the fused check can read: strided floating-point local tensors (a DTensor
    op here would be a collective in the job, so its local shard is checked). The common case,
    plain tensors of usual float dtypes, is recognised in C without a loop per gradient."""
    plain = torch.Tensor
    if (
        set(map(type, grads)) <= {plain}
        and set(map(_LAYOUT, grads)) <= {torch.strided}
        and set(map(_DTYPE, grads)) <= _FLOATING
    ):
        return grads
    local = map(local_tensor, grads)
    return [g for g in local if g.layout is torch.strided and g.is_floating_point()]


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> Groups:
    """Group tensors as the foreach kernels need them, in C++ (as torch's optimizers do)."""
    if not tensors:
        return {}
    kinds = set(map(_DTYPE, tensors))
    places = set(map(_DEVICE, tensors))
    if len(kinds) == 1 and len(places) == 1:
        return {(places.pop(), kinds.pop()): tensors}  # one group: nothing to sort
    # torch's stub allows None entries, which `tensors` never holds.
    grouped = torch._C._group_tensors_by_device_and_dtype([tensors], False)  # type: ignore[list-item]
    return {key: lists[0] for key, (lists, _) in grouped.items()}  # type: ignore[misc]


def _stacked(flags: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One tensor of 0-dim flags on `device` (moved one by one only when devices differ)."""
    try:
        return torch.stack(flags).to(device)
    except RuntimeError:  # flags on several devices (a model split across GPUs)
        return torch.stack([flag.to(device) for flag in flags])


def _probe(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A 0-dim float32 device tensor that is non-finite iff some element is (no host sync).

    One reduction per tensor, its lowest and highest value (`aminmax`, which propagates NaN and
    keeps an Inf): `low - low + high - high` is 0 when both are finite and NaN otherwise, so
    large finite values never read as non-finite (a float32 sum overflowed past 3.4e38: a batch
    of finite values near 1e38 was reported as already non-finite). Cheaper than
    `isfinite().all()`, which writes a full-size boolean tensor first, and no slower than a sum
    (5.7 ms against 8.8 ms over 4M float32 on a CPU).
    """
    probe = None
    for tensor in tensors:
        tensor = local_tensor(tensor)
        if not tensor.numel():
            continue
        low, high = torch.aminmax(tensor.detach())
        total = (low - low + high - high).to(torch.float32)
        probe = total if probe is None else probe + total.to(probe.device)
    return probe


def _non_finite_flag(members: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`[1.0]` on `device` if some element of `members` (one device, one dtype) is not finite,
    else `[0.0]`: the fused check with a scale of one, which leaves the values as they are."""
    found = torch.zeros(1, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(members, found, _one(device))
    return found


def _on_host(groups: Groups, losses: list[torch.Tensor]) -> bool:
    """Whether every gradient and loss can be read at once (no device to wait for)."""
    return all(device.type not in DEFERRED_DEVICES for device, _ in groups) and all(
        loss.device.type not in DEFERRED_DEVICES for loss in losses
    )


def _host_checks(groups: Groups, losses: list[torch.Tensor], whole: bool) -> list[float]:
    """`[grads non-finite, losses non-finite, gradient norm, mean loss]` for host tensors, read
    directly (NaN for a value not known). The norm's pass proves a group finite; the exact
    check runs only for a group whose norm is not (`grad_norm`). Without the small tensor ops
    that gather results on a device (a dozen ops, tens of microseconds each on a CPU).
    `whole`: the gradients are the job's own, not a rank's shards (else no norm)."""
    grads_bad = 0.0
    squares = 0.0
    for (device, _dtype), members in groups.items():
        norm = group_norm(members, device).item() if whole else math.nan
        if math.isfinite(norm):
            squares += norm * norm
            continue
        squares = math.nan
        grads_bad = max(grads_bad, _non_finite_flag(members, device).item())
    values = [loss.item() for loss in losses]
    loss_bad = not all(math.isfinite(value) for value in values)
    mean = sum(values) / len(values) if values else math.nan
    return [grads_bad, float(loss_bad), math.sqrt(squares) if groups else math.nan, mean]


class HealthMonitor:
    """Per-step finiteness state: armed module checks, and when the weights went bad."""

    def __init__(
        self, mode: schema.NanCheck = schema.NanCheck.DEFAULT, stack: list[int] | None = None
    ) -> None:
        """`stack`: the module stack the counting hooks keep (the op watch names the module
        running each call from it)."""
        self.mode = mode
        self.ops = OpWatch(stack if stack is not None else [])
        """Which torch call made the first NaN/Inf, on the steps whose modules are watched."""
        self.armed_until = 0
        self.weights_bad_since: int | None = None
        self._module_flags: list[ModuleFlag] = []
        self._probed: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
        """id(output) -> (weakref, version, flag) for this step's single-tensor outputs."""
        self._deferred: list[_Deferred] = []
        self.divergence = DivergenceWatch()
        self.sharded = False
        """Set while FSDP shards the gradients (`parts`): a rank's shard has no global norm."""
        self._optimizers: dict[int, str | None] = {}
        """The optimizer that closed each step not judged yet (the divergence watch's key)."""
        self.judged_norm: float | None = None
        """The global gradient norm of the step the last `close` judged on the host (None when
        not known, or when its check was deferred: `collect` gives it then)."""

    def watching_modules(self, step: int) -> bool:
        """Whether module outputs are checked during this step."""
        mode = self.mode
        return mode is NanCheck.FULL or (mode is NanCheck.DEFAULT and step <= self.armed_until)

    def forward_starts(self) -> None:
        """A root module's forward starts on a watched step: watch its torch calls (and the
        loss's, until the backward) from here (`nan_origin`)."""
        self.ops.start()

    def module_output(self, module_id: int, args: object, output: object) -> None:
        """Record device flags for one module call (inputs finite, output finite)."""
        outputs = _floating(output)
        out_flag = _probe(outputs)
        if out_flag is None:
            return
        self._module_flags.append((module_id, out_flag, self._input_probe(_floating(args))))
        if len(outputs) == 1:
            tensor = outputs[0]
            self._probed[id(tensor)] = (weakref.ref(tensor), tensor._version, out_flag)

    def _input_probe(self, inputs: list[torch.Tensor]) -> torch.Tensor | None:
        """The input flag, reusing an earlier module's output flag for the same tensor.

        Most inputs are the previous module's output, already reduced once. The flag is reused
        only for that very tensor (a weakref, so an id reused by a new tensor never matches)
        and only if nothing wrote to it since (its version counter is unchanged).
        """
        if len(inputs) == 1:
            tensor = inputs[0]
            known = self._probed.get(id(tensor))
            if known is not None and known[1] == tensor._version and known[0]() is tensor:
                return known[2]
        return _probe(inputs)

    def close(
        self,
        step: int,
        grads: list[torch.Tensor],
        losses: list[torch.Tensor],
        named: Callable[[], list[tuple[str, torch.Tensor]]],
        skipped: bool,
        module_name: Callable[[int], str],
        groups: Groups | None = None,
        optimizer: str | None = None,
    ) -> list[schema.Alert]:
        """Check the step; return its alerts. One host transfer when healthy.

        `groups`: `grads` already grouped by (device, dtype) as plain strided tensors
        (`gradient_batch`), or None to group them here. `optimizer`: the name of the one whose
        step this is (each optimizer's losses are compared with its own)."""
        module_flags, self._module_flags = self._module_flags, []
        self._probed.clear()
        ops = self.ops.take()
        self.judged_norm = None
        if self.mode is NanCheck.OFF or (not grads and not losses and not module_flags):
            return []
        whole = not self.sharded
        if len(self._optimizers) > 4 * MAX_DEFERRED:  # a check lost on the way: forget it
            self._optimizers.clear()
        self._optimizers[step] = optimizer
        if groups is None or not {dtype for _, dtype in groups} <= _FLOATING:
            checkable = _checkable(grads)
            whole = whole and checkable is grads  # else some are shards: no global norm
            groups = _by_device_and_dtype(checkable)
        if not module_flags and not ops and _on_host(groups, losses):
            values = _host_checks(groups, losses, whole)
            return self._judge(step, values, named, skipped, module_flags, module_name)
        checks = self._device_checks(groups, losses, module_flags, whole)
        if checks is None:
            return []
        if ops:  # the op watch's flags ride at the end of the same transfer
            checks = torch.cat([checks, ops.stacked(checks.device)])
        if checks.device.type in DEFERRED_DEVICES:
            ids = [module_id for module_id, _, _ in module_flags]
            self._deferred.append(_Deferred(step, checks, skipped, ids, ops))
            return []
        values = checks.tolist()  # on the host already: no device to wait for
        return self._judge(step, values, named, skipped, module_flags, module_name, ops)

    def collect(
        self,
        named: Callable[[], list[tuple[str, torch.Tensor]]],
        module_name: Callable[[int], str],
        wait: bool = False,
    ) -> list[tuple[int, list[schema.Alert], float | None]]:
        """Alerts and gradient norms of earlier steps whose deferred checks have reached the
        host, with their step; `wait` (at the end of the job) waits for the rest. Parameters
        are named from their state now, since the step that went bad has returned to the
        job."""
        found: list[tuple[int, list[schema.Alert], float | None]] = []
        while self._deferred:
            deferred = self._deferred[0]
            late = len(self._deferred) > MAX_DEFERRED
            if not deferred.event.query():
                if not (wait or late):
                    break
                deferred.event.synchronize()
            self._deferred.pop(0)
            flags = [(module_id, None, None) for module_id in deferred.module_ids]
            values = deferred.host.tolist()  # landed: reading pinned memory waits for nothing
            alerts = self._judge(
                deferred.step, values, named, deferred.skipped, flags, module_name, deferred.ops
            )
            if alerts or self.judged_norm is not None:
                found.append((deferred.step, alerts, self.judged_norm))
            self.judged_norm = None
        return found

    def _judge(
        self,
        step: int,
        values: list[float],
        named: Callable[[], list[tuple[str, torch.Tensor]]],
        skipped: bool,
        module_flags: Sequence[AnyModuleFlag],
        module_name: Callable[[int], str],
        ops: OpFlags | None = None,
    ) -> list[schema.Alert]:
        """The alerts that one step's check values call for (none when healthy); the op
        watch's values, if any, are the last `len(ops)`."""
        origin = None
        if ops:
            origin = ops.origin(values[len(values) - len(ops) :])
            values = values[: len(values) - len(ops)]
        grads_bad, loss_bad = values[0] > 0, values[1] > 0
        count = len(module_flags)
        module_ok = values[2 : 2 + count]
        inputs_ok = values[2 + count : 2 + 2 * count]
        norm, loss = values[2 + 2 * count : 4 + 2 * count]
        self.judged_norm = norm if math.isfinite(norm) else None
        diverging = self.divergence.read(
            step, loss, None if skipped else self.judged_norm, self._optimizers.pop(step, None)
        )
        first = [diverging] if diverging is not None else []
        if not grads_bad and not loss_bad and all(module_ok):
            return first
        return first + self._alerts(
            step,
            named(),
            skipped,
            (loss_bad, grads_bad),
            module_flags,
            (module_ok, inputs_ok),
            module_name,
            origin,
            ops.missed if ops else 0,
        )

    def _device_checks(
        self,
        groups: Groups,
        losses: list[torch.Tensor],
        module_flags: list[ModuleFlag],
        whole: bool,
    ) -> torch.Tensor | None:
        """[grads non-finite, losses non-finite, module outputs finite..., inputs finite...,
        gradient norm, mean loss] (NaN for a value not known)."""
        device = None
        grads_bad = None
        norms = []
        for (grad_device, _dtype), members in groups.items():
            found = _non_finite_flag(members, grad_device)
            device = device or grad_device
            if whole:
                norms.append(group_norm(members, grad_device).to(device))
            found = found.to(device)
            grads_bad = found if grads_bad is None else grads_bad + found
        loss_bad = mean = None
        if losses:
            device = device or losses[0].device
            if len(losses) == 1 and losses[0].device == device:
                flat = losses[0].detach().reshape(1).float()
            else:
                flat = torch.stack(
                    [loss.detach().float().reshape(()).to(device) for loss in losses]
                )
            loss_bad = (~torch.isfinite(flat)).any().float().reshape(1)
            mean = flat.mean().reshape(1)
        if device is None and module_flags:
            device = module_flags[0][1].device
        if device is None:
            return None
        zero = torch.zeros(1, device=device)
        parts = [
            grads_bad if grads_bad is not None else zero,
            loss_bad if loss_bad is not None else zero,
        ]
        if module_flags:
            finite = torch.zeros((), device=device)
            outputs = _stacked([flag for _, flag, _ in module_flags], device)
            inputs = _stacked([f if f is not None else finite for _, _, f in module_flags], device)
            parts.append(torch.isfinite(outputs))
            parts.append(torch.isfinite(inputs))
        unknown = torch.full((1,), math.nan, device=device)
        if norms and len(norms) == len(groups):
            parts.append(torch.linalg.vector_norm(torch.stack(norms).float()))
        else:
            parts.append(unknown)
        parts.append(mean.to(device) if mean is not None else unknown)
        return torch.cat([p.reshape(-1).float() for p in parts])

    def _alerts(
        self,
        step: int,
        parameters: list[tuple[str, torch.Tensor]],
        skipped: bool,
        bad: tuple[bool, bool],
        module_flags: Sequence[AnyModuleFlag],
        module_checks: tuple[list[float], list[float]],
        module_name: Callable[[int], str],
        origin: Origin | None = None,
        missed: int = 0,
    ) -> list[schema.Alert]:
        """`missed`: the watched step's calls past the op watch's bound (its origin, if none
        was found among the flagged ones, is not known)."""
        loss_bad, grads_bad = bad
        module_ok, inputs_ok = module_checks
        grouped = self.weights_bad_since
        alerts: list[schema.Alert] = []
        if self.mode is NanCheck.DEFAULT and not skipped:
            self.armed_until = step + ARMED_STEPS
        found = None
        if origin is not None and grouped is None:
            module = module_name(origin.module) if origin.module is not None else None
            found = wire_origin(origin, module)
        for index, ok in enumerate(module_ok):
            if grouped is not None:
                break  # poisoned weights: no module is the origin (`poisoned_by`)
            if not ok:
                module_id = module_flags[index][0]
                where = module_name(module_id)
                if inputs_ok[index]:
                    message = f"output of {where} turned non-finite from finite inputs"
                else:
                    message = f"input of {where} was already non-finite (bad data or upstream)"
                if found is not None and found.module is not None:
                    message += f": {origin_site(found)}"
                alerts.append(
                    self._alert(AlertKind.NONFINITE_ACTIVATION, message, where, grouped, found)
                )
                break
        if loss_bad:
            message = "the loss is NaN or Inf"
            if found is not None:
                message += ": " + origin_words(found)
            elif missed and grouped is None:
                message += ": " + unseen_words(missed)
            alerts.append(self._alert(AlertKind.NONFINITE_LOSS, message, None, grouped, found))
        if grads_bad and not skipped:
            names = self._nonfinite_names([(name, p.grad) for name, p in parameters])
            shown = ", ".join(names[:MAX_NAMES])
            more = f" and {len(names) - MAX_NAMES} more" if len(names) > MAX_NAMES else ""
            message = f"{len(names)} parameter gradient(s) are NaN or Inf"
            if not loss_bad:
                message += " under a finite loss"
            alerts.append(self._alert(AlertKind.NONFINITE_GRADIENT, message, shown + more, grouped))
        if self.weights_bad_since is None and not skipped:
            bad_weights = self._nonfinite_names(parameters)
            if bad_weights:
                self.weights_bad_since = step
        return alerts

    def _alert(
        self,
        kind: AlertKind,
        message: str,
        where: str | None,
        group: int | None,
        origin: schema.NanOrigin | None = None,
    ) -> schema.Alert:
        if group is not None:
            message += f" ({poisoned_by(group)})"
        after = self.divergence.after()
        if after is not None:
            message += f" ({after})"
        return schema.Alert(
            kind=kind,
            message=message,
            where=where,
            group=group,
            origin=origin,
            began=self.divergence.began,
        )

    @staticmethod
    def _nonfinite_names(named: Sequence[tuple[str, torch.Tensor | None]]) -> list[str]:
        """Names of tensors holding NaN/Inf (alarm path only: one transfer for all of them)."""
        local = [(n, local_tensor(t)) for n, t in named if t is not None]
        local = [(n, t) for n, t in local if t.is_floating_point() and t.numel()]
        if not local:
            return []
        # detach(): an op on a parameter that requires grad would make an autograd node, which
        # the next repeat proof counts as a change in the job (a false `activations_vary`).
        finite = [torch.isfinite(t.detach()).all() for _, t in local]
        device = finite[0].device
        flags = torch.stack([flag.to(device) for flag in finite]).tolist()
        return [name for (name, _), ok in zip(local, flags, strict=True) if not ok]
