"""Reading the job's objects without running any of the job's Python code.

A census walks whatever the job's names hold. Any Python-level access to those objects can run
the job's code: an attribute lookup runs `__getattribute__` and `__getattr__` (a lazily loaded
module executes, a proxy sleeps or raises); `isinstance` reads `__class__`, which a property or
a mock answers; iterating a container subclass runs its `__iter__` (a lazily loading list, an
endless one); `repr` of a dict key runs its `__repr__`; even `type(x) in {...}` hashes the
class through its metaclass. So everything here goes through what the interpreter itself
exposes, in C:

- an object's class is `type(obj)` (its `ob_type`), and its bases are read from the class's
  `__mro__` slot through `type`'s own descriptor, never from the class;
- classes are compared by identity (`is`), or by `id` in sets, never hashed;
- builtin containers and their subclasses are read through the base type's C methods
  (`list.__getitem__`, `dict.items`, `set.__iter__`...), which never call an override;
- an instance's attributes come from its `__dict__` slot through the C getset descriptor that
  created it (found in the class namespaces, and checked to be a C getset, so a class that
  shadows `__dict__` with a property is not asked), and from its `__slots__` through their C
  member descriptors;
- any other object is read with `gc.get_referents`, its C `tp_traverse`;
- names are made only from exact `str` of bounded length and small exact `int`s, never `repr`
  of anything else (a key is then named by its type, an item by its index).
"""

from __future__ import annotations

import gc
import types
from collections import deque
from collections.abc import Iterator
from typing import Any

_MRO = type.__dict__["__mro__"]
_NAME = type.__dict__["__name__"]
_NAMESPACE = type.__dict__["__dict__"]
_FLAGS = type.__dict__["__flags__"]
HEAP_TYPE = 1 << 9
_GETSET = types.GetSetDescriptorType
_MEMBER = types.MemberDescriptorType
_STR = str.__str__
MAX_NAME = 40
"""Characters of a key or attribute name kept in a holder's path."""
MAX_INT_KEY = 10**12


def mro(cls: type) -> tuple[type, ...]:
    """The class's method resolution order, read from its slot (a metaclass cannot answer)."""
    found: tuple[type, ...] = _MRO.__get__(cls)
    return found


def derives(cls: type, base: type) -> bool:
    """`base` is `cls` or one of its bases, compared by identity."""
    return any(entry is base for entry in mro(cls))


def heap_type(cls: type) -> bool:
    """A class defined in Python (or created at run time), as opposed to a static C type."""
    flags: int = _FLAGS.__get__(cls)
    return bool(flags & HEAP_TYPE)


def type_name(cls: type) -> str:
    """The class's `__name__` from its slot, as a plain `str`, bounded."""
    return _STR(_NAME.__get__(cls))[:MAX_NAME]


def namespace_entry(cls: type, name: str) -> Any:
    """`cls.__dict__[name]` without a lookup on `cls` (None when absent)."""
    return _NAMESPACE.__get__(cls).get(name)


def c_getset(cls: type, name: str) -> Any:
    """The first C getset descriptor called `name` in `cls`'s bases (a Python-level entry of
    that name, a property for one, is passed over: it would run the job's code)."""
    for entry in mro(cls):
        found = namespace_entry(entry, name)
        if type(found) is _GETSET:
            return found
    return None


def c_member_names(cls: type) -> list[tuple[str, Any]]:
    """`(name, C member descriptor)` of every slot in `cls`'s bases (`__slots__`, and the C
    members of builtin bases)."""
    found = []
    for entry in mro(cls):
        for name, value in _NAMESPACE.__get__(entry).items():
            if type(value) is _MEMBER and type(name) is str:
                found.append((name, value))
    return found


class TypeFacts:
    """What the walk needs to know of one class, found once per census: how its instances'
    attributes are read. Holds the class only while the census runs."""

    __slots__ = ("cls", "instance_dict", "members")

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.instance_dict = c_getset(cls, "__dict__")
        self.members = c_member_names(cls)


def attributes(obj: Any, facts: TypeFacts) -> Iterator[tuple[str, Any]]:
    """An object's attributes by name: its instance dict's entries (keys that are not exact
    strings named by type), then its slots; none of its own code runs."""
    if facts.instance_dict is not None:
        try:
            found = facts.instance_dict.__get__(obj)
        except Exception:  # a C base that refuses: nothing to read
            found = None
        if type(found) is dict:
            for name, value in dict.items(found):
                yield attribute_name(name), value
    for name, member in facts.members:
        try:
            value = member.__get__(obj)
        except Exception:  # an empty slot
            continue
        yield name, value


def referents(obj: Any) -> list[Any]:
    """What `obj` refers to, as the garbage collector sees it (C `tp_traverse`)."""
    return gc.get_referents(obj)


def attribute_name(name: Any) -> str:
    """An attribute's name for a path: an exact `str`, bounded; anything else by its type."""
    if type(name) is str:
        return name if len(name) <= MAX_NAME else name[: MAX_NAME - 3] + "..."
    return f"<{type_name(type(name))}>"


def key_text(key: Any) -> str:
    """A dict key as a path shows it: a short exact `str` or small exact `int` as itself, any
    other key by its type (never its `repr`: a key's `__repr__` is the job's code, and a huge
    int or a deeply nested tuple costs unbounded time)."""
    kind = type(key)
    if kind is str:
        if len(key) <= MAX_NAME:
            return str.__repr__(key)
        return str.__repr__(key[: MAX_NAME - 3]) + "..."
    if kind is int and -MAX_INT_KEY < key < MAX_INT_KEY:
        return int.__repr__(key)
    if kind is bool or key is None:
        return "True" if key is True else "False" if key is False else "None"
    return f"<{type_name(kind)}>"


CONTAINERS: tuple[type, ...] = (dict, list, tuple, set, frozenset, deque)
"""Builtin containers, read through their own C methods (subclasses too)."""


def container_base(cls: type) -> type | None:
    """The builtin container `cls` is or derives from (None for none)."""
    for entry in mro(cls):
        for base in CONTAINERS:
            if entry is base:
                return base
    return None


def container_length(value: Any, base: type) -> int:
    """The number of items, through the base type's C `__len__`."""
    length: int = base.__len__(value)  # type: ignore[attr-defined]
    return length


def deque_maxlen(value: Any) -> int | None:
    """A deque's `maxlen` through deque's own descriptor."""
    found: int | None = deque.__dict__["maxlen"].__get__(value)
    return found
