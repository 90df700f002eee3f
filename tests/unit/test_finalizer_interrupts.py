"""Where a Ctrl-C is kept for the job's code (`finalizer_interrupts.dropped_there`)."""

from __future__ import annotations

import sys
import weakref

from memtui_agent.memory import finalizer_interrupts
from memtui_agent.memory.finalizer_interrupts import dropped_there


def test_the_standard_librarys_weakref_callbacks_keep_a_ctrl_c_for_the_job() -> None:
    """A CI run lost a Ctrl-C in `WeakSet._remove` (the agent's set of graph markers): Python
    drops what a weakref callback raises, whoever owns the collection."""
    holders: tuple[object, ...] = (
        weakref.WeakSet(),
        weakref.WeakValueDictionary(),
        weakref.WeakKeyDictionary(),
    )
    for holder in holders:
        assert dropped_there(getattr(holder, "_remove").__code__)  # noqa: B009  # private


def test_the_agents_code_keeps_it_and_the_jobs_code_runs_the_handler() -> None:
    assert dropped_there(finalizer_interrupts.hand_back.__code__)
    assert not dropped_there(sys._getframe().f_code)  # a test stands in for the job's code
