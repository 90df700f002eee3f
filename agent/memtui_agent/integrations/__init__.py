"""memtui's figures in the tracker the job already uses (docs/integrations.md).

- `metrics()`: the latest closed step's figures as a plain dict, for `accelerator.log(...)`,
  `wandb.log(...)`, `mlflow.log_metrics(...)` or any logger;
- `memtui_agent.integrations.transformers.MemtuiCallback`: a Hugging Face `TrainerCallback`
  whose figures go wherever the Trainer's `report_to` sends its logs;
- `memtui_agent.integrations.lightning.MemtuiCallback`: a Lightning `Callback` that hands them
  to the Trainer's loggers (`pytorch_lightning` users: `...integrations.pytorch_lightning`).

Importing this package imports neither torch nor any of those libraries: each callback's module
imports its library, which the job has imported already.
"""

from __future__ import annotations

from memtui_agent.integrations.step_figures import metrics

__all__ = ["metrics"]
