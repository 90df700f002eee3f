"""`memtui diff A B` on real runs and on bad input (issue 38, item 4).

The slow test records one small job twice (`tests/fixtures/diff_pair.py`: batch 4 in fp32,
then batch 8 under bf16 autocast) and checks the diff against the two reports' own figures and
the job's own count of its weights and optimizer state. The others run `memtui diff` in this
process on hand-written recordings: folders (a session's ranks, a folder of one recording) and
every kind of bad input, each one line and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from cli_harness import MemtuiCli, run_memtui, scrubbed_env
from recording_files import bare_step, hello, write_recording
from repo_paths import FIXTURES

from memtui.commands.cli import main
from memtui.exit_codes import EXIT_BAD_INPUT, EXIT_USAGE

JOB = FIXTURES / "diff_pair.py"


def record(tmp_path: Path, name: str, *job_args: str) -> tuple[Path, dict[str, int]]:
    """The fixture job recorded headless; its recording and its own last line (its counts)."""
    path = tmp_path / f"{name}.memtui"
    done = run_memtui(
        "run", "--headless", "-o", str(path), str(JOB), *job_args,
        cwd=tmp_path, env=scrubbed_env(tmp_path / "rt"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return path, json.loads(done.stdout.strip().splitlines()[-1])


def report(memtui_cli: MemtuiCli, path: Path) -> dict[str, Any]:
    done = memtui_cli("report", "--json", str(path))
    assert done.returncode == 0, done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def highest(steps: list[dict[str, Any]], figure: str, pile: str) -> int:
    return max(int(s[figure][pile]) for s in steps if s[figure][pile] is not None)


def module_highs(steps: list[dict[str, Any]]) -> dict[str, int]:
    highs: dict[str, int] = {}
    for entry in steps:
        for item in entry["top_activations"]:
            highs[item["module"]] = max(highs.get(item["module"], 0), item["bytes"])
    return highs


@pytest.mark.slow
def test_two_real_runs_differ_by_what_the_reports_and_the_job_say(
    tmp_path: Path, memtui_cli: MemtuiCli
) -> None:
    a, job_a = record(tmp_path, "fp32-b4", "--batch", "4")
    b, job_b = record(tmp_path, "bf16-b8", "--batch", "8", "--bf16")
    done = memtui_cli("diff", str(a), str(b), "--json")
    assert done.returncode == 0, done.stderr
    diff = json.loads(done.stdout)
    steps_a, steps_b = report(memtui_cli, a)["steps"], report(memtui_cli, b)["steps"]
    # The activations' change is the two reports' own highs, to the byte.
    activations = diff["piles"]["activations"]["peak"]
    assert activations["a"] == highest(steps_a, "max", "activations")
    assert activations["b"] == highest(steps_b, "max", "activations")
    assert activations["change"] == activations["b"] - activations["a"] != 0
    assert diff["peak"]["a"] == max(s["peak"]["held"] for s in steps_a)
    assert diff["peak"]["b"] == max(s["peak"]["held"] for s in steps_b)
    for pile in ("weights", "optimizer_state"):  # the same model: the job's own counts, equal
        entry = diff["piles"][pile]
        assert entry["peak"] == entry["end"] == {
            "a": job_a[pile], "b": job_b[pile], "change": 0, "percent": 0.0
        }  # fmt: skip
        assert job_a[pile] == job_b[pile]
    # bf16 autocast: bfloat16 activations appear (in B's own dtypes too).
    appeared = {(d["pile"], d["dtype"]) for d in diff["dtypes"] if d["shift"] == "appeared"}
    assert ("activations", "bfloat16") in appeared
    assert any("bfloat16" in s["dtypes"]["activations"] for s in steps_b)
    # Each module listed has the reports' own figures on both sides.
    highs_a, highs_b = module_highs(steps_a), module_highs(steps_b)
    assert diff["modules"]["changed"]
    for module in diff["modules"]["changed"]:
        assert module["a"] == highs_a.get(module["module"])
        assert module["b"] == highs_b.get(module["module"])
    assert diff["steps"] | {"largest_peak_change": None} == {
        "a": 4, "b": 4, "common": 4, "common_first": 1, "common_last": 4,
        "common_ranges": "1-4", "largest_peak_change": None,
    }  # fmt: skip
    assert diff["alerts"] == {"new_in_b": [], "gone_in_b": []}
    text = memtui_cli("diff", str(a), str(b))
    assert text.returncode == 0 and "activations: bfloat16" in text.stdout
    assert "appeared in B" in text.stdout and text.stderr == ""


@pytest.mark.slow
def test_a_leak_new_in_b_is_the_one_bs_report_names(tmp_path: Path, memtui_cli: MemtuiCli) -> None:
    """A healthy loop against one that keeps its logits in `history` (tests/fixtures/growing):
    the leak and its alert are new in B, named by the holder the job's code wrote, with B's
    report's own count; nothing is gone."""
    runs = {}
    for name in ("healthy", "logits_list"):
        runs[name] = tmp_path / f"{name}.memtui"
        done = run_memtui(
            "run", "--headless", "-o", str(runs[name]), str(FIXTURES / "growing" / f"{name}.py"),
            "30", cwd=tmp_path, env=scrubbed_env(tmp_path / "rt"),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    done = memtui_cli("diff", str(runs["healthy"]), str(runs["logits_list"]), "--json")
    assert done.returncode == 0, done.stderr
    diff = json.loads(done.stdout)
    leaks = report(memtui_cli, runs["logits_list"])["leaks"]
    assert [leak["holder"] for leak in leaks] == ["history"]
    assert diff["leaks"] == {
        "new_in_b": [{"holder": "history", "kind": leaks[0]["kind"], "bytes": leaks[0]["bytes"]}],
        "gone_in_b": [],
    }
    new = [(a["kind"], a["names"], a["severity"]) for a in diff["alerts"]["new_in_b"]]
    assert ("leak", "history", "error") in new and diff["alerts"]["gone_in_b"] == []


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def small_run(path: Path, steps: range, rank: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_recording(path, [hello(rank=rank), *(bare_step(n) for n in steps)])


def test_a_session_folder_compares_rank_0_unless_told(tmp_path: Path) -> None:
    session = tmp_path / "session"
    small_run(session / "rank-0.memtui", range(1, 4), rank=0)
    small_run(session / "rank-1.memtui", range(1, 9), rank=1)
    single = small_run(tmp_path / "one" / "run.memtui", range(1, 6))
    code, out, err = run_cli("diff", str(session), str(single.parent), "--json")
    assert (code, err) == (0, "")
    document = json.loads(out)
    assert document["runs"]["a"]["rank"] == "0" and document["runs"]["a"]["steps"] == 3
    assert document["runs"]["b"] == {
        "path": str(single.parent), "rank": None, "steps": 5, "first_step": 1, "last_step": 5
    }  # fmt: skip
    code, out, _ = run_cli("diff", str(session), str(single), "--rank", "1", "--json")
    assert code == 0 and json.loads(out)["runs"]["a"]["steps"] == 8
    code, out, _ = run_cli("diff", str(session), str(single), "--rank", "1")
    assert "A: " + str(session) + " (rank 1; 2 recordings in the folder)" in out


def test_a_command_folder_compares_its_first_process(tmp_path: Path) -> None:
    """`memtui run -o DIR -- COMMAND` writes proc-N.memtui: no rank 0, so the first process."""
    command = tmp_path / "command"
    small_run(command / "proc-0.memtui", range(1, 3))
    small_run(command / "proc-1.memtui", range(1, 6))
    code, out, _ = run_cli("diff", str(command), str(command), "--rank", "proc-1", "--json")
    assert code == 0 and json.loads(out)["runs"]["a"] | {"path": ""} == {
        "path": "", "rank": "proc-1", "steps": 5, "first_step": 1, "last_step": 5
    }  # fmt: skip
    code, out, _ = run_cli("diff", str(command), str(command), "--json")
    assert code == 0 and json.loads(out)["runs"]["b"]["rank"] == "proc-0"


def test_runs_with_no_steps_in_common_say_so(tmp_path: Path) -> None:
    a = small_run(tmp_path / "a.memtui", range(1, 4))
    b = small_run(tmp_path / "b.memtui", range(100, 104))
    code, out, _ = run_cli("diff", str(a), str(b))
    assert code == 0 and "no steps in common" in out


def bad_inputs(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Each bad path, and what its one line says."""
    fifo = tmp_path / "fifo.memtui"
    os.mkfifo(fifo)
    (tmp_path / "empty.memtui").write_bytes(b"")
    (tmp_path / "text.memtui").write_text("not a recording\n" * 100)
    good = small_run(tmp_path / "good.memtui", range(1, 3))
    corrupt = tmp_path / "corrupt.memtui"
    corrupt.write_bytes(b"\x00" * 8 + good.read_bytes()[8:])
    truncated = tmp_path / "truncated.memtui"
    truncated.write_bytes(good.read_bytes()[:30])
    (tmp_path / "nothing").mkdir()
    many = tmp_path / "many"
    small_run(many / "x.memtui", range(1, 2))
    shutil.copy(many / "x.memtui", many / "y.memtui")
    return {
        "missing": (str(tmp_path / "missing.memtui"), "no such file"),
        "fifo": (str(fifo), "not a regular file (a FIFO)"),
        "empty": (str(tmp_path / "empty.memtui"), "empty file"),
        "text": (str(tmp_path / "text.memtui"), "not a memtui recording"),
        "corrupt": (str(corrupt), "not a memtui recording"),
        "truncated": (str(truncated), "truncated before its header was complete"),
        "no recording": (str(tmp_path / "nothing"), "no memtui recording"),
        "several": (str(many), "holds 2 recordings"),
    }


def test_bad_input_is_one_line_and_a_non_zero_exit(tmp_path: Path) -> None:
    good = str(small_run(tmp_path / "fine.memtui", range(1, 3)))
    for name, (path, words) in bad_inputs(tmp_path).items():
        for args in ((path, good), (good, path), (path, good, "--json")):
            code, out, err = run_cli("diff", *args)
            assert code == EXIT_BAD_INPUT, (name, code, err)
            assert out == "" and err.count("\n") == 1, (name, err)
            assert err.startswith("memtui: error: ") and words in err, (name, err)
            assert "Traceback" not in err


def test_a_rank_the_folder_lacks_and_a_bad_rank_are_refused(tmp_path: Path) -> None:
    session = tmp_path / "session"
    small_run(session / "rank-0.memtui", range(1, 3), rank=0)
    good = str(small_run(tmp_path / "fine.memtui", range(1, 3)))
    code, _, err = run_cli("diff", str(session), good, "--rank", "3")
    assert code == EXIT_BAD_INPUT and "no recording for rank 3 (it holds 0)" in err
    with pytest.raises(SystemExit) as refused, redirect_stderr(io.StringIO()) as stderr:
        main(["diff", str(session), good, "--rank", "\x1b[31m"])
    assert refused.value.code == EXIT_USAGE and "not a rank" in stderr.getvalue()
    assert "\x1b" not in stderr.getvalue()


def test_the_tui_needs_a_terminal(tmp_path: Path) -> None:
    good = str(small_run(tmp_path / "fine.memtui", range(1, 3)))
    code, out, err = run_cli("diff", good, good, "--tui")  # pytest's stdin is no terminal
    assert code == EXIT_USAGE and out == "" and "needs a terminal" in err
