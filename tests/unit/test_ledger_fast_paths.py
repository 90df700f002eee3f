"""The ledger's per-event fast paths against its general ones.

`acquire_activation`, `release_activation`, `claim_gradient` and the free callback inline the
accounting (`_account`, `_set_mask`, `_new_entry`, `_drop_entry`) for their common case, because
they run for every saved tensor and every gradient. Here a reference ledger takes the general
path for every event, and random interleavings of packs, releases, gradient claims, frees and
close-time syncs must leave both with the same figures: piles, high-water marks, peak, dtype
inventories and the per-module activation bytes, after every event. Every storage holds at
least one byte: the hooks hand the ledger no empty one (`CountingHooks.pack`, `grad_ready`).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from memtui_agent.memory.ledger import (
    ACTIVATION_BIT,
    ACTIVATIONS,
    GRADIENTS,
    NO_PILE,
    Key,
    Ledger,
    plain_storage,
)


class GeneralLedger(Ledger):
    """Every event through the general accounting: what the fast paths must equal."""

    def acquire_activation(self, key: Key, nbytes: int, dtype: str, module: int) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.act_refs += 1
                if entry.act_refs == 1:
                    entry.module = module
                    self._set_mask(key, entry, entry.mask | ACTIVATION_BIT)
                return
            entry = self._entries[key] = self._new_entry(nbytes, dtype)
            entry.act_refs = 1
            entry.module = module
            entry.mask = ACTIVATION_BIT
            entry.pile = int(ACTIVATIONS)
            self._account(ACTIVATIONS, entry, nbytes)

    def release_activation(self, key: Key) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.act_refs == 0:
                return
            entry.act_refs -= 1
            if entry.act_refs:
                return
            if entry.mask != ACTIVATION_BIT:
                self._set_mask(key, entry, entry.mask & ~ACTIVATION_BIT)
                return
            entry.mask = 0
            entry.pile = NO_PILE
            self._account(ACTIVATIONS, entry, -entry.nbytes)
            self._drop_entry(key, entry)

    def claim_gradient(
        self,
        key: Key,
        nbytes: int,
        dtype: str,
        storage: torch.UntypedStorage,
        tensor: torch.Tensor,
    ) -> None:
        self.claim(GRADIENTS, key, nbytes, dtype, storage, tensor)

    def _freed(self, ref: Any) -> None:
        with self._lock:
            key = self._ref_keys.pop(id(ref), None)
            if key is None:
                return
            entry = self._entries.get(key)
            if entry is None or entry.ref is not ref:
                return
            for members in self._members:
                members.discard(key)
            self._membership_changes += 1
            self._set_mask(key, entry, 0)


def key_of(tensor: torch.Tensor) -> Key:
    """The ledger's key of a plain tensor's storage."""
    found = plain_storage(tensor)
    assert found is not None
    return found[0]


def figures(ledger: Ledger) -> tuple[object, ...]:
    """Everything a step reports from the ledger, and what the next events build on."""
    with ledger._lock:
        dtypes = [{name: tuple(stat) for name, stat in pile.items()} for pile in ledger._dtypes]
        return (
            list(ledger.piles),
            list(ledger.max),
            ledger.peak_total,
            dtypes,
            dict(ledger._module_live),
            dict(ledger._module_max),
            {pile: sorted(members) for pile, members in enumerate(ledger._members)},
            sorted(ledger._entries),
            ledger.at_close(),
            ledger.top_modules(8),
            ledger.steady(),
        )


def test_fast_paths_keep_the_figures_of_the_general_paths() -> None:
    for seed in range(12):
        rng = random.Random(seed)
        fast, general = Ledger(), GeneralLedger()
        acts: list[Key] = []
        grads: list[torch.Tensor] = []
        for index in range(400):
            choice = rng.random()
            if choice < 0.3:
                # A fresh activation, or one more save of a storage already held (an
                # activation's, or a gradient's: a storage in two piles).
                pool = acts + [key_of(grad) for grad in grads]
                fresh = ((index + 1) << 8) | 0x55
                key = rng.choice(pool) if pool and rng.random() < 0.25 else fresh
                nbytes = rng.randrange(1, 5000)
                dtype, module = rng.choice(["float32", "bfloat16"]), rng.randrange(-1, 4)
                for ledger in (fast, general):
                    ledger.acquire_activation(key, nbytes, dtype, module)
                acts.append(key)
            elif choice < 0.55 and acts:
                key = acts.pop(rng.randrange(len(acts)))
                for ledger in (fast, general):
                    ledger.release_activation(key)
            elif choice < 0.8:
                grad = torch.empty(rng.randrange(1, 3000), dtype=torch.uint8)
                if grads and rng.random() < 0.1:
                    grad = grads[rng.randrange(len(grads))]  # claimed again
                found = plain_storage(grad)
                assert found is not None
                key, nbytes, dtype, storage = found
                for ledger in (fast, general):
                    ledger.claim_gradient(key, nbytes, dtype, storage, grad)
                grads.append(grad)
                del storage, found
            elif choice < 0.95 and grads:
                del grads[rng.randrange(len(grads))]  # its storage's free callbacks
            else:
                live = [g for g in grads if rng.random() < 0.9]
                assert fast.sync(GRADIENTS, live) == general.sync(GRADIENTS, live)
            assert figures(fast) == figures(general), (seed, index)
        grads.clear()
        assert figures(fast) == figures(general), seed


def test_a_close_confirms_claimed_gradients_without_changing_them() -> None:
    """`sync` of exactly the gradients the hooks claimed changes nothing (its quick check);
    one gradient more, one fewer, one whose storage left the pile or one moved to another
    storage still changes the pile."""
    ledger = Ledger()
    grads = [torch.empty(8 + index) for index in range(5)]
    for grad in grads:
        found = plain_storage(grad)
        assert found is not None
        ledger.claim_gradient(*found, grad)
    total = sum(g.untyped_storage().nbytes() for g in grads)
    assert ledger.sync(GRADIENTS, grads) is False
    assert ledger.current().gradients == total
    assert ledger.sync(GRADIENTS, grads[:-1]) is True
    assert ledger.current().gradients == total - grads[-1].untyped_storage().nbytes()
    assert ledger.sync(GRADIENTS, grads) is True
    assert ledger.current().gradients == total
    ledger._clear_bit(key_of(grads[1]), GRADIENTS)  # left the pile (as at a free)
    assert ledger.sync(GRADIENTS, grads) is True  # same tensors, same pointers: counted again
    assert ledger.current().gradients == total
    grads[0].set_(torch.empty(3).untyped_storage())  # the same tensor on another storage
    assert ledger.sync(GRADIENTS, grads) is True
    assert ledger.current().gradients == total - 32 + 12
