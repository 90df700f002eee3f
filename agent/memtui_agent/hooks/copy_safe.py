"""What the agent leaves on the job's objects survives `copy.deepcopy` and `pickle`.

A hook registered on one of the job's objects is part of that object: `copy.deepcopy(model)`
(`torch.optim.swa_utils.AveragedModel`, an EMA teacher, a best-model snapshot) and
`torch.save(model)` copy a module's hook dicts with everything in them. A bound method of the
agent's hooks reaches the agent's thread state and its locks, so the copy raised `TypeError:
cannot pickle '_thread.RLock' object` in the job, and a pickle that worked would have carried
`memtui_agent` into a file the job loads where memtui is not installed.

So each hook registered on a job's object is a `CopySafeHook`: it calls the agent's hook while
it is the original, and copies and pickles as `INERT_HOOK`'s shape, `functools.partial(
sys.audit, COPIED_HOOK_EVENT)`, made only of the standard library:

- `sys.audit(event, *args)` takes any arguments and returns None, so a copied forward pre-hook
  (with keyword arguments or not) or forward hook changes nothing in the copy's call; it is a C
  function, cheap, and pickles by reference to `sys.audit`, which every Python the project
  supports has. An audit hook the job installs sees the event `memtui.copied_hook` at each call
  of a copy (nothing else does).
- the copy is not the agent's: no `memtui_agent` object, so the agent never takes a copy for the
  original (a copy the job calls is a new root, hooked by the agent when it finds it), and
  `torch.load(..., weights_only=False)` reads the file in an interpreter without memtui.

A subclass of `functools.partial` rather than a Python `__call__`: the call stays in C (one
extra C call, no Python frame; `benchmarks/copy_safe_hooks.py` measures both).

Functions the agent swaps in for torch's (`tracker.Tracker._wrap`, `startup.joining`) are the
other things of the agent a job can copy or pickle: a function pickles by its module and
qualified name, so `stand_in_for` gives a wrapper the original's names and `homes` says every
place it must be installed for pickle to find the wrapper under those names (the module that
defines the function, not only the one the job imports it from).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

COPIED_HOOK_EVENT = "memtui.copied_hook"
"""The audit event a copied hook raises when the copy is called (`sys.audit`)."""

_NAMES = ("__name__", "__qualname__", "__doc__", "__module__")
"""What a wrapper takes from the function it stands in for (pickle looks up the first two)."""


def inert_hook() -> functools.partial[None]:
    """The stand-in a copy of one of the agent's hooks becomes: standard library only."""
    return functools.partial(sys.audit, COPIED_HOOK_EVENT)


class CopySafeHook(functools.partial):  # type: ignore[type-arg]
    """One of the agent's hooks on a job's object; copied or pickled, an inert stand-in.

    `CopySafeHook(bound_method)` calls `bound_method` with the arguments torch passes. Its
    `__reduce__` is what both `copy.deepcopy` (through `__reduce_ex__`) and `pickle` use, so
    neither ever reaches the bound method's object.
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return (functools.partial, (sys.audit, COPIED_HOOK_EVENT))


def stand_in_for(wrapper: Any, original: Callable[..., Any]) -> None:
    """Give `wrapper` the names of `original` (and `__wrapped__`), so that pickle and copy,
    which save a function by its module and qualified name, save the wrapper as a reference to
    the original's place: the same bytes as without the agent, loadable without it."""
    wrapper.__wrapped__ = original
    for attribute in _NAMES:
        try:
            setattr(wrapper, attribute, getattr(original, attribute))
        except (AttributeError, TypeError):
            pass


def homes(owner: ModuleType | type, name: str) -> list[tuple[ModuleType | type, str]]:
    """Where a wrapper of `owner.name` must be installed: there, and where the original is
    defined when that is another module holding the same function (`torch.nn.utils` imports
    `clip_grad_norm_` from `torch.nn.utils.clip_grad`). Pickle looks a function up in the module
    its `__module__` names and refuses one not found there; installed in both, the wrapper is
    found, and a job importing from the defining module is wrapped too."""
    places: list[tuple[ModuleType | type, str]] = [(owner, name)]
    original = getattr(owner, name)
    if not isinstance(owner, ModuleType):
        return places  # a method: pickle finds it through its class, which is `owner`
    module = sys.modules.get(getattr(original, "__module__", None) or "")
    qualname = getattr(original, "__qualname__", None)
    if module is None or module is owner or not isinstance(qualname, str) or "." in qualname:
        return places
    if module.__dict__.get(qualname) is original:
        places.append((module, qualname))
    return places
