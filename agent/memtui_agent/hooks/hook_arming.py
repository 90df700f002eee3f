"""The costly hooks, installed and removed as one set: module, saved-tensor and gradient hooks.

The activation gate (`steps.gate`) decides when they run and switches them through `GateSwitch`
(all of them on every step in `every` mode; in `auto` mode armed for the steps it measures and
disarmed as the next step opens). Everything here keeps the job's own hooks intact:

- Saved-tensor hooks live on a per-thread stack the job may use too (`save_on_cpu`, its own
  lossy packing, checkpoint's). The agent pushes its pair only onto an empty stack, only on the
  thread that trains and never while autograd runs a backward (checkpoint's recomputation runs
  the forward again there): above the job's own pair it would take the job's tensors from the
  job's hooks (a lossy pack trains to other losses), and the job's `with` block would pop the
  agent's pair instead of its own (`CheckpointError`). Where it cannot push, the step is measured
  blind, and the gate says its activations are not known (`foreign_hooks`, `pack_missing`). It
  pops only its own pair, seen at the top of the stack, and may stay until the close (loss
  functions outside the model save tensors too).
- Gradient hooks are kept per parameter in an id()-keyed table whose entries leave when the
  parameter dies (weakref callback), so the table never pins or confuses the job's tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from threading import get_ident
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar

import torch

from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.memory.finalizer_interrupts import hand_back
from memtui_agent.steps.pile_count import PersistentPiles

if TYPE_CHECKING:  # for annotations only
    from torch.utils.hooks import RemovableHandle

    from memtui_agent.hooks.saved_tensors import Packed

_Held = TypeVar("_Held")
_Entry = TypeVar("_Entry")


def forget_when_freed(obj: _Held, table: dict[int, _Entry]) -> weakref.ref[_Held]:
    """A weakref to `obj` that removes `table[id(obj)]` when `obj` dies, so id()-keyed tables
    neither grow with the job's dead objects nor mistake a new one at the same id."""
    key = id(obj)

    def forget(ref: weakref.ref[_Held]) -> None:
        try:
            entry = table.get(key)
            if entry is ref or (isinstance(entry, tuple) and entry[0] is ref):
                del table[key]
        except BaseException as error:  # a finalizer: a Ctrl-C landing here is the job's
            hand_back(error)

    return weakref.ref(obj, forget)


class ArmedHooks(Protocol):
    """The hooks an arming installs (`hooks.counting.CountingHooks`)."""

    def module_pre(self, module: torch.nn.Module, args: tuple[object, ...]) -> None:
        """Every module's forward pre-hook (`args`: the job's inputs)."""
        ...

    def module_post(
        self, module: torch.nn.Module, args: tuple[object, ...], output: object
    ) -> None:
        """Every module's forward hook (also when the forward raised)."""
        ...

    def pack(self, tensor: torch.Tensor) -> Packed:
        """The saved-tensor pack hook."""
        ...

    def grad_ready(self, parameter: torch.Tensor) -> None:
        """A parameter's post-accumulate-grad hook."""
        ...


class ModuleArmingFollower(Protocol):
    """Hooks that are installed only while the global module hooks are (the root hooks' pre-hooks
    on repeated blocks, `root_calls`): an unmeasured step runs none of them."""

    def modules_armed(self) -> None:
        """The global module hooks were just installed."""
        ...

    def modules_disarmed(self) -> None:
        """The global module hooks were just removed."""
        ...


def _unbound(*args: object) -> NoReturn:
    raise RuntimeError("HookArming used before bind()")


class HookArming:
    """Installs and removes the module, saved-tensor and gradient hooks of one tracker."""

    def __init__(self, unpack: Callable[[Packed], torch.Tensor]) -> None:
        """The hooks themselves come with `bind` (they read this arming: a cycle broken once,
        where the agent is built, `startup.parts.build_parts`)."""
        self._module_pre: Callable[[torch.nn.Module, tuple[object, ...]], None] = _unbound
        self._module_post: Callable[[torch.nn.Module, tuple[object, ...], object], None] = _unbound
        self._pack: Callable[[torch.Tensor], Packed] = _unbound
        """The one object pushed, so the top of the stack can be recognised as ours."""
        self._unpack = unpack
        self._grad_ready: Callable[[torch.Tensor], None] = _unbound
        self._module_handles: list[RemovableHandle] = []
        self._followers: list[ModuleArmingFollower] = []
        self.grad_hooked: dict[int, tuple[weakref.ref[torch.Tensor], RemovableHandle]] = {}
        """id(parameter) -> (weakref, hook handle); the entry leaves when the parameter dies."""
        self.pushed_on: int | None = None
        """The thread whose saved-tensor stack holds the agent's pair (None: not pushed)."""
        self.left_on: set[int] = set()
        """Threads no longer followed whose stack still holds the agent's pair (popped if that
        thread ever removes the hooks, e.g. the main thread at the end of the job)."""

    def bind(self, hooks: ArmedHooks) -> None:
        """The hooks this arming installs (before any is armed)."""
        self._module_pre = hooks.module_pre
        self._module_post = hooks.module_post
        self._pack = hooks.pack
        self._grad_ready = hooks.grad_ready

    def follow(self, follower: ModuleArmingFollower) -> None:
        """Tell `follower` each time the module hooks are installed or removed."""
        self._followers.append(follower)

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
        for follower in self._followers:
            follower.modules_armed()

    def disarm_modules(self) -> None:
        """Remove the global module hooks."""
        if not self._module_handles:
            return
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []
        for follower in self._followers:
            follower.modules_disarmed()

    # ----- saved-tensor hooks ------------------------------------------------------------------

    def foreign_hooks(self) -> bool:
        """Whether the agent must not push its pair on the calling thread now: the job's own
        saved-tensor hooks are on top of its stack (or disabled), or autograd is running a
        backward there (a checkpoint recomputing its forward). Then a forward that runs is one
        the agent cannot count."""
        if torch._C._current_graph_task_id() != -1:
            return True
        if self.saved_hooks_disabled:
            return True
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] is not self._pack

    @property
    def saved_hooks_disabled(self) -> bool:
        """torch has disabled saved-tensor hooks on this thread now (torch.func's transforms):
        no pair can be pushed, the job's or the agent's."""
        return not torch._C._autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]

    def push_pack(self) -> bool:
        """Push the agent's pair on the calling thread (the one that runs the forward) if the
        stack is empty there and no backward runs; whether the pair is pushed now."""
        if self.pushed_on is not None:
            return self.pushed_on == get_ident()
        if torch._C._current_graph_task_id() != -1:
            return False
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return False  # the job's own pair (or checkpoint's): never above it
        try:
            torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)
        except RuntimeError:  # the job disabled saved-tensor hooks
            return False
        self.pushed_on = get_ident()
        return True

    @property
    def pack_missing(self) -> bool:
        """Armed, but the agent's pair is not where the calling thread's forwards pack: the job's
        own pair was on top when it tried, or is above it now."""
        if not self.modules_armed:
            return False
        if self.pushed_on != get_ident():
            return True
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is None or top[0] is not self._pack

    @property
    def pack_removable(self) -> bool:
        """Whether the agent's pair can leave now: not pushed, or on top of this thread's stack."""
        if self.pushed_on is None:
            return True
        if self.pushed_on != get_ident():
            return False
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return top is not None and top[0] is self._pack

    def leave_thread(self, old: int) -> None:
        """The followed thread changed from `old`: a pair pushed there stays (no thread can pop
        another's), ignored by the pack hook; the next arming pushes on the new thread."""
        if self.pushed_on == old:
            self.pushed_on = None
            self.left_on.add(old)

    def _pop_left(self) -> None:
        """On a thread the agent left: pop its old pair if it is on top there."""
        ident = get_ident()
        if ident in self.left_on:
            top = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if top is not None and top[0] is self._pack:
                torch._C._autograd._pop_saved_tensors_default_hooks()
                self.left_on.discard(ident)

    def pop_pack(self) -> bool:
        """Pop the agent's pair if it is on top of this thread's stack; False if it is still
        there (the job's own pair above it: ours goes when it is on top again)."""
        if self.pushed_on is None:
            return True
        if not self.pack_removable:
            return False
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self.pushed_on = None
        return True

    # ----- gradient hooks ----------------------------------------------------------------------

    def hook_grads(self, parameters: list[torch.Tensor]) -> None:
        """A post-accumulate-grad hook on each leaf parameter that requires a gradient."""
        hooked = self.grad_hooked
        for parameter in parameters:
            known = hooked.get(id(parameter))
            if known is not None and known[0]() is parameter:
                continue
            if not parameter.requires_grad or not parameter.is_leaf:
                continue
            # An unannotated method of torch's: its handle is a RemovableHandle.
            handle: RemovableHandle = parameter.register_post_accumulate_grad_hook(self._grad_ready)
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

    def arm(self, parameters: list[torch.Tensor]) -> None:
        """Install module, saved-tensor and gradient hooks (on the training thread)."""
        self.arm_modules()
        self.push_pack()
        self.hook_grads(parameters)

    @property
    def installed(self) -> bool:
        """Whether any hook of the set is installed, on this thread or one the agent left."""
        return bool(self._module_handles or self.grad_hooked or self.left_on) or (
            self.pushed_on is not None
        )

    def disarm(self) -> None:
        """Remove module and gradient hooks and, if it is on top, the saved-tensor pair."""
        self.disarm_modules()
        self.unhook_grads()
        self.pop_pack()
        self._pop_left()


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

    def arm(self, root: torch.nn.Module | None) -> None:
        """Install the set; `root` is the root module whose pre-hook asks (or None)."""
        rejoin = not self._arming.armed
        parameters = self._registry.parameters()
        self._arming.arm(parameters)
        if rejoin:
            self._piles.gradients_rejoin(parameters)
        if root is not None and self._enabled["modules"]:
            self._stack.append(self._registry.lookup(root))

    def foreign_hooks(self) -> bool:
        """The job's own saved-tensor hooks are on top on this thread, or a backward runs."""
        return self._arming.foreign_hooks()

    @property
    def pack_missing(self) -> bool:
        """Armed without the agent's saved-tensor pair where this thread's forwards pack."""
        return self._arming.pack_missing

    @property
    def saved_hooks_disabled(self) -> bool:
        """torch has disabled saved-tensor hooks on this thread now (torch.func's transforms)."""
        return self._arming.saved_hooks_disabled

    @property
    def installed(self) -> bool:
        """Whether any hook of the set is still installed."""
        return self._arming.installed

    def disarm(self) -> None:
        """Remove the set; the module stack restarts empty with the next forward."""
        self._arming.disarm()
        self._stack.clear()
        self._piles.gradients_leave()

    def hook_new_parameters(self) -> None:
        """Gradient hooks on parameters found since the set was armed."""
        self._arming.hook_grads(self._registry.parameters())
