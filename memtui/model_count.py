"""Parameter counts of a user's model for `memtui estimate --model module:callable`.

The count needs torch and the user's code, neither of which may enter the viewer process
(DESIGN.md, "The shape"), so it runs in a child: `python -m memtui_agent.count_params`, which
builds the model on the meta device and prints one JSON line. Kept apart from `memtui.estimate`
so that module stays pure arithmetic.
"""

from __future__ import annotations

import json
import subprocess
import sys


class ModelCountError(Exception):
    """`--model` could not be counted; the message is the child's one line."""


def count_model(spec: str) -> tuple[int, int]:
    """`(params, trainable)` of `module:callable`, counted by `memtui_agent.count_params`.

    A child process, because this side never imports torch and the user's module may print,
    exit or crash on import. The child inherits the working directory and puts it on `sys.path`,
    so `--model mymodels:build` finds `./mymodels.py` as `python -m` would.

    Raises:
        ModelCountError: the child's last stderr line (its one-line reason).
    """
    command = [sys.executable, "-m", "memtui_agent.count_params", spec]
    child = subprocess.run(command, capture_output=True, text=True, check=False)
    if child.returncode != 0:
        lines = [line for line in child.stderr.splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"counting {spec} failed ({child.returncode})"
        raise ModelCountError(reason)
    try:
        counted = json.loads(child.stdout.strip().splitlines()[-1])
        return int(counted["params"]), int(counted["trainable"])
    except (IndexError, ValueError, KeyError, TypeError):
        raise ModelCountError(f"counting {spec} printed no parameter counts") from None
