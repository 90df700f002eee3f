"""DDP's gradient buckets and FSDP2's shards and gathered parameters, per rank, against truth
the training job computes itself (from DDP's reducer, from each DTensor's local shard)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MEMTUI, scrubbed_env

from memtui_protocol.schema import Distributed

pytestmark = pytest.mark.slow  # every test here starts a torch job in a fresh interpreter


DDP_JOB = """
import json, os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 96))
view = os.environ["BUCKET_VIEW"] == "1"
# Small buckets: several of them, rebuilt after the first iteration.
ddp = DDP(model, gradient_as_bucket_view=view, bucket_cap_mb=0.05)
opt = torch.optim.AdamW(ddp.parameters())
truth = []
for step in range(3):
    opt.zero_grad()
    ddp(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()
    buckets = ddp.reducer._get_zeros_like_grad_buckets()  # shaped like DDP's own buckets
    truth.append({"buckets": sum(b.buffer().untyped_storage().nbytes() for b in buckets),
                  "count": len(buckets)})
    del buckets
with open(f"{sys.argv[1]}/truth-{dist.get_rank()}.json", "w") as out:
    json.dump(truth, out)
dist.destroy_process_group()
"""

FSDP_JOB = """
import json, os, sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(96, 256), nn.ReLU(), nn.Linear(256, 64), nn.LayerNorm(64))
if os.environ["LAYOUT"] == "layers":
    for layer in (model[0], model[2]):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())

def unique(tensors):
    seen = {}
    for tensor in tensors:
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())

def full(params):
    return sum(p.numel() * p.element_size() for p in params)  # DTensor numel is the global one

truth = []
for step in range(3):
    opt.zero_grad()
    model(torch.randn(16, 96)).pow(2).mean().backward()
    opt.step()
    truth.append({
        "weights": unique(model.parameters()),
        "gradients": unique(p.grad for p in model.parameters() if p.grad is not None),
        "optimizer_state": unique(t for state in opt.state.values() for t in state.values()),
    })
groups = {"layer0": full(model[0].parameters()), "layer2": full(model[2].parameters()),
          "root": full(model[3].parameters()), "all": full(model.parameters())}
with open(f"{sys.argv[1]}/truth-{dist.get_rank()}.json", "w") as out:
    json.dump({"steps": truth, "groups": groups}, out)
dist.destroy_process_group()
"""

PLAIN_JOB = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(96, 256), nn.ReLU(), nn.Linear(256, 64), nn.LayerNorm(64))
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    opt.zero_grad()
    model(torch.randn(16, 96)).pow(2).mean().backward()
    opt.step()
"""


def _session(
    tmp_path: Path, torchrun_session: Any, job: str, env: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The per-rank reports, the truth each rank wrote, and the run's stderr."""
    ranks, stderr = torchrun_session(job, env)
    truth = {rank: json.loads((tmp_path / f"truth-{rank}.json").read_text()) for rank in "01"}
    return ranks, truth, stderr


@pytest.mark.parametrize("view", [False, True], ids=["separate-buckets", "bucket-view"])
def test_ddp_buckets_are_their_own_line(tmp_path: Path, torchrun_session: Any, view: bool) -> None:
    ranks, truth, _ = _session(
        tmp_path, torchrun_session, DDP_JOB, {"BUCKET_VIEW": "1" if view else "0"}
    )
    weights = (64 * 512 + 512 + 512 * 96 + 96) * 4
    for rank in "01":
        steps = ranks[rank]["steps"]
        assert truth[rank][-1]["count"] > 1  # the test covers several (rebuilt) buckets
        for step, expected in zip(steps, truth[rank], strict=True):
            line = step["distributed"]
            assert line["ddp_buckets"] == expected["buckets"] == weights
            assert line["ddp_bucket_view"] is view
            # Views: the gradients pile is the buckets, counted once; otherwise a second copy.
            assert line["ddp_in_gradients"] == (weights if view else 0)
            assert step["end"]["gradients"] == weights
            assert step["end"]["weights"] == weights
            # The one peak every view states: the piles at the peak, plus the buckets when
            # they are a second copy (the job's own count), never twice when they are views.
            piles = step["peak"]["piles"]
            extra = 0 if view else expected["buckets"]
            assert step["peak"]["held"] == sum(piles.values()) + extra
    # The gradients are all-reduced: every rank holds the same ones, so the same global norm.
    norms = [[step["grad_norm"] for step in ranks[rank]["steps"]] for rank in "01"]
    assert None not in norms[0] and norms[0] == pytest.approx(norms[1], rel=1e-6)
    text = subprocess.run(
        [*MEMTUI, "report", str(tmp_path / "session")], capture_output=True, text=True, timeout=60
    ).stdout
    assert ("views into them" if view else "a second copy of the gradients") in text


@pytest.mark.parametrize("layout", ["root", "layers"])
def test_fsdp2_counts_local_shards_and_gathered_parameters(
    tmp_path: Path, torchrun_session: Any, layout: str
) -> None:
    ranks, truth, stderr = _session(tmp_path, torchrun_session, FSDP_JOB, {"LAYOUT": layout})
    # The agent's health check works on local shards: no DTensor op leaks into the job.
    assert "DTensor" not in stderr
    for rank in "01":
        steps = ranks[rank]["steps"]
        assert [step["step"] for step in steps] == [1, 2, 3]
        for step, expected in zip(steps, truth[rank]["steps"], strict=True):
            assert step["end"]["weights"] == expected["weights"]
            assert step["end"]["gradients"] == expected["gradients"]
            assert step["end"]["optimizer_state"] == expected["optimizer_state"]
            assert step["grad_norm"] is None  # a rank's shard: no global norm stated
        groups = truth[rank]["groups"]
        # About half of the model on each of two ranks (Shard(0) of odd rows pads one side).
        assert 0.45 * groups["all"] < steps[-1]["end"]["weights"] < 0.55 * groups["all"]
        gathered = steps[-1]["distributed"]
        assert gathered["fsdp_gathered"] == 0  # resharded by the time the step closes
        if layout == "root":
            assert gathered["fsdp_gathered_max"] == groups["all"]
        else:
            # Per-layer groups reshard after their forward: never the whole model at once.
            largest = max(groups["layer0"], groups["layer2"]) + groups["root"]
            assert largest <= gathered["fsdp_gathered_max"] < groups["all"]
        assert ranks[rank]["steps"][0]["alerts"][0]["kind"] == "first_step_forecast"
        forecast = ranks[rank]["steps"][0]["alerts"][0]["message"]
        grown = steps[0]["end"]["optimizer_state"]
        assert f"({grown:,} bytes)" in forecast  # forecast from the shard, as allocated


def test_fsdp2_gathered_parameters_are_not_activations(
    tmp_path: Path, torchrun_session: Any
) -> None:
    """The same model unsharded in one process saves the same activations: the gathered
    parameters autograd saves under FSDP are not counted as activations."""
    ranks, _, _ = _session(tmp_path, torchrun_session, FSDP_JOB, {"LAYOUT": "layers"})
    plain = tmp_path / "plain.py"
    plain.write_text(PLAIN_JOB)
    recording = tmp_path / "plain.memtui"
    subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", str(recording), str(plain)],
        cwd=tmp_path, env=scrubbed_env(tmp_path / "rt"),
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    report = subprocess.run(
        [*MEMTUI, "report", str(recording), "--json"], capture_output=True, text=True, timeout=60
    )
    expected = [step["max"]["activations"] for step in json.loads(report.stdout)["steps"]]
    assert expected[0] > 0
    for rank in "01":
        assert [step["max"]["activations"] for step in ranks[rank]["steps"]] == expected


def test_untracked_wrapper_memory_leaves_other() -> None:
    """`other` (allocated minus the piles) no longer hides DDP's separate buckets or FSDP's
    gathered parameters; bucket views are in the gradients already."""
    from memtui.model.step_rows import Untracked, distributed_notes, pile_rows
    from memtui_protocol import schema

    piles = schema.Piles(100, 100, 200, 50)
    separate = Distributed(ddp_buckets=100, ddp_bucket_view=False, ddp_in_gradients=0)
    viewed = Distributed(ddp_buckets=100, ddp_bucket_view=True, ddp_in_gradients=100)
    gathered = Distributed(fsdp_gathered=0, fsdp_gathered_max=300)
    for wrapped, extra in ((separate, {"ddp_buckets": 100}), (viewed, {"ddp_buckets": 0})):
        step = schema.Step(
            step=1, t_start=0, t_end=1, end=piles, max=piles, peak=piles,
            allocator=schema.Allocator(allocated=1000, peak_allocated=1000),
            distributed=wrapped,
        )  # fmt: skip
        rows = {row.name: row.at_peak for row in pile_rows(step)}
        assert rows[Untracked.DDP_BUCKETS] == extra["ddp_buckets"]
        assert rows[Untracked.OTHER] == 1000 - 450 - extra["ddp_buckets"]
    step = schema.Step(
        step=1, t_start=0, t_end=1, end=piles, max=piles, peak=piles,
        allocator=schema.Allocator(allocated=1000, peak_allocated=1000), distributed=gathered,
    )  # fmt: skip
    rows = {row.name: row.at_peak for row in pile_rows(step)}
    assert rows[Untracked.FSDP_GATHERED] == 300 and rows[Untracked.OTHER] == 1000 - 450 - 300
    assert (
        "(gradient_as_bucket_view=True) would share them"
        in distributed_notes(
            schema.Step(
                step=1, t_start=0, t_end=1, end=piles, max=piles, peak=piles, distributed=separate
            )
        )[0]
    )
