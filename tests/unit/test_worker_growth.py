"""The DataLoader workers' growth rule (`memory.worker_growth`), on hand-made samples.

The series are shaped as measured: two workers of tests/fixtures/workers/dataset_workers.py
`list` grow by tens of MiB a second for seconds, then a few MiB a second; its `numpy` twin's
rise by under 1 MiB in all once started.
"""

from __future__ import annotations

from memtui_agent.memory.worker_growth import MIN_TOTAL, NOISE, WINDOW, WorkerGrowth
from memtui_protocol import schema

MiB = 1024 * 1024


def _reading(growth: int, count: int = 2) -> schema.Workers:
    return schema.Workers(count=count, uss=20 * MiB + growth, growth=growth)


def _feed(growth: WorkerGrowth, series: list[int], steps_apart: int = 10) -> list[int]:
    """One new sample per close, `steps_apart` steps apart; the closes that found it sustained."""
    found = []
    for index, value in enumerate(series):
        step = 1 + index * steps_apart
        if growth.at_close(step, index + 1, _reading(value)) is not None:
            found.append(step)
    return found


def test_growth_at_every_sample_is_sustained_after_the_window() -> None:
    growth = WorkerGrowth()
    series = [index * 4 * MiB for index in range(WINDOW + 3)]
    found = _feed(growth, series)
    assert found and found[0] == 1 + WINDOW * 10  # the first close with a full window
    sustained = growth.at_close(500, 100, _reading(series[-1] + 4 * MiB))
    assert sustained is not None
    assert sustained.since == 1
    assert sustained.growth == series[-1] + 4 * MiB
    assert sustained.per_step == sustained.growth // (500 - 1)
    assert growth.highest == series[-1] + 4 * MiB


def test_a_healthy_worker_that_warms_up_then_stays_flat_is_not() -> None:
    """A start-up rise (the workers' imports and first buffers), then a few hundred KiB."""
    series = [0, 6 * MiB, 7 * MiB] + [7 * MiB + index * 150 * 1024 for index in range(20)]
    assert _feed(WorkerGrowth(), series) == []


def test_noise_above_the_floor_but_small_in_all_is_not() -> None:
    series = [index * (NOISE + 1024) for index in range(3 * WINDOW)]
    assert _feed(WorkerGrowth(), series) == []


def test_a_slow_steady_growth_is_sustained_once_large() -> None:
    """1 MiB a sample: too slow for the window's minimum, found once past `MIN_TOTAL`."""
    series = [index * MiB for index in range(MIN_TOTAL // MiB + 2)]
    found = _feed(WorkerGrowth(), series)
    assert found and found[0] >= 1 + (MIN_TOTAL // MiB) * 10


def test_few_samples_of_a_large_growth_suffice() -> None:
    """A loaded machine's sampler wakes late: 4 points, each 30 MiB above the last."""
    found = _feed(WorkerGrowth(), [0, 30 * MiB, 60 * MiB, 90 * MiB])
    assert found == [31]
    assert _feed(WorkerGrowth(), [0, 30 * MiB, 30 * MiB, 60 * MiB]) == []


def test_the_same_sample_seen_at_many_closes_counts_once() -> None:
    """Closes come faster than samples: a close without a new sample adds no point."""
    growth = WorkerGrowth()
    step = 0
    for sample in range(1, WINDOW + 1):
        for _ in range(50):
            step += 1
            assert growth.at_close(step, sample, _reading(sample * 8 * MiB)) is None
    assert growth.at_close(step + 1, WINDOW + 1, _reading((WINDOW + 1) * 8 * MiB)) is not None


def test_a_new_set_of_workers_starts_afresh() -> None:
    """A new epoch's workers (`persistent_workers=False`): their growth restarts from zero, and
    the old set's window is not carried into theirs."""
    growth = WorkerGrowth()
    _feed(growth, [index * 8 * MiB for index in range(WINDOW)])
    assert growth.at_close(1000, 50, _reading(MiB)) is None
    assert growth.at_close(1010, 51, _reading(9 * MiB)) is None
    assert growth.highest == (WINDOW - 1) * 8 * MiB


def test_no_workers_forgets_them() -> None:
    growth = WorkerGrowth()
    _feed(growth, [index * 8 * MiB for index in range(WINDOW)])
    assert growth.at_close(900, 40, None) is None
    assert growth.at_close(910, 41, _reading(80 * MiB, count=2)) is None
