"""Parameter counts of a user's model for `memtui estimate --model module:callable`.

The count needs torch and the user's code, neither of which may enter the viewer process
(docs/design.md#the-shape), so it runs in a child: `python -m memtui_agent.estimate.count_params`,
which builds the model on the meta device and prints one JSON line. Kept apart from
`memtui.reports.estimate` so that module stays pure arithmetic.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from memtui_protocol.estimate import COUNT_PARAMS_MODULE


class ModelCountError(Exception):
    """`--model` could not be counted; the message is the child's one line."""


@dataclass(frozen=True)
class ModelCount:
    """A model's parameters as built on the meta device, and the bytes they and its buffers take."""

    params: int
    trainable: int
    param_bytes: int
    buffer_bytes: int

    @property
    def scheme(self) -> str:
        """The bytes-per-parameter ledger of the model as built: fp32 parameters train as
        `fp32-adam` (what `--batch` measures with AdamW), 16-bit ones as `mixed-adam`."""
        return "fp32-adam" if self.param_bytes == 4 * self.params else "mixed-adam"


def count_model(spec: str) -> ModelCount:
    """The counts of `module:callable`, by `memtui_agent.estimate.count_params`.

    A child process, because this side never imports torch and the user's module may print,
    exit or crash on import. The child inherits the working directory and puts it on `sys.path`,
    so `--model mymodels:build` finds `./mymodels.py` as `python -m` would.

    Raises:
        ModelCountError: the child's last stderr line (its one-line reason).
    """
    counted = child_json(
        [COUNT_PARAMS_MODULE, spec],
        f"counting {spec}",
        f"counting {spec} printed no parameter counts",
        ModelCountError,
    )
    try:
        return ModelCount(
            int(counted["params"]),
            int(counted["trainable"]),
            int(counted.get("param_bytes", 0)),
            int(counted.get("buffer_bytes", 0)),
        )
    except (KeyError, TypeError, ValueError):
        raise ModelCountError(f"counting {spec} printed no parameter counts") from None


def child_json(arguments: list[str], doing: str, silent: str, error: type[Exception]) -> Any:
    """Run `python -m ARGUMENTS` and parse the last line it printed as JSON.

    The estimate's children (`count_params`, `fake_step`) print one JSON line on stdout and
    their one-line reason last on stderr. Raises `error` with that line when the child fails
    (`doing failed (code)` if it said nothing), or with `silent` when it printed no JSON.
    """
    child = subprocess.run(
        [sys.executable, "-m", *arguments], capture_output=True, text=True, check=False
    )
    if child.returncode != 0:
        lines = [line for line in child.stderr.splitlines() if line.strip()]
        raise error(lines[-1].strip() if lines else f"{doing} failed ({child.returncode})")
    try:
        return json.loads(child.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise error(silent) from None
