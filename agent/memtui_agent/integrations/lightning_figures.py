"""The body of memtui's Lightning callbacks, shared by `lightning.pytorch`
(`integrations.lightning`) and the older `pytorch_lightning` package
(`integrations.pytorch_lightning`), which ship the same `Callback` under two classes.

The figures go to the Trainer's loggers (`trainer.loggers`, each `log_metrics`) as Python
integers at `trainer.global_step`, at the Trainer's own cadence (`log_every_n_steps`), once per
optimizer step: a batch that only accumulates gradients closes no step and logs nothing. Not
through `LightningModule.log`, which turns each value into a float32 tensor on the module's
device (a copy to the GPU, rounded above 16 MiB) that the logger then reads back.
"""

from __future__ import annotations

import os
from typing import Any

from memtui_agent.integrations.step_figures import StepFigures


class LightningFigures:
    """Mixed into a `Callback` of either package (see the module)."""

    _figures: StepFigures

    def _set_up(self, record: str | os.PathLike[str] | None, options: dict[str, Any]) -> None:
        self._figures = StepFigures("lightning-callback", {"record": record, **options})

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Start the agent where none runs (before the optimizers exist: `fit` calls `setup`
        first)."""
        try:
            self._figures.ensure_agent()
        except Exception as exc:
            self._figures.failed(exc)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Log the step that closed in this batch, at the Trainer's logging cadence."""
        try:
            step = trainer.global_step
            every = trainer.log_every_n_steps
            if type(step) is not int or (type(every) is int and every > 0 and step % every):
                return
            figures = self._figures.take()
            if figures:
                for logger in trainer.loggers:
                    logger.log_metrics(figures, step=step)
        except Exception as exc:
            self._figures.failed(exc)


__all__ = ["LightningFigures"]
