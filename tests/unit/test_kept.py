"""The tensors a job keeps outside every pile: when a close counts them (`KeptSchedule`) and the
figure a census gives (`kept_of`), checked against storages counted here."""

from __future__ import annotations

from itertools import pairwise

import torch

from memtui_agent.memory.census import take_census
from memtui_agent.memory.kept import FIRST, MAX_GAP, KeptSchedule, kept_of
from memtui_agent.memory.ledger import storages_of
from memtui_protocol.schema import MAX_KEPT_HOLDERS, KeptHolder


def _keys(*tensors: torch.Tensor) -> dict[int, int]:
    return {key: nbytes for t in tensors for key, nbytes, _d, _s in storages_of(t)}


def _due_steps(last: int, new_model_at: int | None = None) -> list[int]:
    schedule = KeptSchedule()
    due = []
    for step in range(1, last + 1):
        generation = 1 if new_model_at is not None and step >= new_model_at else 0
        if schedule.due(step, generation):
            due.append(step)
            schedule.counted(step, generation)
    return due


def test_counted_at_the_third_close_then_at_doubling_gaps_up_to_the_cap() -> None:
    due = _due_steps(3000)
    assert due[:6] == [FIRST, 9, 21, 45, 93, 189]
    gaps = [later - earlier for earlier, later in pairwise(due)]
    assert max(gaps) == MAX_GAP and gaps[-1] == MAX_GAP


def test_a_new_model_is_counted_at_its_first_close() -> None:
    """Step 14 is the first close after the registry's generation moved; the doubling goes on
    from where it was."""
    assert _due_steps(50, new_model_at=14) == [FIRST, 9, 14, 21, 45]


def test_a_census_stopped_at_its_bound_puts_the_next_count_at_the_longest_gap() -> None:
    schedule = KeptSchedule()
    assert schedule.due(FIRST, 0)
    schedule.counted(FIRST, 0, complete=False)
    assert not schedule.due(FIRST + MAX_GAP - 1, 0) and schedule.due(FIRST + MAX_GAP, 0)


def test_the_figure_counts_each_storage_once_and_leaves_the_piles_out() -> None:
    """A list of tensors and a view of one of them under another name: the storage once, under
    the holder the walk reached first; a weight's storage (in a pile) and a held activation
    (the activations pile's) are in no holder's bytes."""
    ema = [torch.zeros(100), torch.zeros(50)]
    weight = torch.nn.Parameter(torch.ones(10))
    saved = torch.zeros(30)
    side = {"view": ema[0][:10], "saved": saved, "weight": weight}
    census = take_census(
        [("ema", ema), ("side", side)],
        excluded=frozenset(_keys(weight)),
        activations=frozenset(_keys(saved)),
    )
    kept = kept_of(census, frozenset(_keys(saved)))
    assert kept.holders == [KeptHolder("ema", sum(_keys(*ema).values()), 2)]
    assert kept.bytes == 150 * 4 and kept.tensors == 2


def test_a_census_stopped_at_its_bound_states_no_total() -> None:
    """The holders it found are real; the total would be a lower bound, so it is not stated."""
    many = [torch.zeros(1) for _ in range(50)]
    census = take_census([("many", many), ("late", torch.zeros(8))], max_objects=10)
    assert not census.complete
    kept = kept_of(census, frozenset())
    assert kept.bytes is None


def test_the_largest_holders_are_named_and_all_are_counted() -> None:
    holders = [(f"t{index}", torch.zeros(index + 1)) for index in range(MAX_KEPT_HOLDERS + 4)]
    census = take_census(holders)
    kept = kept_of(census, frozenset())
    assert len(kept.holders) == MAX_KEPT_HOLDERS
    assert kept.holders[0] == KeptHolder(f"t{MAX_KEPT_HOLDERS + 3}", (MAX_KEPT_HOLDERS + 4) * 4, 1)
    assert kept.bytes == sum(4 * (index + 1) for index in range(MAX_KEPT_HOLDERS + 4))
    assert kept.tensors == MAX_KEPT_HOLDERS + 4
