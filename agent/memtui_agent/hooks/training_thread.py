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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from threading import get_ident


class TrainingThread:
    """Which thread is followed; hooks compare `ident` with `get_ident()` (a few tens of ns)."""

    def __init__(self) -> None:
        self.ident = get_ident()
        """The followed thread (the installing one until an optimizer steps)."""
        self.confirmed = False
        """Whether an optimizer has stepped on it (then it never changes again)."""
        self.left: set[int] = set()
        """Threads followed before the first optimizer step moved the agent elsewhere."""
        self._lock = threading.Lock()
        self._moved: list[Callable[[int], None]] = []

    def on_move(self, callback: Callable[[int], None]) -> None:
        """Call `callback(old_ident)` on the new thread when the followed thread changes."""
        self._moved.append(callback)

    def follows(self) -> bool:
        """Whether the calling thread is the followed one."""
        return get_ident() == self.ident

    def claim(self) -> bool:
        """A top-level `optimizer.step()` starts on the calling thread: whether it is (now) the
        followed thread. The first thread to step an optimizer becomes it for good."""
        ident = get_ident()
        if ident == self.ident:
            self.confirmed = True
            return True
        if self.confirmed:
            return False
        with self._lock:  # two threads may step their first optimizers at once
            if self.confirmed:
                return ident == self.ident
            old, self.ident = self.ident, ident
            self.confirmed = True
            self.left.add(old)
        for callback in self._moved:
            callback(old)
        return True

    def restart(self) -> None:
        """The hooks are installed (again) on the calling thread (`Tracker.install`)."""
        self.ident = get_ident()
        self.confirmed = False
