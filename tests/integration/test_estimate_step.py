"""`memtui estimate --model M:F --batch M:F`: two training steps measured on fake tensors.

The estimate is only worth having if it is what memtui measures once the job really trains, so
the main tests train the same model and batch for real under `memtui run`, read `memtui report
--json`, and compare: weights, gradients and optimizer state to the byte, activations and peaks
within 2% (they come out exact). The in-process tests compare a fake run with a real run of the
same steps under the same tracker, quickly. Refusals are one line each.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui
from repo_paths import FIXTURES

from memtui.reports.model_estimate import (
    Sharding,
    Verdict,
    build_result,
    largest_batch,
    reserve_for,
    smallest_zero_stage,
    verdict_for,
)
from memtui_agent.estimate.fake_step import run_variant
from memtui_protocol.estimate import Autocast, FakeStepRequest, OptimizerKind, Variant

pytestmark = pytest.mark.slow  # each test starts a torch job or two

GB = 10**9
PERSISTENT = ("weights", "gradients", "optimizer_state")


def _memtui(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_memtui(*args, cwd=FIXTURES, timeout=timeout)


def _estimate(model: str, batch: str, *extra: str) -> dict[str, Any]:
    result = _memtui(
        "estimate",
        "--model",
        f"estimate_models:{model}",
        "--batch",
        f"estimate_models:{batch}",
        "--json",
        *extra,
    )
    assert result.returncode == 0, result.stderr
    estimated: dict[str, Any] = json.loads(result.stdout)
    return estimated


def _measured(tmp_path: Path, model: str, batch: str, optimizer: str, *extra: str) -> list[Any]:
    """The steps `memtui run` records while the model really trains (3 steps)."""
    recording = tmp_path / "real.memtui"
    script = str(FIXTURES / "train_for_real.py")
    args = [f"estimate_models:{model}", f"estimate_models:{batch}", optimizer, *extra]
    ran = _memtui("run", "--headless", "-o", str(recording), script, *args)
    assert ran.returncode == 0, ran.stderr
    report = _memtui("report", str(recording), "--json")
    assert report.returncode == 0, report.stderr
    steps: list[Any] = json.loads(report.stdout)["steps"]
    assert len(steps) == 3
    return steps


def _within(estimated: int, measured: int, fraction: float = 0.02) -> bool:
    return abs(estimated - measured) <= fraction * measured


CASES = [
    pytest.param("mlp_model", "mlp_batch", "adamw", [], [], id="mlp-adamw"),
    pytest.param("llama_model", "llama_batch", "adam", [], [], id="transformer-adam"),
    pytest.param("conv_model", "conv_batch", "momentum", [], [], id="convnet-momentum"),
    pytest.param(
        "llama_model", "llama_batch", "adamw", ["--autocast", "bf16"], ["bf16"], id="autocast-bf16"
    ),
    pytest.param(
        "llama_model",
        "llama_batch",
        "sgd",
        ["--checkpointing"],
        ["-", "checkpointing"],
        id="checkpointing-flag",
    ),
    pytest.param(
        "llama_checkpointed_model", "llama_batch", "rmsprop", [], [], id="checkpoint-in-forward"
    ),
    pytest.param("tuple_model", "tokens_batch", "adamw", [], [], id="logits-loss-tuple"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "batch", "optimizer", "flags", "real_args"), CASES)
def test_estimate_equals_what_memtui_measures(
    tmp_path: Path, model: str, batch: str, optimizer: str, flags: list[str], real_args: list[str]
) -> None:
    real_args = real_args or ["-"]
    # The estimate and the measured run are two processes: side by side on CI's two cores.
    with ThreadPoolExecutor(max_workers=1) as pool:
        measuring = pool.submit(_measured, tmp_path, model, batch, optimizer, *real_args)
        estimated = _estimate(model, batch, "--optimizer", optimizer, *flags)
        first, second, third = measuring.result()
    for pile in PERSISTENT:
        assert estimated[pile] == second["end"][pile] == third["end"][pile], pile
    assert estimated["activations"] > 0
    assert _within(estimated["activations"], second["max"]["activations"])
    assert _within(estimated["peak"], second["peak"]["total"])
    assert _within(estimated["first_step_peak"], first["peak"]["total"])
    assert estimated["peak_piles"] == second["peak"]["piles"]


def _request(model: str, batch: str, **options: Any) -> FakeStepRequest:
    return FakeStepRequest(f"estimate_models:{model}", f"estimate_models:{batch}", **options)


@pytest.fixture
def fixtures_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))


@pytest.mark.usefixtures("fixtures_path")
@pytest.mark.parametrize(
    "request_options",
    [
        {"optimizer": OptimizerKind.ADAMW},
        {"optimizer": OptimizerKind.MOMENTUM, "checkpointing": True},
        {"optimizer": OptimizerKind.ADAM, "autocast": Autocast.BF16},
    ],
    ids=["plain", "checkpointing", "autocast"],
)
def test_fake_step_equals_the_same_step_on_real_tensors(request_options: dict[str, Any]) -> None:
    request = _request("llama_model", "llama_batch", **request_options)
    fake = run_variant(request, Variant.AS_GIVEN)
    real = run_variant(request, Variant.AS_GIVEN, fake=False)
    assert fake.first == real.first
    assert fake.steady == real.steady
    assert fake.top_modules == real.top_modules
    assert fake.dtypes == real.dtypes
    assert fake.steady.max["activations"] > 0


@pytest.mark.parametrize(
    ("model", "where"),
    [("tuple_model", "output[1]"), ("list_model", "output[1]"), ("dict_model", "output['nll']")],
)
def test_the_one_scalar_of_a_tuple_list_or_dict_is_the_loss_and_said(
    model: str, where: str
) -> None:
    """nanoGPT's `(logits, loss)` and its list/dict cousins: the one scalar that needs grad is
    the loss (a detached accuracy beside it is not a candidate), and the text says which."""
    with ThreadPoolExecutor(max_workers=1) as pool:  # two processes, side by side
        as_json = pool.submit(_estimate, model, "tokens_batch")
        result = _memtui(
            "estimate",
            "--model",
            f"estimate_models:{model}",
            "--batch",
            "estimate_models:tokens_batch",
        )
        plain = as_json.result()
    assert result.returncode == 0, result.stderr
    assert f"loss: the forward's {where} (backpropagated each step)" in result.stdout
    assert plain["loss_from"] == where
    assert plain["activations"] > 0


@pytest.mark.usefixtures("fixtures_path")
def test_fake_step_counts_the_seed_ledger() -> None:
    """AdamW: two fp32 moments and a 4-byte step tensor per parameter tensor, exactly."""
    result = run_variant(_request("mlp_model", "mlp_batch"), Variant.AS_GIVEN)
    params = result.params
    tensors = 2 * 6  # six Linear layers, weight and bias each
    assert result.steady.end["weights"] == 4 * params
    assert result.steady.end["gradients"] == 4 * params
    assert result.steady.end["optimizer_state"] == 8 * params + 4 * tensors


@pytest.mark.usefixtures("fixtures_path")
def test_checkpointing_saves_activations_of_a_transformer() -> None:
    plain = run_variant(_request("llama_model", "llama_batch"), Variant.AS_GIVEN)
    saved = run_variant(_request("llama_model", "llama_batch"), Variant.CHECKPOINTED)
    assert saved.steady.max["activations"] < plain.steady.max["activations"]
    assert saved.steady.end == plain.steady.end


@pytest.mark.usefixtures("fixtures_path")
def test_double_batch_doubles_the_batch() -> None:
    base = run_variant(_request("mlp_model", "mlp_batch"), Variant.AS_GIVEN)
    double = run_variant(_request("mlp_model", "mlp_batch"), Variant.DOUBLE_BATCH)
    assert (base.batch_size, double.batch_size) == (64, 128)
    assert double.steady.max["activations"] > 1.9 * base.steady.max["activations"]


@pytest.mark.slow
def test_llama_7b_estimates_in_bounded_time_and_memory() -> None:
    """Llama-2-7B's shapes on this CPU machine: nothing allocated (the child's RSS stays far
    below the 27 GB its fp32 weights alone would take); a generous timeout, not a timing."""
    result = _memtui(
        "estimate",
        "--model",
        "estimate_models:llama7b_model",
        "--batch",
        "estimate_models:llama7b_batch",
        "--json",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    estimated = json.loads(result.stdout)
    assert estimated["params"] == 6_738_415_616
    assert estimated["weights"] == estimated["gradients"] == 4 * 6_738_415_616
    assert estimated["activations"] > 0
    assert estimated["peak"] >= estimated["total"]
    child_peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    assert child_peak_rss < 2 * 2**30


def test_json_has_the_contract_keys_and_inputs(tmp_path: Path) -> None:
    estimated = _estimate("mlp_model", "mlp_batch", "--device-memory", "16GB", "--gpus", "2")
    for key in (*PERSISTENT, "total", "activations", "peak", "first_step_peak", "top_modules"):
        assert key in estimated
    assert estimated["total"] == sum(estimated[pile] for pile in PERSISTENT)
    assert estimated["model"] == "estimate_models:mlp_model"
    assert estimated["batch"] == "estimate_models:mlp_batch"
    assert (estimated["optimizer"], estimated["gpus"], estimated["zero"]) == ("adamw", 2, 0)
    assert estimated["device_memory"] == 16 * GB
    assert estimated["verdict"]["verdict"] == "fits"
    assert estimated["to_fit"]["largest_batch"] > 64
    assert estimated["to_fit"]["checkpointing_activations"] is not None
    assert estimated["to_fit"]["zero_stage"] == 0
    assert estimated["top_modules"][0]["bytes"] > 0


def test_text_names_verdict_and_top_modules() -> None:
    result = _memtui(
        "estimate",
        "--model",
        "estimate_models:llama_model",
        "--batch",
        "estimate_models:llama_batch",
        "--device-memory",
        "24GB",
    )
    assert result.returncode == 0, result.stderr
    assert "top modules by saved activations:" in result.stdout
    assert "layers.0" in result.stdout
    assert "device 24.00 GB (22.35 GiB): fits" in result.stdout
    assert "largest batch that fits: about" in result.stdout
    assert "with checkpointing: activations" in result.stdout


# ----- refusals ---------------------------------------------------------------------------------


def _assert_one_line_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("memtui: error: ")
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("model", "batch", "fragment"),
    [
        ("no_such:build", "estimate_models:mlp_batch", "cannot import 'no_such'"),
        ("estimate_models:mlp_model", "no_such:batch", "cannot import 'no_such'"),
        ("estimate_models:mlp_model", "estimate_models:missing", "has no attribute 'missing'"),
        (
            "estimate_models:tuple_batch",
            "estimate_models:mlp_batch",
            "returned tuple, not a torch.nn.Module",
        ),
        (
            "estimate_models:mlp_model",
            "estimate_models:tuple_batch",
            "returned tuple, not a dict of the forward's keyword arguments",
        ),
        (
            "estimate_models:logits_model",
            "estimate_models:logits_batch",
            "returned a tensor of shape (4, 10), not a scalar loss",
        ),
        (
            "estimate_models:two_scalars_model",
            "estimate_models:tokens_batch",
            "returned a tuple with 2 scalar tensors that require grad (output[1], output[2]): "
            "return the loss alone",
        ),
        (
            "estimate_models:no_loss_model",
            "estimate_models:tokens_batch",
            "returned a tuple of 2 with no scalar tensor that requires grad",
        ),
        (
            "estimate_models:reads_values_model",
            "estimate_models:logits_batch",
            "cannot run on fake tensors: aten.nonzero.default has an output shape that depends",
        ),
        (
            "estimate_models:mlp_model",
            "estimate_models:llama_batch",
            "raised TypeError: Mlp.forward() got an unexpected keyword argument 'input_ids'",
        ),
    ],
)
def test_refusals_are_one_line(model: str, batch: str, fragment: str) -> None:
    _assert_one_line_error(_memtui("estimate", "--model", model, "--batch", batch), fragment)


def test_import_error_in_the_users_module_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "broken_models.py").write_text("import torch\nraise ImportError('no cuda here')\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "memtui",
            "estimate",
            "--model",
            "broken_models:m",
            "--batch",
            "broken_models:b",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    _assert_one_line_error(result, "cannot import 'broken_models': ImportError: no cuda here")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--params", "7B", "--optimizer", "adam"], "--optimizer needs --model and --batch"),
        (["--params", "7B", "--device-memory", "80GB"], "--device-memory needs --model"),
        (["--params", "7B", "--batch", "m:b"], "--batch needs --model"),
        (["--model", "m:f", "--batch", "m:b", "--scheme", "fp32-adam"], "--scheme is for"),
        (["--model", "m:f", "--batch", "m:b", "--fsdp", "--zero", "2"], "--fsdp or --zero"),
        (["--model", "m:f", "--batch", "m:b", "--device-memory", "lots"], "invalid size"),
    ],
)
def test_flag_misuse_is_one_line(args: list[str], fragment: str) -> None:
    _assert_one_line_error(_memtui("estimate", *args), fragment)


def test_batch_estimate_never_imports_torch_in_the_viewer() -> None:
    code = textwrap.dedent(
        """
        import sys
        from memtui.commands.cli import main
        code = main(["estimate", "--model", "estimate_models:mlp_model",
                     "--batch", "estimate_models:mlp_batch", "--json"])
        assert "torch" not in sys.modules, "torch imported"
        print("exit", code)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=FIXTURES
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("exit 0")


# ----- arithmetic: sharding, verdict, what would fit ---------------------------------------------


def _run(end: dict[str, int], act_max: int, peak: dict[str, int], size: int) -> dict[str, Any]:
    steady = {"end": end, "max": dict(end, activations=act_max), "peak": peak}
    return {"variant": "as_given", "batch_size": size, "first": steady, "steady": steady}


PILES_80 = {"weights": 20 * GB, "gradients": 20 * GB, "optimizer_state": 40 * GB, "activations": 0}


def test_sharding_follows_the_seed_ledger() -> None:
    piles = dict(PILES_80, activations=5 * GB)
    assert Sharding(8, 1).piles(piles) == {
        "weights": 20 * GB,
        "gradients": 20 * GB,
        "optimizer_state": 5 * GB,
        "activations": 5 * GB,
    }
    assert Sharding(8, 0, fsdp=True).piles(piles) == {
        "weights": 2_500_000_000,
        "gradients": 2_500_000_000,
        "optimizer_state": 5 * GB,
        "activations": 5 * GB,
    }


def test_verdict_keeps_the_reserve() -> None:
    assert reserve_for(80 * GB) == 8 * GB
    assert reserve_for(4 * GB) == 2**30
    assert verdict_for(72 * GB, 80 * GB) is Verdict.FITS
    assert verdict_for(72 * GB + 1, 80 * GB) is Verdict.TIGHT
    assert verdict_for(80 * GB + 1, 80 * GB) is Verdict.DOES_NOT_FIT


def test_largest_batch_from_two_sizes() -> None:
    """Weights 10 GB + state 20 GB fixed, 3 GB of activations per sample: with 80 GB and an
    8 GB reserve, (72 - 30) / 3 = 14 samples fit."""
    end = {"weights": 10 * GB, "gradients": 10 * GB, "optimizer_state": 20 * GB, "activations": 0}
    base = _run(end, 12 * GB, end, 4)
    double = _run(end, 24 * GB, end, 8)
    assert largest_batch(base, double, Sharding(), 80 * GB) == 14
    assert largest_batch(base, {"error": "x"}, Sharding(), 80 * GB) is None
    assert largest_batch(base, double, Sharding(), 30 * GB) == 0


def test_smallest_zero_stage_that_fits() -> None:
    run = _run(PILES_80, 0, PILES_80, 1)
    assert smallest_zero_stage(run, Sharding(8), 80 * GB) == 1  # 20 + 20 + 5 = 45 GB
    assert smallest_zero_stage(run, Sharding(8), 40 * GB) == 2  # 20 + 2.5 + 5
    assert smallest_zero_stage(run, Sharding(1), 80 * GB) is None


def test_build_result_shards_the_peak_by_its_composition() -> None:
    request = FakeStepRequest("m:f", "m:b", variants=[Variant.AS_GIVEN])
    peak = dict(PILES_80, gradients=0, activations=4 * GB)
    base = dict(_run(PILES_80, 4 * GB, peak, 2), params=1, trainable=1, top_modules=[], dtypes={})
    result = build_result(request, [base], Sharding(4, 3), None)
    assert result["peak"] == 5 * GB + 10 * GB + 4 * GB
    assert result["total"] == 5 * GB + 5 * GB + 10 * GB
    assert "verdict" not in result


def test_ledger_counts_fake_storages_only_when_asked() -> None:
    """Real jobs see fake tensors only while torch.compile traces: they must count zero there;
    the estimate's child keys each fake storage by its StorageImpl, views sharing it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memtui_agent.memory.ledger import count_fake_storages, storages_of

    with FakeTensorMode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        a, b = torch.empty(10, 10), torch.empty(10, 10)
        assert storages_of(a) == []
        count_fake_storages(True)
        try:
            [(key_a, nbytes, dtype, _)] = storages_of(a)
            [(key_view, *_)] = storages_of(a[1:])
            [(key_b, *_)] = storages_of(b)
        finally:
            count_fake_storages(False)
    assert (nbytes, dtype) == (400, "float32")
    assert key_a == key_view != key_b


@pytest.mark.usefixtures("fixtures_path")
@pytest.mark.parametrize("kind", list(OptimizerKind), ids=lambda kind: kind.value)
def test_every_optimizer_steps_on_fake_tensors_as_on_real_ones(kind: OptimizerKind) -> None:
    """Adafactor reads `.item()` of its step and of norms: its step runs with values as 1."""
    request = _request("mlp_model", "mlp_batch", optimizer=kind)
    fake = run_variant(request, Variant.AS_GIVEN)
    real = run_variant(request, Variant.AS_GIVEN, fake=False)
    assert (fake.first, fake.steady) == (real.first, real.steady)


@pytest.mark.usefixtures("fixtures_path")
def test_checkpointing_skips_parameter_free_layers() -> None:
    """A conv net's Sequential holds in-place ReLUs, which a reentrant checkpoint breaks."""
    request = _request("conv_model", "conv_batch", checkpointing=True)
    fake = run_variant(request, Variant.AS_GIVEN)
    real = run_variant(request, Variant.AS_GIVEN, fake=False)
    assert (fake.first, fake.steady) == (real.first, real.steady)
