"""The hooks' on/off switch: one shared object, one flag per kind of hook.

Each kind of hook turns itself off when it raises (`HookSwitches.disable`), said once through
the agent's `report_failure`; the others go on. Every hook reads the same object, handed to it
once (`hooks.context.HookContext`), instead of a flag table and a disable function threaded
through each constructor. A dict underneath: the hottest hooks read a flag with one C-level
lookup (`switches["pack"]`), as before.
"""

from __future__ import annotations

from typing import Protocol


class Fail(Protocol):
    """How a part of the agent reports its error once (the agent's `report_failure`)."""

    def __call__(self, component: str, exc: BaseException, effect: str = ..., /) -> None: ...


HOOK_KINDS = ("modules", "pack", "grads", "steps", "loss", "scaler", "distributed", "activations")
"""The parts of the hooks that turn themselves off one by one when they raise."""


class HookSwitches(dict[str, bool]):
    """kind -> whether that kind of hook still runs (all on at first)."""

    def __init__(self, fail: Fail) -> None:
        super().__init__(dict.fromkeys(HOOK_KINDS, True))
        self._fail = fail

    def disable(self, kind: str, exc: BaseException) -> None:
        """`kind` raised `exc`: it is off for the rest of the run, said once (`hook:<kind>`)."""
        self[kind] = False
        self._fail(f"hook:{kind}", exc)

    def all_off(self) -> None:
        """Every hook off, said by the caller (a forked child, a half-done thread move)."""
        for kind in self:
            self[kind] = False
