"""glibc's `malloc_info` text read by `main_arena_in_use`: the same figure the regular
expression it replaced read, on live texts and on texts of other shapes."""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import threading

import pytest

from memtui_agent.steps.step_signature import main_arena_in_use

_FORMER_MAIN_HEAP = re.compile(
    rb'<heap nr="0">.*?<total type="fast" count="\d+" size="(\d+)"/>\s*'
    rb'<total type="rest" count="\d+" size="(\d+)"/>.*?'
    rb'<system type="current" size="(\d+)"/>',
    re.DOTALL,
)
_FORMER_MMAPPED = re.compile(rb'</heap>.*<total type="mmap" count="\d+" size="(\d+)"/>', re.DOTALL)


def _former(text: bytes) -> int | None:
    """The reading before: two regular expressions over the whole text."""
    heap = _FORMER_MAIN_HEAP.search(text)
    if heap is None:
        return None
    fast, rest, system = (int(group) for group in heap.groups())
    mapped = _FORMER_MMAPPED.search(text)
    return system - fast - rest + (int(mapped.group(1)) if mapped else 0)


def _malloc_info_text() -> bytes:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.open_memstream.restype = ctypes.c_void_p
    libc.open_memstream.argtypes = [
        ctypes.POINTER(ctypes.c_char_p),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    libc.fclose.argtypes = [ctypes.c_void_p]
    libc.free.argtypes = [ctypes.c_void_p]
    buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    try:
        return ctypes.string_at(buffer, size.value)
    finally:
        libc.free(buffer)


def _with_other_arenas() -> bytes:
    """A live text while other threads hold blocks in arenas of their own (more `<heap>`s)."""
    ready, done = threading.Barrier(3), threading.Event()
    kept: list[bytes] = []

    def hold() -> None:
        kept.extend(bytes(2000) for _ in range(50))
        ready.wait()
        done.wait()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for thread in threads:
        thread.start()
    ready.wait()
    try:
        return _malloc_info_text()
    finally:
        done.set()
        for thread in threads:
            thread.join()


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to ask")
def test_live_texts_read_as_before() -> None:
    for text in (_malloc_info_text(), _with_other_arenas()):
        if b"<malloc" not in text:
            pytest.skip("not glibc's malloc_info")
        assert main_arena_in_use(text) == _former(text) is not None


HEAPS = b"""<malloc version="1">
<heap nr="0">
<sizes>
  <size from="17" to="32" total="64" count="2"/>
</sizes>
<total type="fast" count="2" size="64"/>
<total type="rest" count="73" size="92712"/>
<system type="current" size="1462272"/>
<system type="max" size="1507328"/>
</heap>
<heap nr="1">
<sizes>
</sizes>
<total type="fast" count="9" size="900"/>
<total type="rest" count="5" size="5000"/>
<system type="current" size="135168"/>
</heap>
<total type="fast" count="11" size="964"/>
<total type="rest" count="78" size="97712"/>
<total type="mmap" count="3" size="610304"/>
<system type="current" size="1597440"/>
</malloc>
"""


def test_the_main_heap_and_the_mapped_total_only() -> None:
    assert main_arena_in_use(HEAPS) == 1462272 - 64 - 92712 + 610304 == _former(HEAPS)


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"<malloc/>",
        HEAPS.replace(b'<heap nr="0">', b'<heap nr="7">'),
        HEAPS.split(b"</heap>")[0],  # cut inside the main heap
        HEAPS.replace(b'size="92712"', b'size="9x2"', 1),
        HEAPS.replace(b'<system type="current" size="1462272"/>', b""),
    ],
)
def test_other_shapes_read_as_nothing(text: bytes) -> None:
    assert main_arena_in_use(text) is None


def test_no_mapped_total_counts_nothing_mapped() -> None:
    text = HEAPS.replace(b'<total type="mmap" count="3" size="610304"/>\n', b"")
    assert main_arena_in_use(text) == 1462272 - 64 - 92712 == _former(text)
