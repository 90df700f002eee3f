"""A Ctrl-C (or any exception a job's signal handler raises) that lands in one of the agent's
finalizers goes back to the job.

Python runs a signal's handler in whatever Python code the main thread executes next, and the
agent's finalizers (a saved activation's `__del__`, the ledger's weakref callback for a freed
storage, the id-table cleanups) run often, in the middle of the job's backward. An exception
that leaves a finalizer is printed as "Exception ignored" and dropped: under the agent, 33 of 200
Ctrl-Cs sent while a small model trained were lost (the job trained on), and 0 of 200 without
it. The agent puts a handler in front of the job's (`keep_ctrl_c_for_the_job`, Python's default
or the job's own) that simulates the signal again a moment later whenever it arrives in the
agent's code, so the job's handler runs once, in the job's code. For a handler the job installs
after the agent started, a finalizer catches what that handler raised in its body and calls
`hand_back`, which raises the same exception in the main thread once the finalizer has returned;
the job's handler is not run a second time (a job counting its Ctrl-Cs sees one). Both act from
another thread, started without waiting for it (`_soon`).
"""

from __future__ import annotations

import _thread
import ctypes
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from types import CodeType, FrameType

AGENT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""The agent's own code: a Ctrl-C that arrives while it runs is kept for the job's code."""

_DROPPING: frozenset[CodeType] = frozenset(
    getattr(holder(), "_remove").__code__  # noqa: B009  # private: mypy knows no `_remove`
    for holder in (weakref.WeakSet, weakref.WeakValueDictionary, weakref.WeakKeyDictionary)
)
"""The standard library's weakref callbacks that forget a freed item (the agent's `WeakSet` of
graph markers has one per marker): an exception raised in them is dropped like a finalizer's,
so a Ctrl-C arriving there is kept for the job's code too, whoever owns the collection (a
CI run lost one in `WeakSet._remove`)."""


def keep_ctrl_c_for_the_job() -> None:
    """Put `DeferringHandler` in front of the job's SIGINT handler (Python's default or the
    job's own). Python raises a signal's exception at the first check point the main thread
    reaches, and a finalizer's first check point comes before any `try` in it: only a handler
    can keep the interrupt out of the agent's code. Only the main thread may install one; a
    signal ignored or left to the system stays as it is, and `hand_back` covers a handler the
    job installs later."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and not isinstance(handler, DeferringHandler):
        signal.signal(signal.SIGINT, DeferringHandler(handler))


def restore_ctrl_c() -> None:
    """The job's handler back, if the agent's is still the one installed (at the agent's
    stop)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGINT)
    if isinstance(handler, DeferringHandler):
        signal.signal(signal.SIGINT, handler.job_handler)


class DeferringHandler:
    """The job's SIGINT handler, run as it would be, except while the main thread runs the
    agent's code: then the signal is simulated again a moment later, until it arrives in the
    job's code (the job's handler runs once, there)."""

    def __init__(self, job_handler: Callable[[int, FrameType | None], object]) -> None:
        self.job_handler = job_handler

    def __call__(self, signum: int, frame: FrameType | None) -> object:
        if frame is not None and dropped_there(frame.f_code):
            _soon(_thread.interrupt_main)
            return None
        return self.job_handler(signum, frame)


def dropped_there(code: CodeType) -> bool:
    """Whether an exception raised in `code` would be dropped or land in the agent: the agent's
    own code, or a standard-library weakref callback (`_DROPPING`)."""
    return code.co_filename.startswith(AGENT_DIR) or code in _DROPPING


def _soon(action: Callable[[], None]) -> None:
    """`action` on another thread a moment from now, when the main thread has most likely left
    the agent's code (a finalizer takes microseconds); if not, the same path runs again there.
    The low-level start: `threading.Thread.start` waits for the thread, and what `action`
    raises in the main thread could then arrive inside that wait, still under the finalizer."""

    def run() -> None:
        time.sleep(0.001)
        action()

    _thread.start_new_thread(run, ())


def hand_back(error: BaseException) -> None:
    """Raise `error` again in the main thread, after the finalizer that caught it returns.

    Only what a signal handler can raise into a finalizer on the main thread is handed back
    (`KeyboardInterrupt`, `SystemExit` and other non-`Exception` errors there): the agent's own
    errors inside a finalizer stay contained, as they were.
    """
    if isinstance(error, Exception) or threading.current_thread() is not threading.main_thread():
        return
    kind = type(error) if not error.args else _carrying(error)
    # From another thread: set from this one, the exception would be raised at this
    # finalizer's next bytecode and dropped again; if it lands in another finalizer, that one
    # hands it back the same way.
    _soon(lambda: _raise_in_main(kind))


def _raise_in_main(kind: type[BaseException]) -> None:
    main = threading.main_thread().ident
    if main is not None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(kind))


def _carrying(error: BaseException) -> type[BaseException]:
    """A subclass of `error`'s type whose instances carry `error`'s arguments: the interpreter
    raises an asynchronous exception by calling its type with none (`SystemExit(3)` must come
    back with its code)."""
    base = type(error)
    args = error.args

    def __init__(self: BaseException) -> None:
        base.__init__(self, *args)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__})
