"""A Hugging Face `TrainerCallback` that puts memtui's figures into the Trainer's own logs.

    from memtui_agent.integrations.transformers import MemtuiCallback
    trainer = Trainer(..., callbacks=[MemtuiCallback()])

At each of the Trainer's logging steps (`logging_steps`) the figures of the step that just closed
join the `logs` dict the Trainer hands its `report_to` integrations (TensorBoard, Weights &
Biases, MLflow, ...), so they land beside the loss, at the same step (TensorBoard files them as
`train/memtui/...`). A logging step whose optimizer step memtui has already logged adds nothing
(an evaluation's logs at the same step).

The Trainer calls its callbacks in order, its `report_to` ones first: keys added later would
reach none of them. So at the first event it sends (`on_init_end`, or `on_train_begin` for a
callback added after `__init__`) this callback moves itself to the front of the Trainer's
callback list, which it reads from the calling `CallbackHandler.call_event`'s frame
(`job.frame_locals`: no code of the job runs). It changes no `control` flag, so its place changes
nothing else; where the handler is not found it says so once and adds its keys for the callbacks
that come after it.

Under `memtui run` the agent runs already; otherwise the first event starts it in this process
(`memtui_agent.start`, with this callback's keywords: `MemtuiCallback(record="run.memtui")`).
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

from memtui_agent.integrations.step_figures import StepFigures
from memtui_agent.job.frame_locals import frame_locals
from memtui_agent.memory.object_access import derives


class MemtuiCallback(TrainerCallback):  # type: ignore[misc]  # transformers is not analysed
    """memtui's figures of each logged step in the Trainer's logs (see the module)."""

    def __init__(self, record: str | os.PathLike[str] | None = None, **options: Any) -> None:
        """`record`, `options`: `memtui_agent.start`'s, used only where no agent runs yet."""
        self._figures = StepFigures("transformers-callback", {"record": record, **options})
        self._placed = False

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._join(sys._getframe(1))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._join(sys._getframe(1))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        try:
            if type(logs) is dict:
                logs.update(self._figures.take())
        except Exception as exc:
            self._figures.failed(exc)

    def _join(self, caller: types.FrameType) -> None:
        """Start the agent where none runs, then take the first place in the handler's list."""
        try:
            self._figures.ensure_agent()
            if not self._placed:
                self._placed = True
                if not self._first_in_line(caller):
                    self._figures.note(
                        "MemtuiCallback could not put itself before the Trainer's report_to "
                        "callbacks; its figures reach only the callbacks after it"
                    )
        except Exception as exc:
            self._figures.failed(exc)
        finally:
            del caller

    def _first_in_line(self, caller: types.FrameType) -> bool:
        """Put this callback first in the `CallbackHandler` calling it. A new list replaces the
        old one, which the handler's loop is walking now and finishes unchanged."""
        if caller.f_code.co_name != "call_event":
            return False
        handler = dict(frame_locals(caller) or ()).get("self")
        if handler is None or not derives(type(handler), CallbackHandler):
            return False
        callbacks = handler.callbacks
        if type(callbacks) is not list or not any(item is self for item in callbacks):
            return False
        handler.callbacks = [self, *(item for item in callbacks if item is not self)]
        return True


__all__ = ["MemtuiCallback"]
