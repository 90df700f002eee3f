"""The test layers' rules (tests/layer_rules.py) fail the tests they are written against.

Each case is a small test file in a `unit/` or `integration/` folder, run by pytest in a fresh
interpreter (pytester) with the rules as its only plugin: what an unmarked test may not do (start
an interpreter, use over 5 s of CPU time), where a slow test may not live, and that a cheap
unmarked test and a marked one that starts an interpreter both pass.
"""

from __future__ import annotations

import pytest
from repo_paths import REPO

pytestmark = pytest.mark.slow  # every test here starts pytest in a fresh interpreter

STARTS_PYTHON = """
import subprocess, sys
{mark}
def test_it():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""
BURNS_CPU = """
import time
def test_it():
    end = time.process_time() + {seconds}
    while time.process_time() < end:
        pass
"""
MARKED_SLOW = """
import pytest
@pytest.mark.slow
def test_it():
    pass
"""


def _run(pytester: pytest.Pytester, folder: str, source: str) -> pytest.RunResult:
    """`source` as `FOLDER/test_case.py`, run by pytest with the rules as its one plugin."""
    (pytester.path / folder).mkdir()
    (pytester.path / folder / "test_case.py").write_text(source)
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts interpreters\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(REPO / "tests"))
        return pytester.runpytest_subprocess("-p", "layer_rules", "-p", "no:cacheprovider", folder)


def test_an_unmarked_test_that_starts_an_interpreter_fails(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "integration", STARTS_PYTHON.format(mark=""))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*an unmarked test started an interpreter*mark it*slow*"])


def test_a_slow_test_may_start_an_interpreter(pytester: pytest.Pytester) -> None:
    source = "import pytest\n" + STARTS_PYTHON.format(mark="@pytest.mark.slow")
    _run(pytester, "integration", source).assert_outcomes(passed=1)


def test_an_unmarked_test_over_its_cpu_budget_fails(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "unit", BURNS_CPU.format(seconds=5.5))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*used * s of CPU time, over the 5 s an unmarked test may use*"])


def test_a_cheap_unmarked_test_passes(pytester: pytest.Pytester) -> None:
    _run(pytester, "unit", BURNS_CPU.format(seconds=0.2)).assert_outcomes(passed=1)


@pytest.mark.parametrize("layer", ["unit", "tui"])
def test_a_slow_test_in_a_fast_layer_stops_the_collection(
    pytester: pytest.Pytester, layer: str
) -> None:
    result = _run(pytester, layer, MARKED_SLOW)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*is marked slow in tests/" + layer + "*tests/integration*"])


def test_a_slow_test_in_integration_is_collected(pytester: pytest.Pytester) -> None:
    _run(pytester, "integration", MARKED_SLOW).assert_outcomes(passed=1)
