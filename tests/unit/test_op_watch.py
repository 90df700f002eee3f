"""The op watch's pure parts: the job's line from frames, the origin from read flags, the words;
and the watch itself over a few torch calls of this process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from memtui_agent.steps import nan_origin
from memtui_agent.steps.health import HealthMonitor
from memtui_agent.steps.nan_origin import (
    OpWatch,
    first_origin,
    job_line,
    origin_words,
    poisoned_by,
    wire_origin,
)
from memtui_protocol import schema
from memtui_protocol.schema import AlertKind, NanCheck


def _frames(*files: str) -> Any:
    """A chain of stand-in frames, innermost first."""
    frame = None
    for number, file in reversed(list(enumerate(files, 1))):
        frame = SimpleNamespace(
            f_code=SimpleNamespace(co_filename=file), f_lineno=number, f_back=frame
        )
    return frame


def test_job_line_is_the_first_frame_outside_torch_and_the_agent() -> None:
    skipped = ("/t/torch/", "/a/memtui_agent/")
    frame, via_agent = job_line(
        _frames("/t/torch/nn/linear.py", "/job/train.py"), skipped, skipped[1]
    )
    assert frame is not None and frame.f_lineno == 2 and not via_agent
    frame, via_agent = job_line(
        _frames("/a/memtui_agent/steps/health.py", "/t/torch/module.py", "/job/model.py"),
        skipped,
        skipped[1],
    )
    assert frame is not None and frame.f_lineno == 3 and via_agent  # the agent's own probe
    assert job_line(_frames("/t/torch/a.py"), skipped, skipped[1]) == (None, False)


def test_first_origin_is_the_first_non_finite_output_in_call_order() -> None:
    sites = [(torch.exp, "a.py", 1, None), (torch.log, "a.py", 2, 7), (torch.sqrt, "a.py", 3, 8)]
    made = first_origin([1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], sites)
    assert made == nan_origin.Origin(op="torch.log", file="a.py", line=2, module=7)
    read = first_origin([0.0, 0.0, 0.0], [0.0, 1.0, 1.0], [1.0, 1.0, 1.0], sites)
    assert read is not None and read.op == "torch.exp" and read.in_input and not read.in_weights
    assert first_origin([1.0, 1.0, 1.0], [1.0] * 3, [1.0] * 3, sites) is None


def test_words_name_the_call_the_line_and_where_it_ran() -> None:
    made = nan_origin.Origin("torch.log", "/job/train.py", 42, None)
    assert origin_words(wire_origin(made, None)) == (
        "torch.log at train.py:42 made the first NaN/Inf, in the loss (outside any module)"
    )
    inside = nan_origin.Origin("torch.sqrt", "/job/m.py", 9, 3)
    assert origin_words(wire_origin(inside, "norm")).endswith("in module norm")
    batch = nan_origin.Origin("torch.nn.functional.linear", "/j/t.py", 5, 1, in_input=True)
    assert "already in the input batch" in origin_words(wire_origin(batch, "fc"))
    assert poisoned_by(31) == "the weights were poisoned by step 31's update"


def test_an_alert_without_origin_still_reads_and_one_with_it_round_trips() -> None:
    old = msgspec.msgpack.encode({"kind": "nonfinite_loss", "message": "the loss is NaN or Inf"})
    assert msgspec.msgpack.decode(old, type=schema.Alert).origin is None
    origin = schema.NanOrigin(op="torch.log", file="t.py", line=3, in_input=True)
    alert = schema.Alert(kind="nonfinite_loss", message="m", origin=origin)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(alert), type=schema.Alert) == alert


def _watched(watch: OpWatch, probs: torch.Tensor) -> torch.Tensor:
    watch.start()
    loss = -torch.log(probs).mean()  # the line the watch must name
    return loss


def test_the_watch_names_the_call_and_leaves_the_result_and_the_mode_stack_as_they_were() -> None:
    probs = torch.tensor([0.5, 0.0, 0.25])
    expected = -torch.log(probs).mean()
    depth = torch._C._len_torch_function_stack()
    watch = OpWatch([])
    loss = _watched(watch, probs)
    flags = watch.take()
    assert torch._C._len_torch_function_stack() == depth  # popped at the close
    assert torch.equal(loss, expected)
    assert flags is not None
    origin = flags.origin(flags.stacked(torch.device("cpu")).tolist())
    line = _watched.__code__.co_firstlineno + 2
    assert origin == nan_origin.Origin("torch.log", __file__, line, None)


def test_a_nan_already_in_the_input_is_said_so_and_modules_are_named_from_the_stack() -> None:
    watch = OpWatch([5])
    batch = torch.tensor([[1.0, float("nan")]])
    watch.start()
    torch.nn.functional.linear(batch, torch.ones(3, 2))
    flags = watch.take()
    assert flags is not None
    origin = flags.origin(flags.stacked(torch.device("cpu")).tolist())
    assert origin is not None and origin.in_input and origin.module == 5
    assert origin.op == "torch.nn.functional.linear"


def test_the_watch_stops_at_the_backward_and_flags_at_most_max_ops_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nan_origin, "MAX_OPS", 3)
    weight = torch.ones(2, requires_grad=True)
    watch = OpWatch([])
    watch.start()
    x = weight * 2.0
    for _ in range(4):
        x = x + 1.0
    x.sum().backward()
    after = weight * float("inf")  # after the backward: the update's, not the forward's
    flags = watch.take()
    assert flags is not None and len(flags.sites) == 3 and flags.missed == 3
    assert flags.origin(flags.stacked(torch.device("cpu")).tolist()) is None
    assert weight.grad is not None and torch.equal(weight.grad, torch.full((2,), 2.0))
    assert not torch.isfinite(after).all()


def test_the_mode_stays_idle_under_a_mode_pushed_above_it() -> None:
    watch = OpWatch([])
    watch.start()
    with torch.overrides.TorchFunctionMode():
        assert watch.take() is None  # not on top: left in place, idle
        assert watch.pushed_on is not None
    assert watch.take() is None and watch.pushed_on is None


class _Counted(torch.Tensor):
    """A job's tensor subclass: its `__torch_function__` is the job's code."""

    calls = 0

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        _Counted.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]


def test_the_watch_runs_no_subclass_code_and_skips_meta_tensors() -> None:
    x = torch.ones(3).as_subclass(_Counted)
    _Counted.calls = 0
    x * 2.0
    alone = _Counted.calls
    watch = OpWatch([])
    watch.start()
    _Counted.calls = 0
    x * 2.0
    torch.ones(3, device="meta") * 2.0
    watched = _Counted.calls
    assert watch.take() is None  # neither a subclass's output nor a meta one is flagged
    assert watched == alone


def test_an_origin_past_the_bound_is_said_to_be_not_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A NaN made after the last flagged call: the loss alert says its origin is not known
    (it said only "the loss is NaN or Inf", as if nothing had been watched)."""
    monkeypatch.setattr(nan_origin, "MAX_OPS", 3)
    monitor = HealthMonitor(NanCheck.FULL)
    weight = torch.nn.Parameter(torch.ones(2))
    monitor.forward_starts()
    x = weight * 2.0
    for _ in range(3):
        x = x + 1.0
    loss = torch.log(x - x).sum()  # -inf, made by the 5th and 6th calls: past the bound
    loss.backward()
    assert weight.grad is not None
    grads = [weight.grad]
    alerts = monitor.close(1, grads, [loss.detach()], lambda: [("w", weight)], False, str)
    [loss_alert] = [a for a in alerts if a.kind == AlertKind.NONFINITE_LOSS]
    assert loss_alert.origin is None
    assert "is not known (the step's first 3 torch calls were watched" in loss_alert.message
