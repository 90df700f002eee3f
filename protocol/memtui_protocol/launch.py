"""Which launch a process belongs to: what tells a sibling task from a rerun.

A session folder may be shared by tasks that a scheduler starts one at a time: `srun` runs
`memtui run -o DIR -- python train.py` once per task, each a `memtui run` of its own, started
whenever the node gets to it. Such a task must keep every recording its siblings already wrote
there, finished or not; a rerun with the same `-o` must not show the earlier run's. A live writer
is seen by its lock (`memtui_protocol.written`); a sibling that has already finished is told
apart by this identity, which the agent writes into each recording's hello (`Hello.launch`) and
`memtui run` compares with its own.

The identity is the scheduler's own name for one launch of one command:

- SLURM: `slurm JOB.STEP` (`SLURM_JOB_ID`, `SLURM_STEP_ID`; `batch` for the batch script), so
  every task of one `srun` has the same one, and the next `srun` or the next job another;
- PMIx (`mpirun` of Open MPI 4 and later, PRRTE): `pmix NAMESPACE`, one per `mpirun`.

Anything else (tasks started by hand, another scheduler) has none: a task that finds no live
recording and no recording of its own launch in the folder is taken for a rerun.
"""

from __future__ import annotations

from collections.abc import Mapping

MAX_IDENTITY = 256
"""Longer values are no scheduler's ids: cut, so a hello stays small."""


def launch_identity(environ: Mapping[str, str]) -> str | None:
    """This process's launch (see the module's docstring); None when no scheduler names one."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    if job:
        step = environ.get("SLURM_STEP_ID", "").strip() or "batch"
        return f"slurm {job}.{step}"[:MAX_IDENTITY]
    namespace = environ.get("PMIX_NAMESPACE", "").strip()
    if namespace:
        return f"pmix {namespace}"[:MAX_IDENTITY]
    return None
