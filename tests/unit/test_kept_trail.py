"""The kept trail: the latest count at or before a step, bounded against a hostile stream."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from memtui.model.kept_trail import MAX_ENTRIES, KeptTrail, kept_words
from memtui_protocol import schema


def _kept(size: int) -> schema.Kept:
    return schema.Kept(bytes=size, tensors=1, holders=[schema.KeptHolder("ema", size, 1)])


def test_the_latest_count_at_or_before_a_step(make_step: Callable[[int], schema.Step]) -> None:
    trail = KeptTrail()
    for number in range(1, 30):
        step = make_step(number)
        if number % 10 == 5:
            step = msgspec.structs.replace(step, kept=_kept(number * 1024))
        trail.stepped(step)
    assert trail.at(4) is None
    found = trail.at(14)
    assert found is not None and (found.step, found.kept.bytes) == (5, 5 * 1024)
    last = trail.last()
    assert last is not None and last.step == 25
    assert kept_words(last) == (
        "kept outside the piles at step 25 (its census): 25.00 KiB in 1 tensor; ema 25.00 KiB"
    )


def test_a_stream_of_counts_keeps_at_most_its_bound(
    make_step: Callable[[int], schema.Step],
) -> None:
    trail = KeptTrail()
    for number in range(1, 3 * MAX_ENTRIES):
        trail.stepped(msgspec.structs.replace(make_step(number), kept=_kept(number)))
    assert len(trail.counts) <= MAX_ENTRIES and len(trail.steps) == len(trail.counts)
    last = trail.last()
    assert last is not None and last.step == 3 * MAX_ENTRIES - 1
