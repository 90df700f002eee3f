"""What every integration shares: the agent's figures of each closed step, taken once each, an
agent started where none runs, and failures contained.

The figures are the agent's own (`output.logger_figures`: the latest frame the recording
holds), never measured again here. A callback holds no reference to the job's objects (the
Trainer, the module, its loggers are the arguments of each call, used and dropped), and whatever
fails in it is said once, on stderr and in the recording, and turns it off: the job's training
and its own logging go on.
"""

from __future__ import annotations

import sys
from typing import Any

from memtui_agent.startup import api
from memtui_protocol.shown_text import terminal_safe


def metrics() -> dict[str, int]:
    """The latest closed step's figures, keyed `memtui/...` (docs/integrations.md lists every
    key); empty when no agent runs in this process or no step has closed yet.

    A figure the step does not state (activations not known, "other" on a CPU job) is left out,
    never given as 0. Cheap and safe at any moment: it reads integers the agent's last frame
    holds, and never waits for the device.
    """
    agent = api.current()
    if agent is None:
        return {}
    return agent.logger_figures.figures()


class StepFigures:
    """One callback's share of the agent: started if none runs, each step's figures once."""

    def __init__(self, component: str, options: dict[str, Any]) -> None:
        """`component`: the name its failure is reported under; `options`: `memtui_agent.start`'s
        keywords, used only where no agent runs yet (under `memtui run` the agent runs already,
        configured by its flags)."""
        self._component = component
        self._options = options
        self._started = False
        self._last: int | None = None
        self.off = False
        """A failure turned this callback off for the rest of the run (said once)."""

    def ensure_agent(self) -> None:
        """Start the agent in this process unless one runs (once: a refusal is not retried)."""
        if self._started or self.off:
            return
        self._started = True
        if api.current() is None:
            api.start(**self._options)  # says itself, once, why it could not start

    def take(self) -> dict[str, int]:
        """The latest closed step's figures if it closed since the last `take`, else empty."""
        if self.off:
            return {}
        agent = api.current()
        if agent is None:
            return {}
        figures = agent.logger_figures
        step = figures.step
        if step is None or step == self._last:
            return {}
        self._last = step
        return figures.figures()

    def failed(self, exc: BaseException) -> None:
        """Contain a failure: this callback is off from here, said once (the agent's report, or
        stderr where no agent runs)."""
        if self.off:
            return
        self.off = True
        agent = api.current()
        if agent is not None:
            agent.report_failure(self._component, exc)
            return
        try:
            print(
                f"memtui: {self._component} failed and is off for the rest of this run "
                f"({terminal_safe(f'{type(exc).__name__}: {exc}')}); the job continues",
                file=sys.stderr,
            )
        except Exception:
            pass

    def note(self, message: str) -> None:
        """Say once that the callback works in part (the agent's note, or stderr), under a
        name of its own: a failure later is still said."""
        agent = api.current()
        if agent is not None:
            agent.note(f"{self._component}-note", message)
            return
        try:
            print(f"memtui: {terminal_safe(message)}", file=sys.stderr)
        except Exception:
            pass


__all__ = ["StepFigures", "metrics"]
