"""A Lightning `Callback` of the older `pytorch_lightning` package (the same callback as
`integrations.lightning`'s, on that package's `Callback` class) that hands memtui's figures to
the Trainer's loggers:

    from memtui_agent.integrations.pytorch_lightning import MemtuiCallback
    trainer = pl.Trainer(..., callbacks=[MemtuiCallback()])

How and when: `integrations.lightning_figures`. Under `memtui run` the agent runs already;
otherwise `setup` starts it in this process with this callback's keywords
(`MemtuiCallback(record="run.memtui")`).
"""

from __future__ import annotations

import os
from typing import Any

from pytorch_lightning import Callback

from memtui_agent.integrations.lightning_figures import LightningFigures


class MemtuiCallback(LightningFigures, Callback):  # type: ignore[misc]  # not analysed
    """memtui's figures of each logged step in the Trainer's loggers."""

    def __init__(self, record: str | os.PathLike[str] | None = None, **options: Any) -> None:
        """`record`, `options`: `memtui_agent.start`'s, used only where no agent runs yet."""
        super().__init__()
        self._set_up(record, options)


__all__ = ["MemtuiCallback"]
