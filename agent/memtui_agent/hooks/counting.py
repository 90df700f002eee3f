"""The hooks that count: every module's forward, every saved tensor, every gradient.

Installed by the hook arming (`hook_arming.HookArming`) while the activation gate wants them:
global module forward pre/post hooks keep the module stack that activations are attributed to,
the saved-tensor pack hook counts each activation (and each weight autograd packs) into the
ledger, and the post-accumulate-grad hook counts each gradient. They are the hottest code of
the agent: constant-time work, flags read with one lookup, and inside a `try`: an exception
turns that kind off (`switches.HookSwitches`), reported once, and never reaches the job.
"""

from __future__ import annotations

import sys
import weakref
from threading import get_ident

from torch import Tensor, nn
from torch._C import _current_graph_task_id
from torch.compiler import is_compiling
from torch.nn import Parameter

from memtui_agent.hooks.context import HookContext
from memtui_agent.hooks.data_parallel import DataParallelHooks
from memtui_agent.hooks.hook_arming import HookArming, forget_when_freed
from memtui_agent.hooks.objects import ObjectSync
from memtui_agent.hooks.saved_tensors import Packed, Saved, SavedOne, SavedWeight
from memtui_agent.memory.ledger import (
    GRADIENTS,
    NO_MODULE,
    NODE_SHIFT,
    WEIGHTS,
    plain_storage,
    storages_of,
)
from memtui_agent.memory.saved_form import held_form
from memtui_agent.memory.tensor_reads import next_sequence_number
from memtui_agent.steps.health import HealthMonitor
from memtui_protocol.schema import Phase


class CountingHooks:
    """The module, saved-tensor and gradient hooks (`hook_arming.ArmedHooks`)."""

    def __init__(
        self,
        context: HookContext,
        arming: HookArming,
        health: HealthMonitor,
        data_parallel: DataParallelHooks,
        objects: ObjectSync,
    ) -> None:
        """`health` reads the modules' outputs on probed steps; `objects` registers what a
        forward brings that is new (a model tree, an optimizer)."""
        self._phase = context.phase
        self._stack = context.phase.stack
        """The module stack, read by the hottest hooks without another attribute lookup."""
        self._thread = context.thread
        self._enabled = context.switches
        self._disable = context.switches.disable
        self._registry = context.registry
        self._gate = context.gate
        self._ledger = context.ledger
        self._arming = arming
        self._health = health
        self._data_parallel = data_parallel
        self._objects = objects
        self._watermark = objects.watermark
        self._seen_params: dict[int, weakref.ref[Tensor]] = {}

    def forget_parameters(self) -> None:
        """The followed thread moved: the parameters seen packed so far are seen again."""
        self._seen_params.clear()

    # ----- module hooks ----------------------------------------------------------------------

    def module_pre(self, module: nn.Module, args: tuple[object, ...]) -> None:
        """Every module's forward pre-hook: the module onto the stack (`args`: the job's
        inputs, never looked into)."""
        # Only the followed thread (`training_thread`) is seen: its module stack is what
        # activations are attributed to. Other threads (DataParallel replicas, a second
        # forward thread, a second model trained beside it) would corrupt the stack and
        # register throwaway replicas.
        # While torch.compile traces, hooks must do nothing dynamo cannot trace (a call such as
        # get_ident() would break the graph and leave the model running eagerly).
        if is_compiling() or not self._enabled["modules"] or get_ident() != self._thread.ident:
            return
        try:
            registry = self._registry
            watermark = self._watermark
            module_id = registry.known_id(module)
            if module_id is None or registry.generation != watermark.generation:
                # A new tree, or new objects to hook: done only while this thread is followed
                # (`TrainingThread.following`), never after the agent moved to another.
                with self._thread.following() as followed:
                    if not followed:
                        return
                    module_id = registry.lookup(module)
                    if registry.generation != watermark.generation:
                        self._objects.new_objects()
            stack = self._stack
            if not stack:
                self._phase.in_optimizer = False
                if self._arming.pack_missing and _current_graph_task_id() == -1:
                    # An outermost forward under the job's own saved-tensor hooks (checkpoint
                    # over the whole model, save_on_cpu): none of its tensors reach ours.
                    self._gate.forward_unseen()
            stack.append(module_id)
        except Exception as exc:
            self._disable("modules", exc)

    def module_post(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        """Every module's forward hook: the module off the stack (and where a forward failed)."""
        if is_compiling() or not self._enabled["modules"] or get_ident() != self._thread.ident:
            return
        try:
            stack = self._stack
            if stack:
                # Hooks run from `_call_impl` itself only when forward raised; on success they
                # run from its inner function (an outer `except` block also sets exc_info()).
                if (
                    sys.exc_info()[1] is not None
                    and sys._getframe(1).f_code.co_name == "_call_impl"
                ):
                    self._phase.note_error(Phase.FORWARD, self._registry.name(stack[-1]))
                elif self._gate.probing:
                    self._health.module_output(stack[-1], args, output)
                stack.pop()
            if self._data_parallel.fsdp:
                self._data_parallel.module_returned(module)
        except Exception as exc:
            self._disable("modules", exc)

    # ----- saved tensors -----------------------------------------------------------------------

    def pack(self, tensor: Tensor) -> Packed:
        """The saved-tensor pack hook: an activation counted, or a weight recognised."""
        # The hottest function of the agent (every saved tensor): a parameter is recognised by
        # its exact type first, because `isinstance(x, Parameter)` runs a Python metaclass hook.
        if is_compiling() or not self._enabled["pack"]:
            return tensor
        if self._arming.left_on and get_ident() in self._arming.left_on:
            return tensor  # a pair left on a thread no longer followed
        try:
            origin = tensor._base
            if origin is None:
                origin = tensor
            kind = type(origin)
            if kind is Parameter or (kind is not Tensor and isinstance(origin, Parameter)):
                seen = self._seen_params.get(id(origin))
                if (seen is None or seen() is not origin) and not self._pack_parameter(origin):
                    return tensor  # FSDP's gathered parameter: kept as FSDP expects
                # A weight, never an activation: autograd keeps it as it would without hooks.
                share = self._gate.signatures.share
                if share is not None and share.on:
                    share.held()
                return SavedWeight(tensor, tensor._version)
            stack = self._stack
            module = stack[-1] if stack else NO_MODULE
            plain = plain_storage(tensor)
            if plain is not None:  # almost every saved tensor: one storage
                key, nbytes, name, _storage = plain
                if not nbytes or not key >> 8:
                    share = self._gate.signatures.share
                    if share is not None and share.on:
                        share.held()
                    return tensor  # holds no memory
                ledger = self._ledger
                ledger.acquire_activation(key, nbytes, name, module)
                # The node being built is the last one this thread numbered (the next number,
                # less one): a census finds what a retained graph holds from this record,
                # never by unpacking it.
                node = next_sequence_number()
                one = SavedOne(held_form(tensor, node - 1), key, ledger, tensor._version)
                ledger.saved_nodes[id(one)] = (node << NODE_SHIFT) | key
                share = self._gate.signatures.share
                if share is not None and share.on:
                    # What autograd would keep of it without the hook (`hook_share`).
                    share.saved(tensor, node - 1)
                return one
            infos = storages_of(tensor)
            keys = [info[0] for info in infos]
            node = next_sequence_number() - 1
            saved = Saved(held_form(tensor, node), keys, self._ledger, tensor._version)
            for key, nbytes, dtype, _storage in infos:
                self._ledger.acquire_activation(key, nbytes, dtype, module)
            self._ledger.saved_nodes_multi[id(saved)] = (node, tuple(keys))
            share = self._gate.signatures.share
            if share is not None and share.on:
                share.saved(tensor, node)
            return saved
        except Exception as exc:
            self._disable("pack", exc)
            return tensor

    def _pack_parameter(self, origin: Tensor) -> bool:
        """A parameter (or a view of one) not seen before: a weight, never an activation.
        False for FSDP's all-gathered parameter, whose memory is FSDP's (the shard is the
        weight) and which autograd must keep exactly as FSDP expects."""
        if self._data_parallel.fsdp and self._data_parallel.gathered_parameter(origin):
            return False
        # A parameter no module or optimizer has shown us yet: it is a weight.
        self._seen_params[id(origin)] = forget_when_freed(origin, self._seen_params)
        self._ledger.add(WEIGHTS, origin)
        return True

    # ----- gradients ---------------------------------------------------------------------------

    def grad_ready(self, parameter: Tensor) -> None:
        """A parameter's post-accumulate-grad hook: its gradient counted."""
        if not self._enabled["grads"]:
            return
        try:
            grad = parameter.grad
            if grad is None:
                return
            plain = plain_storage(grad)
            if plain is None or not plain[1] or not plain[0] >> 8:
                self._ledger.add(GRADIENTS, grad)
                return
            key, nbytes, name, storage = plain
            if grad.data_ptr() == key >> 8:
                self._ledger.claim_gradient(key, nbytes, name, storage, grad)
            else:  # a view at an offset is not cached: the close derives its storage
                self._ledger.claim(GRADIENTS, key, nbytes, name, storage)
        except Exception as exc:
            self._disable("grads", exc)
