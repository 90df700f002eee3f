"""Which modules and optimizers the job uses, and their names, found without user code.

A module seen by the global forward pre-hook that is not inside an already known tree becomes a
root: its qualified names are computed once (as PyTorch's mod_tracker does) and sent once as a
`Names` message; afterwards hooks refer to modules by integer id. Lookups are keyed by `id()` and
confirmed through a weakref, so a freed module whose id is reused is never confused with a new one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import TYPE_CHECKING, cast

from memtui_agent.job.blocks import BlockWatch, block_ranges, repeated_blocks
from memtui_agent.memory.finalizer_interrupts import hand_back
from memtui_protocol import schema

if TYPE_CHECKING:  # annotations only: the registry is built before the job imports torch
    import torch

REWALK_EVERY = 64

_ParameterCache = tuple[tuple[int, int, tuple[int, ...]], "list[weakref.ref[torch.Tensor]]"]
"""(generation, tree generation, parameter count of each group) and weakrefs to the parameters
found then."""


def _parameter_values(module: torch.nn.Module) -> Iterable[torch.nn.Parameter | None]:
    return module._parameters.values()


def _buffer_values(module: torch.nn.Module) -> Iterable[torch.Tensor | None]:
    return module._buffers.values()


def _holds_nothing(module: torch.nn.Module) -> bool:
    """No child, and no parameter or buffer that is set (a loss's `weight` buffer is None)."""
    if getattr(module, "_modules", None):
        return False
    held = chain(
        getattr(module, "_parameters", {}).values(), getattr(module, "_buffers", {}).values()
    )
    return all(value is None for value in held)


class ModuleRegistry:
    """Roots, module ids and parameter names for everything the job has run."""

    def __init__(self, publish: Callable[[schema.Names], None]) -> None:
        self._publish = publish
        self._by_id: dict[int, tuple[weakref.ref[torch.nn.Module], int]] = {}
        self._names: list[str] = []
        self._roots_of_class: dict[str, int] = {}
        """Class name -> roots of that class registered so far (`_add_root` numbers them)."""
        self._empty_ids: dict[str, int] = {}
        """Class name -> the name id all of its empty modules share (`lookup`)."""
        self._parked_names: dict[int, tuple[weakref.ref[torch.nn.Module], int, int, str]] = {}
        """id(root) -> (weakref, first name id, module count, prefix) of every tree named so
        far, so one registered again after `forget_objects` keeps its names."""
        self.roots: list[weakref.ref[torch.nn.Module]] = []
        self.optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self.param_names: dict[int, str] = {}
        self._module_cache: tuple[tuple[int, int], list[weakref.ref[torch.nn.Module]]] | None = None
        """((generation, tree_generation), weakrefs to every module) of the last walk."""
        self._walks = 0
        self.generation = 0
        """Bumped whenever a root or an optimizer is added, so hooks can resync once."""
        self.tree_generation = 0
        """Bumped by `note_tree_change` (torch's registration hooks, `Module._apply`): a module,
        parameter or buffer was added or replaced somewhere."""
        self._parameter_cache: _ParameterCache | None = None
        self._parameter_calls = 0
        self._walked_ids: frozenset[int] = frozenset()
        """id() of every module found by the last walk of the trees."""
        self.parameter_walks = 0
        """How many times `parameters()` walked the trees (facts about them are redone then)."""
        self.blocks = BlockWatch()
        """Each named tree's repeated blocks (`job.blocks`), found as the tree is named."""

    def known_id(self, module: torch.nn.Module) -> int | None:
        """Name id of a module of a registered tree; None for any other (the hooks' hot path:
        registering is `lookup`'s, and the hooks do it only while they follow the thread)."""
        known = self._by_id.get(id(module))
        if known is not None and known[0]() is module:
            return known[1]
        return None

    def lookup(self, module: torch.nn.Module) -> int:
        """Name id of a module, registering its tree if it is new.

        A new module that holds nothing (no parameter, buffer or child) is not a tree: jobs
        build such modules at every call (Hugging Face models create `CrossEntropyLoss()` in
        `forward`), and registering each one would grow the name table, the recording and the
        roots without end. All of one class share one name id instead.
        """
        known = self.known_id(module)
        if known is not None:
            return known
        if _holds_nothing(module):
            return self._empty_module_id(type(module).__name__)
        self._add_root(module)
        return self._by_id[id(module)][1]

    def _empty_module_id(self, class_name: str) -> int:
        """The one name id of the empty modules of a class, published the first time."""
        module_id = self._empty_ids.get(class_name)
        if module_id is None:
            module_id = self._empty_ids[class_name] = len(self._names)
            self._names.append(class_name)
            self._publish(schema.Names(kind="module", first_id=module_id, names=[class_name]))
        return module_id

    def name(self, module_id: int) -> str:
        """The qualified name behind an id."""
        return self._names[module_id] if 0 <= module_id < len(self._names) else "<no module>"

    def _add_root(self, root: torch.nn.Module) -> None:
        """Name a new tree: the first root of a class by its qualified names (`encoder.fc`),
        a later one of the same class under `Class#N.` (`Net#2.fc`), so two models of one class
        (a GAN's pair, a teacher and its student, an EMA copy) never share a name. A tree
        `forget_objects` set aside comes back under its names if it still has its modules."""
        if self._readd_parked(root):
            return
        first_id = len(self._names)
        root_name = type(root).__name__
        count = self._roots_of_class[root_name] = self._roots_of_class.get(root_name, 0) + 1
        prefix = f"{root_name}#{count}" if count > 1 else ""
        new_names: list[str] = []
        positions: dict[int, int] = {}
        for qualified, module in root.named_modules():
            name = _joined(prefix, qualified) or root_name
            positions[id(module)] = len(new_names)
            self._by_id[id(module)] = (weakref.ref(module), first_id + len(new_names))
            new_names.append(name)
        self._find_blocks(root, new_names, first_id, positions)
        for qualified, parameter in root.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(parameter), _joined(prefix, qualified))
        self._names.extend(new_names)
        self.roots.append(weakref.ref(root))
        self._parked_names[id(root)] = (self._parking_ref(root), first_id, len(new_names), prefix)
        self.generation += 1
        if new_names:
            self._publish(schema.Names(kind="module", first_id=first_id, names=new_names))

    def _find_blocks(
        self, root: torch.nn.Module, names: list[str], first_id: int, positions: dict[int, int]
    ) -> None:
        """The new tree's repeated blocks into `blocks`; an error leaves the tree without them
        and is kept for the next step's close to report once (`BlockWatch.error`)."""
        try:
            found = [names[positions[id(block)]] for block in repeated_blocks(root)]
            self.blocks.add(block_ranges(names, first_id, found))
        except Exception as exc:
            self.blocks.error = exc

    def _parking_ref(self, root: torch.nn.Module) -> weakref.ref[torch.nn.Module]:
        """A weakref to `root` that takes its `_parked_names` entry away when it dies."""
        key = id(root)
        table = self._parked_names

        def forget(ref: weakref.ref[torch.nn.Module]) -> None:
            try:
                entry = table.get(key)
                if entry is not None and entry[0] is ref:
                    del table[key]
            except BaseException as error:  # a finalizer: a Ctrl-C landing here is the job's
                hand_back(error)

        return weakref.ref(root, forget)

    def _readd_parked(self, root: torch.nn.Module) -> bool:
        """Register a tree forgotten by `forget_objects` again under the ids its names already
        have in the stream (the same modules in the same order); False if it has none."""
        parked = self._parked_names.get(id(root))
        alive = parked[0]() if parked is not None else None
        if parked is None or alive is None or alive is not root:
            return False
        _ref, first_id, count, prefix = parked
        modules = list(alive.modules())
        if len(modules) != count:
            return False  # its tree changed: named afresh
        for offset, module in enumerate(modules):
            self._by_id[id(module)] = (weakref.ref(module), first_id + offset)
        for qualified, parameter in alive.named_parameters(remove_duplicate=False):
            self.param_names.setdefault(id(parameter), _joined(prefix, qualified))
        self.roots.append(weakref.ref(alive))
        self.generation += 1
        return True

    def forget_objects(self) -> None:
        """Drop every root and optimizer registered so far: they were another thread's (the
        thread the agent followed before the first optimizer step came from elsewhere), and
        the agent must not read their tensors while that thread trains them. Names already in
        the stream keep their ids, which are never reused; a tree the new thread runs too is
        registered again under them (`_add_root`)."""
        self.roots = []
        self.optimizers = []
        self._by_id = {}
        self.param_names = {}
        self._module_cache = None
        self._parameter_cache = None
        self._walked_ids = frozenset()
        self.generation += 1

    def add_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Remember an optimizer; True the first time it is seen."""
        if any(ref() is optimizer for ref in self.optimizers):
            return False
        self.optimizers.append(weakref.ref(optimizer))
        self.generation += 1
        return True

    def live_roots(self) -> Iterator[torch.nn.Module]:
        """Roots still alive; dead ones are dropped so their memory no longer counts."""
        alive = [ref for ref in self.roots if ref() is not None]
        self.roots = alive
        for ref in alive:
            root = ref()
            if root is not None:
                yield root

    def live_optimizers(self) -> Iterator[torch.optim.Optimizer]:
        """Optimizers still alive."""
        self.optimizers = [ref for ref in self.optimizers if ref() is not None]
        for ref in self.optimizers:
            optimizer = ref()
            if optimizer is not None:
                yield optimizer

    def modules(self) -> list[torch.nn.Module]:
        """Every module of every live root, walked again only when it may have changed.

        Walking `named_modules()` each step costs more than the rest of a step close; the list
        is rebuilt when a root or optimizer appears and every `REWALK_EVERY` calls, which
        catches modules added later (adapters, swapped heads).
        """
        self._walks += 1
        cache = self._module_cache
        generations = (self.generation, self.tree_generation)
        if cache is not None and cache[0] == generations and self._walks % REWALK_EVERY:
            modules = [module for ref in cache[1] if (module := ref()) is not None]
            if len(modules) == len(cache[1]):
                return modules
        # The cache holds weak references only: a module the job drops (a swapped head, a
        # whole model) is freed at once, exactly as without the agent; a dead one forces a walk.
        seen: dict[int, torch.nn.Module] = {}
        for root in self.live_roots():
            for module in root.modules():
                seen.setdefault(id(module), module)
        modules = list(seen.values())
        self._module_cache = (generations, [weakref.ref(module) for module in modules])
        self._walked_ids = frozenset(seen)
        return modules

    def note_tree_change(self, module: torch.nn.Module, *_args: object) -> None:
        """A module of a known tree registered or converted a child, parameter or buffer: walk
        the trees again.

        Installed as torch's global module/parameter/buffer registration hook (returning None
        leaves the registration unchanged) and called after `Module._apply`. Modules outside
        the known trees are ignored: a job that builds a module at every step (a loss module in
        a forward) registers its buffers each time, and attaching it to a tree is a
        registration on a known module.
        """
        # Any module of the last walk counts (one attached since has no name id yet); an id
        # reused by an unrelated module only costs one walk.
        if id(module) in self._walked_ids or id(module) in self._by_id:
            self.tree_generation += 1

    def weight_tensors(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """`parameters` (this close's `self.parameters()`) and the buffers of every root."""
        buffers = list(chain.from_iterable(map(_buffer_values, self.modules())))
        return parameters + [t for t in buffers if t is not None]

    def parameters(self) -> list[torch.Tensor]:
        """Every known parameter once: those of the modules, then optimizer-only ones.

        Read from each module's `_parameters` when the trees may have changed (a registration
        or conversion, a new root or optimizer, a parameter group added, a parameter freed, and
        every `REWALK_EVERY` calls, which catches a direct write to `_parameters`); otherwise
        the last walk's parameters, held by weak references. The walk runs in C iterators
        (`map`, `chain`), not a Python loop per parameter.
        """
        optimizers = list(self.live_optimizers())
        key = (
            self.generation,
            self.tree_generation,
            tuple(len(group["params"]) for o in optimizers for group in o.param_groups),
        )
        cache = self._parameter_cache
        self._parameter_calls += 1
        due = self._parameter_calls % REWALK_EVERY == 0
        if not due and cache is not None and cache[0] == key:
            found = [parameter for ref in cache[1] if (parameter := ref()) is not None]
            if len(found) == len(cache[1]):
                return found
        walked: list[torch.Tensor | None]
        walked = list(chain.from_iterable(map(_parameter_values, self.modules())))
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                walked += group["params"]
        unique = dict(zip(map(id, walked), walked, strict=False))
        unique.pop(id(None), None)
        parameters = cast("list[torch.Tensor]", list(unique.values()))  # None popped just above
        self.parameter_walks += 1
        self._parameter_cache = (key, [weakref.ref(parameter) for parameter in parameters])
        return parameters

    @staticmethod
    def gradients(parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        """The `.grad` of each of `parameters` (this step's `parameters()`) that has one."""
        return [grad for p in parameters if (grad := p.grad) is not None]

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        """Every tensor held in the state of every live optimizer."""
        return state_tensors(self.live_optimizers())


def state_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every tensor held in `optimizer.state`, one level of lists and tuples included."""
    import torch

    tensor = torch.Tensor
    found: list[torch.Tensor] = []
    for optimizer in optimizers:
        states = [state for state in list(optimizer.state.values()) if type(state) is dict]
        values = list(chain.from_iterable(map(dict.values, states)))
        found += [value for value in values if isinstance(value, tensor)]
        found += [
            item
            for value in values
            if type(value) is list or type(value) is tuple
            for item in value
            if isinstance(item, tensor)
        ]
    return found


def holds_sequences(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """Whether some optimizer keeps lists or tuples in its state (LBFGS's history): tensors
    appended to them change no count a close can read without walking the state."""
    for optimizer in optimizers:
        for state in list(optimizer.state.values()):
            if type(state) is dict and {list, tuple} & set(map(type, state.values())):
                return True
    return False


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the unique storages in one optimizer's state (its first step's growth)."""
    from memtui_agent.memory.ledger import storages_of

    tensors = state_tensors([optimizer])
    unique = {key: nbytes for t in tensors for key, nbytes, _, _ in storages_of(t)}
    return sum(unique.values())


def _joined(prefix: str, qualified: str) -> str:
    """`prefix.qualified`, or whichever of the two is not empty."""
    return f"{prefix}.{qualified}" if prefix and qualified else prefix or qualified
