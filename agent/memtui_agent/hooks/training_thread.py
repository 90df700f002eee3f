"""The one thread whose training the agent follows.

Hooks are process-global, so every thread's module calls, backwards, gradients and optimizer
steps reach them. The agent's state (the open step, the module stack, the ledger, the
saved-tensor pair, which is thread-local anyway) is one training loop's: a second thread that
trains its own model at the same time would close steps in the middle of the first one's and
have its gradients read while it frees them (SIGSEGV in about 5 % of such runs before issue 27).
So exactly one thread is followed: the thread that installed the hooks until some thread steps an
optimizer, and from then on the first thread to step one. Everything every other thread does is
passed through untouched. A second model trained on another thread is therefore not recorded
(said in docs/reliability.md); one recording stays one training loop's.

Only the followed thread reads the job's tensors, and it reads only what it uses itself. Reading
a gradient that another thread's backward is writing (autograd writes `.grad` without holding
the GIL) is a use-after-free: that was issue 32's SIGSEGV, where the installing thread ran a
forward (its model registered, its gradients hooked), another thread stepped first, and the
agent, now on that thread, read the first one's gradients at every close. Two rules close it:

- the move: when the first optimizer step comes from another thread, everything the old thread
  registered is forgotten (`on_move` callbacks: its models, optimizers, root and gradient
  hooks), under `lock`;
- sections: what the followed thread does that registers, hooks or reads the job's objects
  before the first optimizer step (a new model, a root call that arms, a backward that closes)
  runs inside `following()`, which holds the same lock and says whether the calling thread is
  still the followed one. A thread that passed its hook's cheap check just before the move
  therefore either finishes that work before the move forgets it, or finds it is no longer
  followed and does nothing. Once an optimizer has stepped, the followed thread never changes
  again and sections take no lock.

The hot hooks (module calls, saved tensors, gradients) only compare `ident` with `get_ident()`;
what they touch after a move is the agent's own bookkeeping, never another thread's tensors.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from threading import get_ident


class TrainingThread:
    """Which thread is followed; hooks compare `ident` with `get_ident()` (a few tens of ns)."""

    def __init__(self) -> None:
        self.ident = get_ident()
        """The followed thread (the installing one until an optimizer steps)."""
        self.confirmed = False
        """Whether an optimizer has stepped on it (then it never changes again). Set after
        `ident`, so a reader that sees it set reads the final `ident`."""
        self.left: set[int] = set()
        """Threads followed before the first optimizer step moved the agent elsewhere."""
        self.lock = threading.RLock()
        """Held while the followed thread changes and during `following()` sections before
        that (reentrant: a section may call code that opens another)."""
        self._moved: list[Callable[[int], None]] = []

    def on_move(self, callback: Callable[[int], None]) -> None:
        """Call `callback(old_ident)` on the new thread, under `lock`, when the followed thread
        changes."""
        self._moved.append(callback)

    def follows(self) -> bool:
        """Whether the calling thread is the followed one."""
        return get_ident() == self.ident

    def claim(self) -> bool:
        """A top-level `optimizer.step()` starts on the calling thread: whether it is (now) the
        followed thread. The first thread to step an optimizer becomes it for good."""
        ident = get_ident()
        if self.confirmed:  # `ident` never changes once confirmed: no lock needed
            return ident == self.ident
        with self.lock:  # two threads may step their first optimizers at once
            if self.confirmed:
                return ident == self.ident
            old = self.ident
            if old == ident:
                self.confirmed = True
                return True
            self.ident = ident
            self.confirmed = True
            self.left.add(old)
            # Under the lock: no section of the old thread runs while its objects are forgotten.
            for callback in self._moved:
                callback(old)
        return True

    def following(self) -> AbstractContextManager[bool]:
        """A section of the followed thread's work that registers, hooks or reads the job's
        objects: `with thread.following() as followed` says whether the calling thread is the
        followed one, and keeps it so until the section ends (no move meanwhile). Once an
        optimizer has stepped nothing can move: no lock, a constant answer."""
        if self.confirmed:
            return _FOLLOWED if get_ident() == self.ident else _NOT_FOLLOWED
        return self._locked()

    @contextmanager
    def _locked(self) -> Iterator[bool]:
        with self.lock:
            yield get_ident() == self.ident

    def restart(self) -> None:
        """The hooks are installed (again) on the calling thread (`Tracker.install`)."""
        with self.lock:
            self.confirmed = False
            self.ident = get_ident()

    def alive_elsewhere(self) -> bool:
        """Whether the followed thread is another thread than the caller and still runs: its
        tensors may then be in use by autograd, and the caller must not read them (the end of
        a job whose main thread returned while its training thread goes on)."""
        ident = self.ident
        return ident != get_ident() and ident in sys._current_frames()


_FOLLOWED = nullcontext(True)
_NOT_FOLLOWED = nullcontext(False)
"""`following()`'s answers once the followed thread is final (stateless, shared by threads)."""
