"""What making the root hooks copy-safe costs per call (`agent/memtui_agent/hooks/copy_safe.py`).

    python benchmarks/copy_safe_hooks.py            # a few seconds

Each root module carries the agent's forward pre-hook and forward hook, called once per
top-level forward each. They were bound methods; they are now `CopySafeHook`s (a
`functools.partial` subclass around the bound method, so that `copy.deepcopy` and `pickle` get
an inert stand-in). This times, interleaved in one process, with a hook body that returns at
once (so only the call is measured):
- "call": the hook called as torch calls it, `hook(module, args, kwargs)`, per call;
- "forward": a `Linear(4, 4)` root called with the pre/post pair registered, per forward;
for the bound method (before), `CopySafeHook` (now) and a Python class whose `__call__`
forwards (the alternative not taken), as the fastest of the rounds in nanoseconds (the least
disturbed by other work on the machine). Then the same
root forward with the agent's real hooks (its parts installed, a few steps trained, default
options), registered as `CopySafeHook`s and, swapped in their place, as the bound methods.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from memtui_agent.hooks.copy_safe import COPIED_HOOK_EVENT, CopySafeHook
from memtui_agent.startup.parts import build_parts
from memtui_protocol.config import AgentConfig


class Body:
    """Hooks whose bodies return at once."""

    def pre(self, module: object, args: object, kwargs: object = None) -> None:
        return None

    def post(self, module: object, args: object, output: object) -> None:
        return None


class Forwarding:
    """A Python `__call__` that forwards: the other way to a copy-safe hook."""

    __slots__ = ("_call",)

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial, (sys.audit, COPIED_HOOK_EVENT))


KINDS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "bound method": lambda hook: hook,
    "CopySafeHook": CopySafeHook,
    "Python __call__": Forwarding,
}


def per_call(hook: Callable[..., Any], calls: int) -> float:
    module, args, kwargs = object(), (1,), dict[str, object]()
    start = time.perf_counter_ns()
    for _ in range(calls):
        hook(module, args, kwargs)
    return (time.perf_counter_ns() - start) / calls


def per_forward(model: torch.nn.Module, calls: int) -> float:
    x = torch.randn(2, 4)
    with torch.no_grad():
        start = time.perf_counter_ns()
        for _ in range(calls):
            model(x)
        return (time.perf_counter_ns() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20_000)
    options = parser.parse_args()
    torch.set_num_threads(1)
    body = Body()
    models = {}
    for name, make in KINDS.items():
        model = torch.nn.Linear(4, 4)
        model.register_forward_pre_hook(make(body.pre), with_kwargs=True)
        model.register_forward_hook(make(body.post), always_call=True)
        models[name] = model
    calls: dict[str, list[float]] = {name: [] for name in KINDS}
    forwards: dict[str, list[float]] = {name: [] for name in KINDS}
    for _ in range(options.rounds):
        for name, make in KINDS.items():
            calls[name].append(per_call(make(body.pre), options.calls))
            forwards[name].append(per_forward(models[name], options.calls // 10))
    print(f"{'hook':<16} {'ns per call':>12} {'ns per forward':>15}")
    for name in KINDS:
        call, forward = min(calls[name]), min(forwards[name])
        print(f"{name:<16} {call:>12.0f} {forward:>15.0f}")
    in_the_agent(options.rounds, options.calls // 10)


def in_the_agent(rounds: int, calls: int) -> None:
    """Per root forward with the agent's own hooks, registered both ways, interleaved."""
    parts = build_parts(AgentConfig(), lambda item: None, lambda *said: None)
    parts.install()
    try:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            optimizer.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
        dicts = (model._forward_pre_hooks, model._forward_hooks)
        ours: dict[int, Any] = {key: hook for hooks in dicts for key, hook in hooks.items()}
        assert all(type(hook) is CopySafeHook for hook in ours.values())
        bound = {key: hook.func for key, hook in ours.items()}
        times: dict[str, list[float]] = {"bound method": [], "CopySafeHook": []}
        for _ in range(rounds):
            for name, registered in (("bound method", bound), ("CopySafeHook", ours)):
                for hooks in dicts:
                    hooks.update({key: registered[key] for key in hooks})
                times[name].append(per_forward(model, calls))
    finally:
        parts.remove()
    print(f"{'agent root hooks':<16} {'ns per forward':>15}")
    for name, values in times.items():
        print(f"{name:<16} {min(values):>15.0f}")


if __name__ == "__main__":
    main()
