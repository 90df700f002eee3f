"""Whether the job has run code that `torch.compile` made.

dynamo guards each graph it compiles on torch's global module hooks: how many there are and
their handles' keys (its inlined `Module._call_impl` reads them). An agent that installs its hooks
for a measured step and removes them for a carried one, or puts them back under new handles,
fails those guards at the next call, and dynamo compiles the same code again, up to its
recompile limit (8), after which the job's model runs uncompiled: a slower job, and other
kernels. Once the job has compiled, the agent stops switching its hooks (`steps.decision`).
"""

from __future__ import annotations

import sys


def has_compiled() -> bool:
    """Whether dynamo has compiled a graph in this process. Read from dynamo's own counters, and
    only once the job imported dynamo (`import torch` does not): a dict lookup per close."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return False
    try:
        stats = utils.counters.get("stats")
        return bool(stats) and stats.get("unique_graphs", 0) > 0
    except Exception:  # another torch's layout: no graph known of
        return False
