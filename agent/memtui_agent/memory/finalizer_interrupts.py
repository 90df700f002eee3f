"""A Ctrl-C (or any exception a job's signal handler raises) that lands in one of the agent's
finalizers goes back to the job.

Python runs a signal's handler in whatever Python code the main thread executes next, and the
agent's finalizers (a saved activation's `__del__`, the ledger's weakref callback for a freed
storage, the id-table cleanups) run often, in the middle of the job's backward. An exception
that leaves a finalizer is printed as "Exception ignored" and dropped: under the agent, 33 of 200
Ctrl-Cs sent while a small model trained were lost (the job trained on), and 0 of 200 without
it. A finalizer therefore catches what interrupted it and calls `hand_back`, which raises the
same exception in the main thread once the finalizer has returned, in the job's own code, as if
the signal had arrived there. The handler is not run a second time (a job counting its Ctrl-Cs
sees one).
"""

from __future__ import annotations

import _thread
import ctypes
import os
import signal
import threading
import time
from types import FrameType

AGENT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
"""The agent's own code: a Ctrl-C that arrives while it runs is kept for the job's code."""


def keep_ctrl_c_for_the_job() -> bool:
    """Install the deferring SIGINT handler where the job has Python's default one (the common
    case). Python raises a signal's exception at the first check point the main thread reaches,
    and a finalizer's first check point comes before any `try` in it: only a handler can keep
    the interrupt out of the agent's code. Returns whether it was installed (only the main
    thread may install a handler; a job with its own handler keeps it, and `hand_back` covers
    what that handler raises inside a finalizer's body)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, deferring_int_handler)
    return True


def restore_ctrl_c() -> None:
    """Python's own handler back, if ours is still the one installed (at the agent's stop)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is deferring_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def deferring_int_handler(signum: int, frame: FrameType | None) -> None:
    """Python's `default_int_handler` (raise KeyboardInterrupt), except while the main thread
    runs the agent's code: then the signal is simulated again a moment later, until it arrives
    in the job's code."""
    if frame is not None and frame.f_code.co_filename.startswith(AGENT_DIR):
        # The low-level start: `threading.Thread.start` waits for the thread, and the signal
        # simulated again could then arrive inside that wait, still under the finalizer.
        _thread.start_new_thread(_interrupt_soon, ())
        return
    raise KeyboardInterrupt


def _interrupt_soon() -> None:
    time.sleep(0.001)  # out of the agent's code, usually: a finalizer takes microseconds
    _thread.interrupt_main()


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
    # finalizer's next bytecode and dropped again. That thread runs once the main thread
    # lets go of the GIL, by then out of the finalizer; if it lands in another finalizer,
    # that one hands it back the same way.
    threading.Thread(
        target=_raise_in_main, args=(kind,), name="memtui-hand-back", daemon=True
    ).start()


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
