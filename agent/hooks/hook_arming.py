"""The costly hooks, installed and removed as one set: module, saved-tensor and gradient hooks.

The activation gate (`steps.gate`) decides when they run and switches them through `GateSwitch`
(all of them on every step in `every` mode; in `auto` mode armed for the steps it measures and
disarmed as the next step opens). Everything here keeps the job's own hooks intact:

- Saved-tensor hooks live on a per-thread stack the job may use too (`save_on_cpu`, checkpoint's
  own). The agent pops only its own pair, seen at the top of the stack: pushed onto an empty
  stack, the pair may stay until the close (loss functions outside the model save tensors too);
  pushed above the job's own pair, it is scoped to the root call that pushed it, so the job's
  `with` block never pops the agent's pair instead of its own.
- Gradient hooks are kept per parameter in an id()-keyed table whose entries leave when the
  parameter dies (weakref callback), so the table never pins or confuses the job's tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch

from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.steps.pile_count import PersistentPiles


class Push(Enum):
    """Where the agent's saved-tensor pair is."""

    NONE = "none"
    OPEN = "open"
    """Pushed onto an empty stack: popped at the close (or later, once it is on top again)."""
    SCOPED = "scoped"
    """Pushed above the job's own pair: popped when the root call that pushed it returns."""


def forget_when_freed(obj: Any, table: dict[int, Any]) -> weakref.ref[Any]:
    """A weakref to `obj` that removes `table[id(obj)]` when `obj` dies, so id()-keyed tables
    neither grow with the job's dead objects nor mistake a new one at the same id."""
    key = id(obj)

    def forget(ref: weakref.ref[Any]) -> None:
        entry = table.get(key)
        if entry is ref or (isinstance(entry, tuple) and entry[0] is ref):
            del table[key]

    return weakref.ref(obj, forget)


class HookArming:
    """Installs and removes the module, saved-tensor and gradient hooks of one tracker."""

    def __init__(
        self,
        module_pre: Callable[..., Any],
        module_post: Callable[..., Any],
        pack: Callable[[Any], Any],
        unpack: Callable[[Any], Any],
        grad_ready: Callable[[Any], None],
    ) -> None:
        self._module_pre = module_pre
        self._module_post = module_post
        self._pack = pack
        """The one object pushed, so the top of the stack can be recognised as ours."""
        self._unpack = unpack
        self._grad_ready = grad_ready
        self._module_handles: list[Any] = []
        self.grad_hooked: dict[int, tuple[weakref.ref[Any], Any]] = {}
        """id(parameter) -> (weakref, hook handle); the entry leaves when the parameter dies."""
        self.push = Push.NONE

    # ----- module hooks ----------------------------------------------------------------------

    @property
    def modules_armed(self) -> bool:
        """Whether the global module hooks are installed."""
        return bool(self._module_handles)

    def arm_modules(self) -> None:
        """Install the global forward pre/post hooks (every module call of every thread)."""
        if self._module_handles:
            return
        module_mod = torch.nn.modules.module
        self._module_handles = [
            module_mod.register_module_forward_pre_hook(self._module_pre),
            module_mod.register_module_forward_hook(self._module_post, always_call=True),
        ]

    def disarm_modules(self) -> None:
        """Remove the global module hooks."""
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []

    # ----- saved-tensor hooks ------------------------------------------------------------------

    def push_pack(self) -> None:
        """Push the agent's pair on the calling thread (the one that runs the forward)."""
        if self.push is not Push.NONE:
            return
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        self.push = Push.OPEN if outer is None else Push.SCOPED

    @property
    def pack_removable(self) -> bool:
        """Whether the agent's pair can leave now: not pushed, or on top of the stack."""
        if self.push is Push.NONE:
            return True
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] is self._pack

    def pop_pack(self, scoped_only: bool = False) -> bool:
        """Pop the agent's pair if it is on top of the stack; False if it is still there."""
        if self.push is Push.NONE or (scoped_only and self.push is not Push.SCOPED):
            return self.push is Push.NONE
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] is not self._pack:
            return False  # the job's own pair is above ours: ours goes when it is on top
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self.push = Push.NONE
        return True

    # ----- gradient hooks ----------------------------------------------------------------------

    def hook_grads(self, parameters: list[Any]) -> None:
        """A post-accumulate-grad hook on each leaf parameter that requires a gradient."""
        hooked = self.grad_hooked
        for parameter in parameters:
            known = hooked.get(id(parameter))
            if known is not None and known[0]() is parameter:
                continue
            if not parameter.requires_grad or not parameter.is_leaf:
                continue
            handle = parameter.register_post_accumulate_grad_hook(self._grad_ready)
            hooked[id(parameter)] = (forget_when_freed(parameter, hooked), handle)

    def unhook_grads(self) -> None:
        """Remove every gradient hook."""
        for _ref, handle in list(self.grad_hooked.values()):
            handle.remove()
        self.grad_hooked.clear()

    # ----- all of them -------------------------------------------------------------------------

    @property
    def armed(self) -> bool:
        """Whether the set is installed (the module hooks stand for it)."""
        return self.modules_armed

    def arm(self, parameters: list[Any]) -> None:
        """Install module, saved-tensor and gradient hooks (on the training thread)."""
        self.arm_modules()
        self.push_pack()
        self.hook_grads(parameters)

    def disarm(self) -> None:
        """Remove module and gradient hooks and, if it is on top, the saved-tensor pair."""
        self.disarm_modules()
        self.unhook_grads()
        self.pop_pack()


class GateSwitch:
    """The activation gate's switch (`steps.gate.HookSwitch`) over one tracker's hooks.

    Arming also brings the gradients alive now back into the ledger (the gradient hooks keep
    them there from here), and a root whose forward is starting onto the module stack (its own
    global pre-hook ran before the arming); disarming takes the gradients out again, to be
    counted at each close (`pile_count`).
    """

    def __init__(
        self,
        arming: HookArming,
        registry: ModuleRegistry,
        piles: PersistentPiles,
        stack: list[int],
        enabled: dict[str, bool],
    ) -> None:
        self._arming = arming
        self._registry = registry
        self._piles = piles
        self._stack = stack
        self._enabled = enabled

    @property
    def armed(self) -> bool:
        """Whether the set is installed."""
        return self._arming.armed

    def arm(self, root: Any | None) -> None:
        """Install the set; `root` is the root module whose pre-hook asks (or None)."""
        rejoin = not self._arming.armed
        parameters = self._registry.parameters()
        self._arming.arm(parameters)
        if rejoin:
            self._piles.gradients_rejoin(parameters)
        if root is not None and self._enabled["modules"]:
            self._stack.append(self._registry.lookup(root))

    def disarm(self) -> None:
        """Remove the set; the module stack restarts empty with the next forward."""
        self._arming.disarm()
        self._stack.clear()
        self._piles.gradients_leave()

    def hook_new_parameters(self) -> None:
        """Gradient hooks on parameters found since the set was armed."""
        self._arming.hook_grads(self._registry.parameters())
