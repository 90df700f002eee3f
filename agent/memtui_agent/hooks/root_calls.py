"""A forward pre/post hook on each root module: one call per top-level forward.

These stay installed whatever `--activations` says (the global module hooks do not): the
pre-hook reports each top-level call to the activation gate, whose call signatures decide
whether the step is measured (`steps.gate`); the post-hook says where a failed forward was while
the module hooks that would say it are off. A pre-hook on each of a root's repeated blocks reads
their inputs (`job.blocks`) on measured steps only, so it is installed with the module hooks and
removed with them (`HookArming.follow`): on every step they cost the hook's early return
(0.26 ms a step for the 200 blocks of benchmarks' `stack` model) and torch's slower call path
for a hooked module besides.

A root called while autograd runs a backward (a checkpoint recomputing the model's forward) is
not a call of the job's step: both hooks leave it alone, so nothing is armed or pushed inside
the recomputation.
"""

from __future__ import annotations

import sys
import weakref
from threading import get_ident
from typing import TYPE_CHECKING, Any

from torch._C import _current_graph_task_id
from torch.compiler import is_compiling
from torch.jit import ScriptModule

from memtui_agent.hooks.context import HookContext
from memtui_agent.hooks.copy_safe import CopySafeHook
from memtui_agent.hooks.hook_arming import HookArming, forget_when_freed
from memtui_agent.hooks.module_scout import ModuleScout
from memtui_agent.job.blocks import repeated_blocks
from memtui_protocol.schema import Phase

if TYPE_CHECKING:  # for annotations only
    import torch
    from torch.utils.hooks import RemovableHandle


class RootHooks:
    """The per-root hooks of one tracker, and their handles."""

    def __init__(self, context: HookContext, arming: HookArming, scout: ModuleScout) -> None:
        """`scout` is the between-roots hook, out while a root's forward runs."""
        self._scout = scout
        self._registry = context.registry
        self._phase = context.phase
        self._arming = arming
        self._gate = context.gate
        self._window = context.window
        self._disable = context.switches.disable
        self._thread = context.thread
        """The thread whose forwards are followed (`training_thread`)."""
        self._hooked: dict[int, tuple[weakref.ref[torch.nn.Module], list[RemovableHandle]]] = {}
        """id(root module) -> (weakref, its pre/post hook handles)."""
        # What each root's hook dicts hold: the job copies and pickles its modules with them
        # (`copy.deepcopy`, `torch.save`), and a copy must get an inert stand-in, never these
        # methods' object (`copy_safe`). One pair, shared by every root.
        self._pre_hook = CopySafeHook(self._pre)
        self._post_hook = CopySafeHook(self._post)
        self._block_hook = CopySafeHook(self._block)
        self._blocks: list[weakref.ref[torch.nn.Module]] = []
        """The roots' repeated blocks (weakly: a dropped model's blocks leave with it)."""
        self._block_handles: list[RemovableHandle] = []
        """Their pre-hooks' handles, while the module hooks are armed."""
        arming.follow(self)

    def hook_roots(self) -> None:
        """Hook every root not hooked yet (new model trees)."""
        hooked = self._hooked
        for root in self._registry.live_roots():
            known = hooked.get(id(root))
            if known is not None and known[0]() is root:
                continue
            if isinstance(root, ScriptModule):
                # torch refuses hooks on a scripted module (RuntimeError), which turned the
                # module and step hooks off for the run: its calls are not root calls here.
                continue
            handles = [
                root.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
                root.register_forward_hook(self._post_hook, always_call=True),
            ]
            hooked[id(root)] = (forget_when_freed(root, hooked), handles)
            found = self._find_blocks(root)
            self._blocks.extend(found)
            if self._arming.modules_armed:
                self._hook_blocks(found)

    def hooks(self, module: torch.nn.Module) -> bool:
        """Whether `module` is a root carrying these hooks now."""
        known = self._hooked.get(id(module))
        return known is not None and known[0]() is module

    def _find_blocks(self, root: torch.nn.Module) -> list[weakref.ref[torch.nn.Module]]:
        """The root's repeated blocks whose bytes the watch keeps (`job.blocks`). An error
        leaves them unhooked, said once by the next close (`BlockWatch.error`)."""
        watch = self._registry.blocks
        try:
            return [
                weakref.ref(block)
                for block in repeated_blocks(root)
                if self._registry.known_id(block) in watch.ranges
            ]
        except Exception as exc:
            watch.error = exc
            return []

    def _hook_blocks(self, blocks: list[weakref.ref[torch.nn.Module]]) -> None:
        """A pre-hook with keyword arguments on each of `blocks` still alive: their inputs on
        this measured step. An error is said once by the next close (`BlockWatch.error`)."""
        try:
            for ref in blocks:
                block = ref()
                if block is not None:
                    handle = block.register_forward_pre_hook(self._block_hook, with_kwargs=True)
                    self._block_handles.append(handle)
        except Exception as exc:
            self._registry.blocks.error = exc

    def modules_armed(self) -> None:
        """The module hooks are in (a measured step): the blocks' pre-hooks go in with them."""
        self._blocks = [ref for ref in self._blocks if ref() is not None]
        if not self._block_handles:
            self._hook_blocks(self._blocks)

    def modules_disarmed(self) -> None:
        """The module hooks are out: so are the blocks' pre-hooks."""
        handles, self._block_handles = self._block_handles, []
        for handle in handles:
            handle.remove()

    def outside(self) -> None:
        """No root's forward runs now (the hooks are installed, or the followed thread moved):
        the between-roots hook goes in."""
        self._scout.on()

    def remove(self) -> None:
        """Remove every root's hooks (and the between-roots hook)."""
        self._scout.off()
        for _ref, handles in list(self._hooked.values()):
            for handle in handles:
                handle.remove()
        self._hooked.clear()
        self.modules_disarmed()
        self._blocks = []

    def _pre(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        # `kwargs` may be missing: when the agent is removed (detach) from a global pre-hook of
        # the same call, torch still calls this hook from its copied list, but without the
        # keyword arguments (its with-kwargs mark left with the handle). Never an error then.
        if (
            is_compiling()
            or get_ident() != self._thread.ident
            or not self._hooked
            or _current_graph_task_id() != -1
        ):
            return
        # The gate may arm here (hooking and reading the followed thread's gradients): only
        # while this thread is still the followed one (`TrainingThread.following`).
        with self._thread.following() as followed:
            if not followed:
                return
            phase = self._phase
            phase.root_depth += 1
            if phase.root_depth > 1:
                return  # a root called inside another root's forward
            self._scout.off()  # inside a known model: its modules are known or attached to it
            try:
                phase.in_optimizer = False
                self._gate.root_call(module, args, kwargs or {}, self._window.number)
            except Exception as exc:
                self._disable("activations", exc)

    def _block(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        """A repeated block's forward starts: its inputs' bytes, while the module hooks are
        armed (a measured step) on the followed thread, outside a backward (a checkpoint
        recomputing it)."""
        if (
            is_compiling()
            or not self._arming.modules_armed
            or get_ident() != self._thread.ident
            or _current_graph_task_id() != -1
        ):
            return
        watch = self._registry.blocks
        try:
            module_id = self._registry.known_id(module)
            if module_id is not None and module_id in watch.ranges:
                watch.entered(module_id, args, kwargs or {})
        except Exception as exc:
            watch.error = exc

    def _post(self, module: torch.nn.Module, args: tuple[Any, ...], output: object) -> None:
        if is_compiling() or get_ident() != self._thread.ident or _current_graph_task_id() != -1:
            return
        with self._thread.following() as followed:
            if not followed:
                return
            phase = self._phase
            phase.root_depth = max(0, phase.root_depth - 1)
            if phase.root_depth:
                return
            self._scout.on()
            try:
                if sys.exc_info()[1] is not None:
                    if not self._arming.modules_armed:
                        # Unarmed, the module hooks that say where a forward failed are off.
                        where = self._registry.name(self._registry.lookup(module))
                        phase.note_error(Phase.FORWARD, where)
                else:
                    self._gate.root_returned(output, self._window.number)
            except Exception as exc:
                self._disable("activations", exc)
