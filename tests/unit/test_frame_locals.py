"""Frame locals are read for a census without the frame keeping them alive afterwards (issue 32).

On Python 3.10-3.12, `frame.f_locals` leaves a snapshot dict on the frame that holds every local
until the next read: a training loop's `del tmp` then freed nothing. The census reads the fast
locals where the interpreter keeps them (`job/frame_locals.py`), checked on every frame.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any

import pytest
import torch

from memtui_agent.job.frame_locals import FastLocals, frame_locals
from memtui_agent.job.modules import ModuleRegistry
from memtui_agent.job.names import census_roots
from memtui_agent.memory.census import take_census

TEN_MIB = 10 * 2**20


def _registry() -> ModuleRegistry:
    return ModuleRegistry(lambda names: None)


def test_a_deleted_temporary_is_freed_at_once_after_a_census_read_its_frame() -> None:
    def train() -> tuple[bool, bool]:
        tmp = torch.empty(TEN_MIB, dtype=torch.uint8)
        alive = weakref.ref(tmp)
        census = take_census(census_roots(_registry(), sys._getframe()))
        found = "tmp (local of " in " ".join(census.holdings)
        del tmp, census
        return found, alive() is None

    found, freed = train()
    assert found  # the census did see the local
    assert freed  # and the job's `del` freed it at once


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="PEP 667: f_locals keeps nothing")
def test_what_f_locals_would_have_kept() -> None:
    """The hazard itself: reading `f_locals` keeps a deleted local alive on this Python."""

    def train() -> bool:
        tmp = torch.empty(TEN_MIB, dtype=torch.uint8)
        alive = weakref.ref(tmp)
        sys._getframe().f_locals  # noqa: B018 - what the census used to do
        del tmp
        return alive() is None

    assert not train()


def test_locals_of_running_and_finished_frames_are_read_by_identity() -> None:
    marker = object()

    def running(argument: object) -> list[tuple[str, Any]] | None:
        inside = [argument]

        def uses() -> object:
            return inside

        return frame_locals(sys._getframe())

    found = dict(running(marker) or [])
    assert found["argument"] is marker and found["inside"] == [marker] and callable(found["uses"])

    def failing(argument: object) -> None:
        kept = [argument]  # noqa: F841 - read from the traceback's frame
        raise ValueError

    with pytest.raises(ValueError) as caught:
        failing(marker)
    traceback = caught.value.__traceback__
    assert traceback is not None
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    found = dict(frame_locals(traceback.tb_frame) or [])
    assert found["argument"] is marker and found["kept"] == [marker]


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="3.13+ reads through the proxy")
def test_a_frame_that_does_not_check_out_gives_no_locals() -> None:
    """A layout off by one word fails the checks against the frame's own code, globals and
    builtins: nothing is read (the census then has no locals of that frame), nothing guessed."""
    reader = FastLocals()
    assert reader.working and reader.layout is not None
    reader.layout = dataclasses.replace(reader.layout, code=reader.layout.code + 8)
    assert reader.read(sys._getframe()) is None
