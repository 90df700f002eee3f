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
from typing import Any

from memtui_protocol.estimate import COUNT_PARAMS_MODULE


class ModelCountError(Exception):
    """`--model` could not be counted; the message is the child's one line."""


def count_model(spec: str) -> tuple[int, int]:
    """`(params, trainable)` of `module:callable`, counted by `memtui_agent.estimate.count_params`.

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
        return int(counted["params"]), int(counted["trainable"])
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
