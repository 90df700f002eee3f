"""`memtui estimate`: the ledger's figures to the byte, the CLI contract, and `--model` counting.

The bytes-per-parameter ledger's figures (docs/numbers.md#the-bytes-per-parameter-ledger) are
the acceptance numbers of `memtui estimate --json` (docs/report-format.md#memtui-estimate---json),
so each one is checked through the pure function and the important ones again through the real
command line.
`--model` must count without allocating and without torch entering the viewer process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui

from memtui.commands.cli import build_parser
from memtui.reports.estimate import SCHEMES, estimate, parse_count, render_text

GB = 10**9


def _memtui(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_memtui("estimate", *args, cwd=cwd, timeout=120)


def _assert_one_line_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("memtui: error: ")
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("scheme", "expected"),
    [
        ("fp32-sgd", 12 * GB),
        ("fp32-momentum", 18 * GB),
        ("fp32-adam", 24 * GB),
        ("mixed-adam", 24 * GB),
    ],
)
def test_seed_ledger_for_one_and_a_half_billion(scheme: str, expected: int) -> None:
    assert estimate(parse_count("1.5B"), scheme=scheme).total == expected


def test_seed_seven_billion_mixed_adam() -> None:
    assert estimate(parse_count("7B")).total == 112 * GB


def test_mixed_adam_piles_are_the_zero_papers_split() -> None:
    result = estimate(1_000_000_000)
    assert (result.weights, result.gradients, result.optimizer_state) == (2 * GB, 2 * GB, 12 * GB)


@pytest.mark.parametrize(
    ("zero", "piles"),
    [
        (0, (2 * GB, 2 * GB, 12 * GB)),
        (1, (2 * GB, 2 * GB, 1_500_000_000)),
        (2, (2 * GB, 250_000_000, 1_500_000_000)),
        (3, (250_000_000, 250_000_000, 1_500_000_000)),
    ],
)
def test_seed_zero_sharding_on_eight_gpus(zero: int, piles: tuple[int, int, int]) -> None:
    result = estimate(1_000_000_000, gpus=8, zero=zero)
    assert (result.weights, result.gradients, result.optimizer_state) == piles
    assert result.total == {0: 16 * GB, 1: 5_500_000_000, 2: 3_750_000_000, 3: 2 * GB}[zero]


def test_seed_adapter_on_a_frozen_base() -> None:
    result = estimate(parse_count("1.01B"), parse_count("10M"))
    assert result.total == 2_160_000_000
    assert result.weights == 2_020_000_000  # the frozen base still costs its weights


def test_frozen_parameters_cost_four_bytes_under_fp32() -> None:
    assert estimate(100, 0, scheme="fp32-adam").as_dict() == {
        "weights": 400,
        "gradients": 0,
        "optimizer_state": 0,
        "total": 400,
        "params": 100,
        "trainable": 0,
        "scheme": "fp32-adam",
        "gpus": 1,
        "zero": 0,
        "buffer_bytes": 0,
    }


def test_uneven_shards_round_up() -> None:
    assert estimate(3, gpus=2, zero=3).as_dict() == {
        "weights": 3,
        "gradients": 3,
        "optimizer_state": 18,
        "total": 24,
        "params": 3,
        "trainable": 3,
        "scheme": "mixed-adam",
        "gpus": 2,
        "zero": 3,
        "buffer_bytes": 0,
    }


def test_zero_stage_on_one_gpu_is_stage_zero() -> None:
    sharded, plain = estimate(10**9, zero=3).as_dict(), estimate(10**9).as_dict()
    assert {**sharded, "zero": 0} == plain


@pytest.mark.parametrize(
    ("text", "count"), [("7e9", 7 * 10**9), ("1.5e9", 15 * 10**8), ("7E+9", 7 * 10**9)]
)
def test_scientific_notation_is_a_count(text: str, count: int) -> None:
    assert parse_count(text) == count


def test_estimate_json_names_its_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    from memtui.commands.cli import main

    assert main(["estimate", "--params", "7e9", "--scheme", "fp32-adam", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["params"], result["trainable"], result["scheme"]) == (
        7 * 10**9,
        7 * 10**9,
        "fp32-adam",
    )
    assert (result["gpus"], result["zero"]) == (1, 0)


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("1.5B", 1_500_000_000),
        ("7B", 7_000_000_000),
        ("10M", 10_000_000),
        ("1.01B", 1_010_000_000),
        ("1_000_000", 1_000_000),
        ("350k", 350_000),
        ("123", 123),
        ("0.5T", 500_000_000_000),
    ],
)
def test_parse_count(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["1.5X", "", "B", "-5", "1.0000000001K", "1e-9", "1e", "seven"])
def test_parse_count_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_count(text)


def test_text_shows_bytes_gb_and_gib_side_by_side() -> None:
    text = render_text(estimate(1_000_000_000))
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert total.split() == ["total", "16,000,000,000", "16.00", "GB", "14.90", "GiB"]
    assert "16 bytes per trainable parameter" in text
    assert "2 weights + 2 gradients + 4 fp32 master + 8 moments" in text
    assert "activations, temporaries, communication buffers and fragmentation" in text


def test_cli_scheme_choices_match_the_ledger() -> None:
    args = build_parser().parse_args(["estimate", "--params", "1"])
    assert args.scheme is None  # cmd_estimate: mixed-adam for --params, the model's own dtype
    for scheme in SCHEMES:
        assert build_parser().parse_args(["estimate", "--params", "1", "--scheme", scheme])


@pytest.mark.slow  # starts an interpreter
def test_cli_json_is_exactly_the_contract() -> None:
    """The piles and their total, plus the inputs (docs/report-format.md: "then the inputs")."""
    result = _memtui("--params", "1B", "--gpus", "8", "--zero", "2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "weights": 2_000_000_000,
        "gradients": 250_000_000,
        "optimizer_state": 1_500_000_000,
        "total": 3_750_000_000,
        "params": 1_000_000_000,
        "trainable": 1_000_000_000,
        "scheme": "mixed-adam",
        "gpus": 8,
        "zero": 2,
        "buffer_bytes": 0,
    }


@pytest.mark.slow  # starts an interpreter
def test_cli_adapter_and_text() -> None:
    result = _memtui("--params", "1.01B", "--trainable", "10M", "--json")
    assert json.loads(result.stdout)["total"] == 2_160_000_000
    text = _memtui("--params", "1B", "--gpus", "8", "--zero", "1")
    assert text.returncode == 0
    assert "5,500,000,000" in text.stdout and "stage 1 on 8 GPUs" in text.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--params", "1.5X"], "invalid parameter count '1.5X'"),
        (["--params", "-5"], "must not be negative"),
        (["--params", "10", "--trainable", "11"], "exceeds"),
        (["--params", "1B", "--scheme", "bf16"], "invalid choice: 'bf16'"),
        (["--params", "1B", "--gpus", "0"], "--gpus must be at least 1"),
        (["--params", "1B", "--zero", "4"], "invalid choice: 4"),
        ([], "one of the arguments --params --model --from is required"),
        (["--params", "1B", "--model", "m:f"], "not allowed with"),
        # The counting child imports torch (2-3 s) before it reads the spec: the full run's.
        pytest.param(["--model", "no_colon"], "module:callable", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow  # starts an interpreter
def test_cli_bad_input_is_one_line_and_exit_2(args: list[str], fragment: str) -> None:
    _assert_one_line_error(_memtui(*args), fragment)


MODELS = """
import torch
from torch import nn

print("user module output on import")


def tied():
    embed, head = nn.Embedding(1000, 64), nn.Linear(64, 1000)
    head.weight = embed.weight
    return nn.Sequential(embed, head)


def adapter():
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10))
    model[0].requires_grad_(False)
    return model


def huge():
    assert torch.empty(1).device.type == "meta", "not built on the meta device"
    return nn.Linear(100_000, 100_000)


def broken():
    raise RuntimeError("checkpoint not found\\nsecond line")


def not_a_model():
    return 42
"""


@pytest.fixture
def models(tmp_path: Path) -> Path:
    (tmp_path / "my_models.py").write_text(textwrap.dedent(MODELS))
    return tmp_path


def _counted(models: Path, spec: str, *extra: str) -> dict[str, int]:
    result = _memtui("--model", spec, "--json", *extra, cwd=models)
    assert result.returncode == 0, result.stderr
    counted: dict[str, int] = json.loads(result.stdout)
    return counted


@pytest.mark.slow
def test_model_tied_weights_count_once(models: Path) -> None:
    params = 1000 * 64 + 1000  # one shared matrix plus the head's bias
    assert _counted(models, "my_models:tied") == estimate(params, scheme="fp32-adam").as_dict()


@pytest.mark.slow
def test_model_frozen_part_is_not_trainable(models: Path) -> None:
    # An fp32 model trains as fp32-adam unless --scheme says otherwise.
    fp32 = "fp32-adam"
    assert _counted(models, "my_models:adapter") == estimate(11_110, 1_010, fp32).as_dict()
    assert (
        _counted(models, "my_models:adapter", "--trainable", "0")
        == estimate(11_110, 0, fp32).as_dict()
    )
    assert (
        _counted(models, "my_models:adapter", "--scheme", "mixed-adam")
        == estimate(11_110, 1_010).as_dict()
    )


@pytest.mark.slow  # starts an interpreter
def test_model_is_built_on_the_meta_device(models: Path) -> None:
    # 10 billion parameters: 40 GB if allocated, instant on the meta device.
    assert _counted(models, "my_models:huge")["weights"] == 4 * 10_000_100_000


@pytest.mark.slow
def test_model_text_names_its_source(models: Path) -> None:
    result = _memtui("--model", "my_models:tied", cwd=models)
    assert "65,000 parameters, 65,000 trainable (counted from my_models:tied" in result.stdout


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        # One child end to end in the inner loop (each imports torch: 2-3 s); the child's own
        # wording of the other failures in the full run. The relay itself is tested below.
        ("my_models:broken", "my_models:broken raised RuntimeError: checkpoint not found"),
        *(
            pytest.param(spec, fragment, marks=pytest.mark.slow)
            for spec, fragment in (
                ("no_such_module:build", "cannot import 'no_such_module'"),
                ("my_models:missing", "'my_models' has no attribute 'missing'"),
                ("my_models:not_a_model", "returned int, not a torch.nn.Module"),
            )
        ),
    ],
)
@pytest.mark.slow  # starts an interpreter
def test_model_errors_are_one_line(models: Path, spec: str, fragment: str) -> None:
    _assert_one_line_error(_memtui("--model", spec, cwd=models), fragment)


class _Failed(Exception):
    pass


@pytest.mark.parametrize(
    ("child", "said"),
    [
        ("import sys; print('noise', file=sys.stderr); sys.exit('its one line')", "its one line"),
        ("import sys; sys.exit(3)", "counting m:f failed (3)"),
        ("print('not json')", "m:f printed nothing"),
        ("pass", "m:f printed nothing"),
    ],
)
@pytest.mark.slow  # starts an interpreter
def test_a_failing_child_is_relayed_as_its_last_line(
    monkeypatch: pytest.MonkeyPatch, child: str, said: str
) -> None:
    """The viewer's half of `--model`: whatever the counting child does, one line comes back
    (its last stderr line, or why there is none), never a traceback."""
    from memtui.reports import model_count

    real_run = subprocess.run

    def run(command: list[str], **options: Any) -> Any:
        assert command[:2] == [sys.executable, "-m"]
        return real_run([sys.executable, "-c", child], **options)

    monkeypatch.setattr("memtui.reports.model_count.subprocess.run", run)
    with pytest.raises(_Failed, match=f"^{re.escape(said)}$"):
        model_count.child_json(["some.module"], "counting m:f", "m:f printed nothing", _Failed)
    monkeypatch.setattr(
        "memtui.reports.model_count.subprocess.run",
        lambda command, **options: real_run(
            [sys.executable, "-c", "print('x'); print('{\"params\": 5}')"], **options
        ),
    )
    assert model_count.child_json(["m"], "d", "s", _Failed) == {"params": 5}


@pytest.mark.slow
def test_estimate_never_imports_torch(models: Path) -> None:
    """Even `--model` keeps torch out of this process: the child does the counting."""
    code = (
        "import sys\n"
        "import memtui.reports.estimate, memtui.reports.model_count\n"
        "from memtui.commands.cli import main\n"
        "assert main(['estimate', '--params', '1B', '--json']) == 0\n"
        "assert main(['estimate', '--model', 'my_models:tied', '--json']) == 0\n"
        "leaked = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n"
        "assert not leaked, leaked[:5]\n"
        "print('clean')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=models
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "clean"
