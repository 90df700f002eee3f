"""`memtui estimate --what-if`, `--accum`, `--loss`, and one weights figure for one model.

Every what-if row a CPU can train is checked against the same change trained for real: the
persistent piles against the sum of the real model's storages (counted here, in the test), and
all four piles and the peak against the agent's tracker on real tensors (what `memtui run
--activations every` measures), within 2%. `--accum` and `--loss` are also checked end to end
against `memtui run` of the same loop.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui
from repo_paths import FIXTURES

from memtui_agent.estimate.fake_step import run_variant
from memtui_protocol.estimate import FakeStepRequest, OptimizerKind, Variant, WhatIf, with_what_if

pytestmark = pytest.mark.slow  # each test trains a model, most start a child

PERSISTENT = ("weights", "gradients", "optimizer_state")


def _memtui(*args: str, cwd: Path = FIXTURES) -> subprocess.CompletedProcess[str]:
    return run_memtui(*args, cwd=cwd, timeout=300)


def _within(estimated: int, measured: int, fraction: float = 0.02) -> bool:
    return abs(estimated - measured) <= fraction * measured


def _estimate(*args: str, cwd: Path = FIXTURES) -> dict[str, Any]:
    result = _memtui("estimate", *args, "--json", cwd=cwd)
    assert result.returncode == 0, result.stderr
    estimated: dict[str, Any] = json.loads(result.stdout)
    return estimated


@pytest.fixture
def fixtures_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))


@pytest.mark.parametrize(
    ("model", "batch"), [("conv_model", "conv_batch"), ("llama_model", "llama_batch")]
)
def test_model_alone_and_with_batch_say_the_same_weights(model: str, batch: str) -> None:
    """Issue 37: `--model` alone said half of `--model --batch` (16-bit weights assumed for an
    fp32 model, buffers left out). One model, one weights figure, equal to its storages."""
    alone = _estimate("--model", f"estimate_models:{model}")
    stepped = _estimate(
        "--model", f"estimate_models:{model}", "--batch", f"estimate_models:{batch}"
    )
    truth = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import estimate_models as m\n{_STORAGES}print(storages(m.{model}()))",
        ],
        cwd=FIXTURES,
        capture_output=True,
        text=True,
        check=True,
    )
    assert alone["weights"] == stepped["weights"] == int(truth.stdout)
    assert alone["gradients"] == stepped["gradients"]


_STORAGES = """
def storages(model):
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
"""


def _truth(model: Any, optimizer: Any) -> dict[str, int]:
    """The persistent piles of a real model and optimizer: each storage counted once."""
    import torch

    def total(tensors: list[torch.Tensor]) -> int:
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(seen.values())

    parameters = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "weights": total([*parameters, *model.buffers()]),
        "gradients": total([p.grad for p in parameters if p.grad is not None]),
        "optimizer_state": total(state),
    }


LLAMA = ("llama_model", "llama_batch")
MLP = ("mlp_model", "mlp_batch")  # runs in bf16 (the Llama-style one makes fp32 angles)
ROWS = [
    (*LLAMA, WhatIf.BATCH_X2),
    (*LLAMA, WhatIf.ACCUM_X2),
    (*LLAMA, WhatIf.AUTOCAST_BF16),
    (*LLAMA, WhatIf.MOMENTUM),
    (*LLAMA, WhatIf.ADAMW),
    (*LLAMA, WhatIf.ADAFACTOR),
    (*MLP, WhatIf.WEIGHTS_BF16),
]


@pytest.mark.usefixtures("fixtures_path")
@pytest.mark.parametrize(
    ("model_name", "batch_name", "what_if"), ROWS, ids=[row[2].value for row in ROWS]
)
def test_each_runnable_row_is_what_a_real_step_holds(
    model_name: str, batch_name: str, what_if: WhatIf
) -> None:
    import estimate_models
    import torch

    from memtui_agent.estimate.fake_step import make_optimizer, to_bfloat16, train_steps

    base = FakeStepRequest(
        f"estimate_models:{model_name}", f"estimate_models:{batch_name}", OptimizerKind.ADAM
    )
    request, variant = with_what_if(base, what_if)
    fake = run_variant(request, variant)
    real = run_variant(request, variant, fake=False)
    for figures in ("end", "max", "peak"):
        for pile, value in getattr(real.steady, figures).items():
            assert _within(getattr(fake.steady, figures)[pile], value), (figures, pile)
    assert fake.steady.max["activations"] > 0
    # The persistent piles against the storages of the same steps trained here.
    torch.manual_seed(0)
    model = getattr(estimate_models, model_name)()
    batch = getattr(estimate_models, batch_name)()
    if variant is Variant.DOUBLE_BATCH:
        batch = {key: torch.cat([value, value]) for key, value in batch.items()}
    if request.weights_bf16:
        to_bfloat16(model)
        batch = {k: v.bfloat16() if v.is_floating_point() else v for k, v in batch.items()}
    optimizer = make_optimizer(request.optimizer, model.parameters())
    train_steps(model, batch, optimizer, request.autocast, "m", accum=request.accum)
    truth = _truth(model, optimizer)
    assert {pile: fake.steady.end[pile] for pile in PERSISTENT} == truth


def test_what_if_table_end_to_end() -> None:
    """Every row's piles; measured rows equal their own estimate, sharded rows the seeds'
    arithmetic over the as-given row; fits marked under the device's memory."""
    spec = ("--model", "estimate_models:llama_model", "--batch", "estimate_models:llama_batch")
    device = 1_076_000_000  # 2.15 MiB left after the 1 GiB reserve: some rows fit, some not
    table = _estimate(*spec, "--what-if", "--gpus", "4", "--device-memory", str(device))
    rows = {row["row"]: row for row in table["what_if"]["rows"]}
    assert list(rows)[:4] == ["as given", "batch x2", "accum 2", "bf16 autocast"]
    given = rows["as given"]
    assert given["weights"] == table["weights"] and given["activations"] == table["activations"]
    assert given["peak"] == max(table["peak"], table["first_step_peak"])
    momentum = _estimate(*spec, "--optimizer", "momentum")
    assert rows["SGD momentum"]["optimizer_state"] == momentum["optimizer_state"]
    assert rows["SGD momentum"]["peak"] == max(momentum["peak"], momentum["first_step_peak"])
    assert rows["batch x2"]["activations"] > given["activations"]
    assert rows["accum 2"]["activations"] == given["activations"]
    assert rows["8-bit AdamW"]["optimizer_state"] == 2 * table["trainable"]
    for stage, name in ((1, "ZeRO-1 x4"), (2, "ZeRO-2 x4"), (3, "ZeRO-3 x4"), (3, "FSDP x4")):
        row = rows[name]
        assert row["source"] == "arithmetic"
        assert row["optimizer_state"] == -(-given["optimizer_state"] // 4)
        grads = given["gradients"]
        assert row["gradients"] == (-(-grads // 4) if stage >= 2 else grads)
        assert row["weights"] == (-(-given["weights"] // 4) if stage == 3 else given["weights"])
    # This model computes its rotary angles in fp32 inside forward: cast to bf16 it cannot run,
    # and the row says why instead of a figure.
    assert "dtype" in rows["bf16 weights"]["error"] and rows["bf16 weights"]["peak"] is None
    for row in rows.values():
        if row["error"]:
            continue
        assert row["fits"] is (row["peak"] + 2**30 <= device), row
    assert {row["fits"] for row in rows.values() if not row["error"]} == {True, False}
    text = _memtui("estimate", *spec, "--what-if")
    assert "what if (per GPU" in text.stdout and "ZeRO-3 x8*" in text.stdout


def _measured(tmp_path: Path, *args: str) -> list[Any]:
    recording = tmp_path / "real.memtui"
    script = str(FIXTURES / "train_for_real.py")
    ran = _memtui("run", "--headless", "-o", str(recording), script, *args)
    assert ran.returncode == 0, ran.stderr
    report = _memtui("report", str(recording), "--json")
    steps: list[Any] = json.loads(report.stdout)["steps"]
    return steps


def test_accum_end_to_end_against_memtui_run(tmp_path: Path) -> None:
    """K microbatches: activations of one, gradients live through the later forwards."""
    spec = ("--model", "estimate_models:mlp_model", "--batch", "estimate_models:mlp_batch")
    one, four = _estimate(*spec), _estimate(*spec, "--accum", "4")
    assert four["accum"] == 4 and four["activations"] == one["activations"]
    assert four["peak"] > one["peak"]  # the gradients are live during forwards 2..4
    steps = _measured(
        tmp_path, "estimate_models:mlp_model", "estimate_models:mlp_batch", "adamw", "-", "accum=4"
    )
    for pile in PERSISTENT:
        assert four[pile] == steps[1]["end"][pile]
    assert _within(four["activations"], steps[1]["max"]["activations"])
    assert _within(four["peak"], steps[1]["peak"]["total"])
    text = _memtui("estimate", *spec, "--accum", "4").stdout
    assert "accumulation: 4 microbatches per optimizer step" in text


def test_loss_function_instead_of_a_wrapper(tmp_path: Path) -> None:
    """A forward that returns logits, and `--loss` computing the loss from them and the batch's
    targets (which the forward does not take): no wrapper needed; also as FILE.py:FN."""
    spec = (
        "--model",
        "estimate_models:logits_model",
        "--batch",
        "estimate_models:logits_target_batch",
    )
    refused = _memtui("estimate", *spec)
    assert refused.returncode != 0 and "'target'" in refused.stderr  # what a new user met
    estimated = _estimate(*spec, "--loss", "estimate_models:xent")
    assert estimated["loss"] == "estimate_models:xent" and estimated["activations"] > 0
    steps = _measured(
        tmp_path,
        "estimate_models:logits_model",
        "estimate_models:logits_target_batch",
        "adamw",
        "-",
        "loss=estimate_models:xent",
    )
    for pile in PERSISTENT:
        assert estimated[pile] == steps[1]["end"][pile]
    assert _within(estimated["peak"], steps[1]["peak"]["total"])
    by_file = _estimate(*spec, "--loss", str(FIXTURES / "estimate_models.py") + ":xent")
    assert by_file["peak"] == estimated["peak"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--params", "7B", "--accum", "2"], "--accum needs --model and --batch"),
        (["--params", "7B", "--what-if"], "--what-if needs --model and --batch"),
        (["--params", "7B", "--loss", "m:f"], "--loss needs --model and --batch"),
        (["--params", "7B", "--accum", "0"], "--accum must be at least 1"),
        (["--params", "7B", "--loss", "nocolon"], "--loss expects module:callable"),
    ],
)
def test_new_flags_refuse_in_one_line(args: list[str], fragment: str) -> None:
    result = _memtui("estimate", *args)
    assert result.returncode != 0 and fragment in result.stderr
    assert len(result.stderr.splitlines()) == 1
