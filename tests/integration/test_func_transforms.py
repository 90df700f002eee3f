"""A job using torch.func's `grad` (per-sample gradients) trains under the agent as alone,
compiled or not.

torch.func's grad, vjp, jacrev and hessian raise when any saved-tensor hooks are on the
thread's stack; the agent's pair was there on measured steps, so such a job died at its first
step under `memtui run`. The pair now leaves for torch's disabled region and comes back after
it (`library_wrappers.SavedHooksDisabled`), and those steps' activations are not known, said
once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_harness import alone_and_recorded
from repo_paths import FIXTURES

pytestmark = pytest.mark.slow  # torch children, with and without `memtui run`

JOB = FIXTURES / "func_transforms.py"


@pytest.mark.parametrize(
    ("mode", "backend"), [("auto", None), ("every", None), ("auto", "eager"), ("auto", "aot_eager")]
)
def test_torch_func_grad_runs_and_its_steps_say_not_known(
    tmp_path: Path, mode: str, backend: str | None
) -> None:
    compiled = [] if backend is None else ["--compile", backend]
    plain, monitored, found = alone_and_recorded(
        JOB, tmp_path, job_args=compiled, memtui_args=["--activations", mode]
    )
    assert monitored["losses"] == plain["losses"]
    steps = found["steps"]
    assert len(steps) == 8
    for step in steps:
        # The piles read at the close are exact; a within-step high the agent could not see
        # (gradients assigned by hand, no hook fires) is not known, never another number.
        assert step["end"]["weights"] == step["end"]["gradients"] == plain["weights"]
        assert step["max"]["gradients"] in (None, plain["weights"]), step["step"]
        if backend is None or step["step"] == 1:
            # torch.func disabled the hooks in the step (compiled: as dynamo traced it).
            assert not step["activations_measured"] and step["activations_from"] is None
            assert step["max"]["activations"] is None and step["activations_why_at"] == 1
        elif not step["activations_measured"]:
            assert step["max"]["activations"] is None  # the eager backend disables at each call
        else:
            # AOTAutograd compiled the transform into one forward: nothing saved for a backward.
            assert step["max"]["activations"] == 0, step["step"]
    said = [alert for alert in found["alerts"] if alert["kind"] == "activations_vary"]
    assert [alert["step"] for alert in said] == [1]
    assert "torch.func" in said[0]["message"]


def test_a_model_called_inside_the_transforms_is_said_to_be_torch_funcs(tmp_path: Path) -> None:
    # The model runs inside hessian/jacfwd, where torch disabled saved-tensor hooks: no pair can
    # be pushed there, and the reason given is torch.func, never "the job's own hooks".
    plain, monitored, found = alone_and_recorded(FIXTURES / "func_hessian_loss.py", tmp_path)
    assert monitored["losses"] == plain["losses"]
    assert all(step["max"]["activations"] is None for step in found["steps"])
    said = [alert for alert in found["alerts"] if alert["kind"] == "activations_vary"]
    assert said and all("torch.func" in alert["message"] for alert in said), said
    assert not any("job's own" in alert["message"] for alert in said)
