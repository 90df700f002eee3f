"""The ledger's step marks on steps that do not watch every pile (docs/numbers.md#not-known).

Between measured steps the gradient hooks are off and the gradients are counted beside the
ledger at each close; the ledger's own gradients pile is then empty. The marks a step starts
from must still hold the gradients alive at its opening, and the ledger says which piles it
watched through the step without their bytes moving (`steady`): the only ones a step whose
peak moment is unknown may state at that moment.
"""

from __future__ import annotations

import torch

from memtui_agent.memory.ledger import GRADIENTS, WEIGHTS, Ledger
from memtui_protocol import schema
from memtui_protocol.schema import Pile


def unwatched_ledger(weight: torch.Tensor) -> Ledger:
    """A ledger holding `weight` whose gradients are counted beside it (hooks disarmed)."""
    ledger = Ledger()
    ledger.sync(WEIGHTS, [weight])
    ledger.sync(GRADIENTS, [])
    ledger.watching_gradients = False
    return ledger


def test_the_marks_start_from_the_gradients_alive_at_the_opening() -> None:
    """A step that arms at its first root call, after `zero_grad()` freed the gradients it
    opened with: its high and its peak still hold them (they were alive at its opening)."""
    weight = torch.zeros(64)
    ledger = unwatched_ledger(weight)
    ledger.reset_step(start_gradients=640)
    ledger.watching_gradients = True  # armed at the first root call: nothing alive to rejoin
    _, high, peak, _ = ledger.at_close()
    assert high == schema.Piles(256, 640, 0, 0)
    assert peak == schema.Piles(256, 640, 0, 0)


def test_gradients_the_ledger_holds_are_not_counted_twice() -> None:
    """Watched from the opening, the ledger's own gradients are the opening's: the count
    outside it is not added."""
    weight, grad = torch.zeros(64), torch.zeros(32)
    ledger = Ledger()
    ledger.sync(WEIGHTS, [weight])
    ledger.sync(GRADIENTS, [grad])
    ledger.reset_step(start_gradients=128)
    _, high, peak, _ = ledger.at_close()
    assert high.gradients == 128 and peak == schema.Piles(256, 128, 0, 0)


def test_steady_names_the_piles_watched_through_the_step_that_never_moved() -> None:
    weight, grad = torch.zeros(64), torch.zeros(32)
    ledger = Ledger()
    ledger.sync(WEIGHTS, [weight])
    ledger.sync(GRADIENTS, [grad])
    ledger.reset_step()
    ledger.acquire_activation((1 << 40) | 1, 4096, "float32", 0)  # activations come and go
    ledger.release_activation((1 << 40) | 1)
    assert ledger.steady() == {Pile.WEIGHTS, Pile.GRADIENTS, Pile.OPTIMIZER_STATE}
    assert ledger.gradients_watched()
    other = torch.zeros(16)
    ledger.sync(WEIGHTS, [weight, other])  # a close's recount finds a new weight
    assert ledger.steady() == {Pile.GRADIENTS, Pile.OPTIMIZER_STATE}
    ledger.reset_step()
    assert Pile.WEIGHTS in ledger.steady()


def test_gradients_not_watched_from_the_opening_are_never_steady() -> None:
    ledger = unwatched_ledger(torch.zeros(64))
    ledger.reset_step(start_gradients=640)
    assert ledger.steady() == {Pile.WEIGHTS, Pile.OPTIMIZER_STATE}
    assert not ledger.gradients_watched()
    ledger.watching_gradients = True  # armed during the step: watched from there only
    assert Pile.GRADIENTS not in ledger.steady() and not ledger.gradients_watched()
