"""A global forward pre-hook installed only between top-level forwards: new models are found
whether the costly hooks are armed or not.

A model the job starts calling after its first steps (a teacher, a frozen encoder, an EMA copy
such as `torch.optim.swa_utils.AveragedModel`) holds weights from its first call on. The global
module hooks (`counting`) register such a tree, but they are installed only on measured steps
(`--activations auto`) and never after the first step under `off`: a model first called on an
unmeasured step was in no pile. Keeping a global hook on every module call costs every forward
of every model; this one is installed only while no known root's forward runs
(`root_calls.RootHooks` takes it out as a root's forward starts and puts it back as the
outermost one returns), so it sees only the modules the job calls outside its known models: a
loss module, and a new model's first call, which registers that model as a root (its own root
hooks from then on). A few microseconds a step; none inside the models' forwards.

A module first called inside a known root's forward while the hooks are disarmed is not seen
here (a tree walk finds it only if it is attached to that root).

A root's first call is found here, from torch's copy of the global pre-hooks taken before any
ran, so the root's own pre-hook (which takes this one out) is not among them: the scout leaves
by itself then, and the root's post-hook, which torch reads after the forward, puts it back. A
`torch.compile`d root would otherwise run its first forward with one global hook more than
every later one, and dynamo, whose guards read them, would compile it twice.
"""

from __future__ import annotations

from collections.abc import Callable
from threading import get_ident
from typing import TYPE_CHECKING

import torch
from torch._C import _current_graph_task_id
from torch.compiler import is_compiling

from memtui_agent.hooks.context import HookContext

if TYPE_CHECKING:  # for annotations only
    from torch.utils.hooks import RemovableHandle


def _unbound() -> None:
    raise RuntimeError("ModuleScout used before bind()")


class ModuleScout:
    """The between-roots pre-hook of one tracker, and its handle."""

    def __init__(self, context: HookContext) -> None:
        """`found` (what registers and counts a new tree) comes with `bind`: the object sync
        that does it is built after the root hooks, which switch this scout."""
        self._registry = context.registry
        self._thread = context.thread
        self._enabled = context.switches
        self._disable = context.switches.disable
        self._found: Callable[[], None] = _unbound
        self._hooked_root: Callable[[torch.nn.Module], bool] = lambda _module: False
        self._handle: RemovableHandle | None = None

    def bind(
        self, found: Callable[[], None], hooked_root: Callable[[torch.nn.Module], bool]
    ) -> None:
        """`found` registers, hooks and counts what appeared (`ObjectSync.sync_objects`);
        `hooked_root` says whether a module carries the root hooks (`RootHooks.hooks`), whose
        post-hook puts this one back when the root's forward returns."""
        self._found = found
        self._hooked_root = hooked_root

    @property
    def installed(self) -> bool:
        """Whether the hook is in torch's global pre-hooks now."""
        return self._handle is not None

    def on(self) -> None:
        """Install the hook (no known root's forward runs now)."""
        if self._handle is None and self._enabled["modules"]:
            self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre)

    def off(self) -> None:
        """Remove the hook (a known root's forward starts, or the agent leaves)."""
        handle = self._handle
        if handle is not None:
            self._handle = None
            handle.remove()

    def _pre(self, module: torch.nn.Module, args: tuple[object, ...]) -> None:
        """A module called outside the known roots' forwards: registered if it is a new tree
        (`ModuleRegistry.lookup`), its weights counted at once (`found`). `args` are the job's
        inputs, never looked into."""
        if is_compiling() or get_ident() != self._thread.ident or not self._enabled["modules"]:
            return
        registry = self._registry
        if _current_graph_task_id() != -1:
            return
        try:
            with self._thread.following() as followed:
                if not followed:
                    return
                if registry.known_id(module) is None:
                    generation = registry.generation
                    registry.lookup(module)
                    if registry.generation != generation:
                        self._found()
                if self._hooked_root(module):
                    self.off()  # a root's forward starts; its post-hook puts the scout back
        except Exception as exc:
            self.off()
            self._disable("modules", exc)
