"""When a step close walks the weights and the optimizer state again.

Walking every module, parameter, buffer and optimizer state tensor at every close cost most of
an unmeasured step's overhead (601 small modules: 1.8 ms of a 38 ms step). Between closes these
piles change only through events seen without a walk:

- the module trees: torch's global module/parameter/buffer registration hooks and
  `Module._apply` (`.to()`, `.half()` swap `.data` without registering anything) bump
  `ModuleRegistry.tree_generation`; a new root or optimizer bumps its `generation`;
- optimizer state: which parameters have state and how many entries each holds (`len` of each
  state dict, counted in C), and which state dict the optimizer holds (`load_state_dict`); an
  optimizer that keeps lists in its state (LBFGS's history) is walked at every close;
- a storage of the pile freed (`Ledger.member_count` drops): `p.data = ...`, a state tensor
  replaced by a new one, a module dropped.

A pile is walked again when one of these says it may have changed, on the first closes, and on
an audit close every `AUDIT_CLOSES`. An audit that finds a change none of them announced (a
direct write to a module's `_parameters`, an optimizer whose state holds lists that grow) walks
that pile at every close from then on: exact again, at the old cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtui_agent.job.modules import ModuleRegistry, holds_sequences
from memtui_agent.memory.gradient_batch import ParameterFacts
from memtui_agent.memory.ledger import OPTIMIZER_STATE, WEIGHTS, Ledger, PileIndex

if TYPE_CHECKING:  # annotations only (torch is not imported here at run time)
    import torch

AUDIT_CLOSES = 64
FIRST_CLOSES = 3
"""Closes that always walk: the models, optimizers and their state appear there."""


class PileWatch:
    """Per close: must the weights and the optimizer state be walked again?"""

    def __init__(self, registry: ModuleRegistry, ledger: Ledger) -> None:
        self._registry = registry
        self._ledger = ledger
        self._keys: dict[PileIndex, object] = {}
        self._closes = 0
        self.always: set[PileIndex] = set()
        """Piles an audit caught changing unannounced: walked at every close."""
        self._facts: tuple[tuple[int, int, int] | None, ParameterFacts | None] = (None, None)
        self._weights_walks = 0
        self._sequences = False
        """Some optimizer's state holds lists (seen at the last walk): walk it every close."""

    def begin_close(self) -> bool:
        """Count a close; True when it must walk everything (first closes, audits)."""
        self._closes += 1
        return self._closes <= FIRST_CLOSES or self._closes % AUDIT_CLOSES == 0

    def weights_key(self) -> tuple[int, int, int, int]:
        """What changes when the weights may have: trees, roots, a weight storage freed."""
        registry = self._registry
        return (
            registry.generation,
            registry.tree_generation,
            registry.parameter_walks,
            self._ledger.member_count(WEIGHTS),
        )

    def state_key(self) -> tuple[int, int, tuple[tuple[int, int, int], ...]] | None:
        """What changes when optimizer state may have; None when it cannot be read cheaply."""
        if self._sequences:
            return None
        try:
            shape = tuple(
                (id(optimizer.state), len(optimizer.state), sum(map(len, optimizer.state.values())))
                for optimizer in self._registry.live_optimizers()
            )
        except TypeError:  # state entries that are not dicts: no cheap fingerprint
            return None
        return (self._registry.generation, self._ledger.member_count(OPTIMIZER_STATE), shape)

    def due(self, pile: PileIndex, key: object, walk_all: bool) -> bool:
        """Whether `pile` must be walked at this close."""
        return walk_all or key is None or pile in self.always or self._keys.get(pile) != key

    def walked(self, pile: PileIndex, key_before: object, key_after: object, changed: bool) -> None:
        """Remember the key after a walk; a change that the key before did not announce (seen
        on an audit or first close) makes the pile walked at every close."""
        if changed and key_before is not None and key_before == self._keys.get(pile):
            self.always.add(pile)
        self._keys[pile] = key_after
        if pile == WEIGHTS and changed:
            self._weights_walks += 1
        if pile == OPTIMIZER_STATE:
            self._sequences = holds_sequences(self._registry.live_optimizers())

    def facts(self, parameters: list[torch.Tensor]) -> ParameterFacts | None:
        """`ParameterFacts` of `parameters`, read again when they or the weights changed."""
        key = (self._registry.parameter_walks, self._weights_walks, len(parameters))
        if self._facts[0] != key:
            self._facts = (key, ParameterFacts.of(parameters))
        return self._facts[1]
