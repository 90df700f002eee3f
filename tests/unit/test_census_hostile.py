"""A census never runs the job's code, stays inside its bounds, and an error costs that census only
(issue 32).

Each hostile object a job may hold is planted next to a tensor the census must still find: a
`__getattr__` that sleeps or raises, a `__getattribute__` that counts, a `__class__` property, a
lazily loading list, a dict key with a `__repr__`, a `MagicMock(spec=Tensor)` with a counting
`__torch_function__`, a module deferred by `importlib.util.LazyLoader`, a 5,000,000-item list,
an endless `__iter__`, a dead `weakref.proxy`, an int key of over 4,300 digits, a deeply nested
tuple key; and errors (MemoryError, RecursionError) raised inside the walk. Every counter of the
job's code must read zero after the census.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import tracemalloc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import pytest
import torch

from memtui_agent.memory import census as census_module
from memtui_agent.memory.census import MAX_OBJECTS, Namespace, take_census
from memtui_agent.memory.ledger import storages_of
from memtui_protocol.schema import CensusStop

CALLS: list[str] = []
"""Every call into the job's code below appends its name."""


def _bytes(tensor: torch.Tensor) -> int:
    return sum(nbytes for _key, nbytes, _dtype, _storage in storages_of(tensor))


class SleepyAttributes:
    """`__getattr__` that sleeps (a remote proxy): a census that asked would stall the step."""

    def __init__(self) -> None:
        self.kept = torch.randn(64)

    def __getattr__(self, name: str) -> Any:
        CALLS.append(f"sleepy.__getattr__({name})")
        time.sleep(1.0)
        raise AttributeError(name)


class RaisingAttributes:
    """`__getattr__` that raises KeyError (a config object): a census that asked would fail."""

    def __init__(self) -> None:
        self.kept = torch.randn(64)

    def __getattr__(self, name: str) -> Any:
        CALLS.append(f"raising.__getattr__({name})")
        raise KeyError(name)


class CountedAttributes:
    """`__getattribute__` that counts every lookup."""

    def __init__(self) -> None:
        self.kept = torch.randn(64)

    def __getattribute__(self, name: str) -> Any:
        CALLS.append(f"counted.__getattribute__({name})")
        return object.__getattribute__(self, name)


class Disguised:
    """`__class__` is a property claiming to be a tensor (what fooled `isinstance`)."""

    def __init__(self) -> None:
        self.kept = torch.randn(64)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        CALLS.append("disguised.__class__")
        return torch.Tensor


class LazyList(list):  # type: ignore[type-arg]
    """A list that loads its data when iterated, measured or indexed."""

    def __iter__(self) -> Iterator[Any]:
        CALLS.append("lazy.__iter__")
        return iter([bytearray(48 * 2**20)])

    def __len__(self) -> int:
        CALLS.append("lazy.__len__")
        return 1

    def __getitem__(self, index: Any) -> Any:
        CALLS.append("lazy.__getitem__")
        return bytearray(48 * 2**20)


class Endless:
    """An `__iter__` that never ends (a data stream)."""

    def __init__(self) -> None:
        self.kept = torch.randn(64)

    def __iter__(self) -> Iterator[int]:
        CALLS.append("endless.__iter__")
        while True:
            yield 0

    def __len__(self) -> int:
        CALLS.append("endless.__len__")
        return 10**9


class LoudKey:
    """A dict key whose `__repr__`, `__eq__` and `__hash__` are the job's code."""

    def __repr__(self) -> str:
        CALLS.append("key.__repr__")
        return "LoudKey()"

    def __eq__(self, other: object) -> bool:
        CALLS.append("key.__eq__")
        return self is other

    def __hash__(self) -> int:
        CALLS.append("key.__hash__")
        return 7


class CountingMock(MagicMock):
    """A `MagicMock(spec=Tensor)`: `isinstance(mock, Tensor)` is True, every attribute exists,
    and `__torch_function__` counts."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        CALLS.append("mock.__torch_function__")
        return NotImplemented


class Module:
    """A stand-in for a job's object holding one tensor, for deep nesting."""

    def __init__(self, kept: Any) -> None:
        self.kept = kept


def _lazy_module(folder: Path) -> Any:
    """A module deferred with `importlib.util.LazyLoader`: touching any attribute runs it."""
    source = folder / "deferred_job_module.py"
    source.write_text(
        "import sys\n"
        "sys.modules['tests.test_census_hostile'].CALLS.append('lazy module executed')\n"
        "import torch\nkept = torch.randn(64)\n"
    )
    spec = importlib.util.spec_from_file_location("deferred_job_module", source)
    assert spec is not None and spec.loader is not None
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _no_calls() -> Iterator[None]:
    CALLS.clear()
    yield
    CALLS.clear()


def test_hostile_objects_run_none_of_their_code_and_hide_no_tensor(tmp_path: Path) -> None:
    sys.modules.setdefault("tests.test_census_hostile", sys.modules[__name__])
    sleepy, raising, counted = SleepyAttributes(), RaisingAttributes(), CountedAttributes()
    disguised, endless = Disguised(), Endless()
    lazy = LazyList([torch.randn(64)])
    keyed = {LoudKey(): torch.randn(64)}
    mock = CountingMock(spec=torch.Tensor)
    assert isinstance(mock, torch.Tensor)
    lazy_module = _lazy_module(tmp_path)
    gone = Module(torch.randn(1))
    proxy = weakref.proxy(gone)
    del gone
    huge = {10**5000: torch.randn(64)}
    deep: Any = ()
    for _ in range(100_000):
        deep = (deep,)
    nested = {deep: torch.randn(64)}
    mock.reset_mock()
    CALLS.clear()
    namespace = {
        "sleepy": sleepy,
        "raising": raising,
        "counted": counted,
        "disguised": disguised,
        "endless": endless,
        "lazy": lazy,
        "keyed": keyed,
        "mock": mock,
        "lazy_module": lazy_module,
        "proxy": proxy,
        "huge": huge,
        "nested": nested,
    }
    census = take_census([Namespace(namespace)])
    assert CALLS == []
    assert mock.mock_calls == [] and not mock._mock_children  # no attribute was even looked up
    assert census.stopped is None and census.complete and census.error is None
    held = {name: holding.bytes for name, holding in census.holdings.items()}
    assert held == {
        "sleepy.kept": 256,
        "raising.kept": 256,
        "counted.kept": 256,
        "disguised.kept": 256,
        "endless.kept": 256,
        "lazy": 256,
        "keyed": 256,
        "huge": 256,
        "nested": 256,
    }
    assert census.visited < 1000


def test_paths_name_keys_only_by_plain_short_values() -> None:
    """A key is named as itself only when it is a short exact `str` or a small exact `int`."""

    class Name(str):
        def __repr__(self) -> str:
            CALLS.append("Name.__repr__")
            return "x"

    cache = {"step": torch.randn(4)}
    model = Module({Name("odd"): Module(torch.randn(4)), 3: torch.randn(4)})
    census = take_census([("cache", cache), ("model", model)])
    assert CALLS == []
    assert set(census.holdings) == {"cache", "model.kept"}


def test_a_five_million_item_list_stops_at_the_bound_and_the_rest_is_still_walked() -> None:
    """The list is read in chunks between checks of the bounds: the census stops at its object
    bound, says so, never copies the list, and names the holders queued beside it."""
    big = list(range(5_000_000))
    after = torch.randn(64)
    tracemalloc.start()
    try:
        census = take_census([("big", big), ("after", after)], max_objects=100_000, max_seconds=600)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert census.stopped is CensusStop.OBJECTS and not census.complete
    assert census.visited == 100_000
    assert census.holdings["after"].bytes == 256  # queued behind the list's first chunk
    assert peak < 4 * 2**20  # a copy of the list alone would be 38 MiB
    # With the default bounds it stops at one of them (which one depends on the machine).
    default = take_census([("big", big), ("after", after)])
    assert default.stopped in (CensusStop.OBJECTS, CensusStop.SECONDS)
    assert default.visited <= MAX_OBJECTS and "after" in default.holdings


def test_the_time_bound_is_checked_inside_a_huge_container() -> None:
    big = [Module(None) for _ in range(200_000)]
    census = take_census([("big", big)], max_seconds=0.0)
    assert census.stopped is CensusStop.SECONDS and census.visited <= 2 * 1024


@pytest.mark.parametrize("error", [MemoryError, RecursionError, KeyError])
def test_an_error_inside_the_walk_ends_that_census_only(
    monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
) -> None:
    """What was found before is kept, the error is handed back without its traceback (whose
    frames would hold the job's objects), and the next census runs."""
    first, second = Module(torch.randn(64)), Module(torch.randn(64))
    real = census_module._visit_node

    def failing(*_args: Any) -> None:
        raise error("planted")

    monkeypatch.setattr(census_module, "_visit_node", failing)
    attached = torch.randn(4, requires_grad=True) * 2
    census = take_census([("first", first), ("attached", attached), ("second", second)])
    assert census.stopped is CensusStop.ERROR and type(census.error) is error
    assert census.error.__traceback__ is None
    assert census.holdings["first.kept"].bytes == 256
    monkeypatch.setattr(census_module, "_visit_node", real)
    again = take_census([("first", first), ("attached", attached), ("second", second)])
    assert again.stopped is None and set(again.holdings) == {
        "first.kept",
        "attached",
        "second.kept",
    }


class Loud(torch.Tensor):
    """A tensor subclass whose Python runs on any torch call or overridden method."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        CALLS.append("Loud.__torch_function__")
        # torch's own carries no annotations
        return super().__torch_function__(func, types, args, kwargs or {})  # type: ignore[no-untyped-call]

    def untyped_storage(self) -> Any:
        CALLS.append("Loud.untyped_storage")
        return super().untyped_storage()


class Wrapper(torch.Tensor):
    """A wrapper subclass (no storage of its own): its memory is its inner tensor's."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        made.inner = inner  # type: ignore[method-assign,assignment]  # shadows Tensor.inner
        return made

    @classmethod  # torch types Tensor's as a plain function: a subclass's is a classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        CALLS.append("Wrapper.__torch_dispatch__")
        raise NotImplementedError


class Watching(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode the job left on around its loop (a FLOP counter, a tracer)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        CALLS.append(f"mode {func}")
        return func(*args, **(kwargs or {}))


def test_tensor_subclasses_and_modes_run_none_of_their_python() -> None:
    """Storages, gradients and graph nodes are read through torch's C descriptors with its
    Python dispatch off: a subclass's overrides, `__torch_function__`, `__torch_dispatch__` and
    a dispatch mode the job left active never run."""
    loud = torch.randn(64).as_subclass(Loud)
    wrapped = Wrapper(torch.randn(64))
    sparse = torch.randn(8, 8).relu().to_sparse()
    CALLS.clear()
    with Watching():  # type: ignore[no-untyped-call]  # TorchDispatchMode.__init__ is untyped
        census = take_census([("loud", loud), ("wrapped", wrapped), ("sparse", sparse)])
    assert CALLS == []
    assert census.holdings["loud"].bytes == 256
    assert census.holdings["wrapped"].bytes == 256  # its inner tensor, under the wrapper's name
    assert census.holdings["sparse"].bytes == sum(
        nbytes for _key, nbytes, _dtype, _storage in storages_of(sparse)
    )


def test_the_close_hands_a_census_error_on_and_keeps_the_census_record() -> None:
    """At a close: the census's error goes to the agent (which says it once), never up into
    the step; finding the roots failing is the same."""
    from memtui_agent.startup.parts import build_parts
    from memtui_protocol.config import AgentConfig

    told: list[tuple[str, BaseException, str]] = []
    parts = build_parts(AgentConfig(), lambda message: None, lambda *said: told.append(said))

    def no_roots() -> list[Any]:
        raise RecursionError("planted while finding the roots")

    census = parts.closer._take(no_roots)
    assert census.stopped is CensusStop.ERROR and census.error is None and not census.complete
    ((component, error, effect),) = told
    assert component == "census" and type(error) is RecursionError
    assert "later censuses run" in effect
