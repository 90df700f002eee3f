"""One spelling per concept, enforced: the viewer names piles, alert kinds, NaN checks,
activation modes, exit statuses and leak kinds by their `memtui_protocol.schema` enums, never by
a string spelt again by hand.

Words on screen are free to say "weights" or "killed"; what this forbids is a concept's value
used where code decides something by it: compared (`kind == "oom"`), used as a key (a colour
map, `piles["activations"]`, `.get("weights")`), passed as `kind=`/`status=`, or offered as
a CLI choice or default. Each remaining literal below is a different concept that happens to
share a spelling, with the reason.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from pathlib import Path

from repo_paths import REPO

from memtui.commands.cli import build_parser
from memtui_protocol.schema import ActivationMode, AlertKind, ExitStatus, LeakKind, NanCheck, Pile

VIEWER = REPO / "memtui"
CONCEPTS = (Pile, AlertKind, NanCheck, ActivationMode, ExitStatus, LeakKind)
SPELLINGS = {member.value: enum.__name__ for enum in CONCEPTS for member in enum}
KEYWORDS = {"kind", "status", "nan_check", "activations", "pile", "choices", "default"}
NOT_THE_CONCEPT = {
    ("reports/checkpoint_plan.py", "error"): "the key of the estimate child's failure message",
    ("input/torch_snapshot.py", "oom"): "PyTorch's own trace action name in a snapshot",
    ("model/alloc_rows.py", "oom"): "the report's `alloc_events.oom` key (an allocator event)",
    ("reports/model_estimate.py", "error"): "the key of the estimate child's failure message",
    ("reports/what_if.py", "error"): "the key of a what-if run's failure message (the child's)",
    ("reports/snapshot_report.py", "fragmentation"): "a key of the snapshot report's JSON",
    ("reports/snapshot_report.py", "snapshot"): "a key of the snapshot report's JSON",
}


def _deciding(tree: ast.AST) -> Iterator[ast.expr]:
    """Every expression in a position where code decides by its value."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                yield side
                if isinstance(side, (ast.Tuple, ast.List, ast.Set)):
                    yield from side.elts
        elif isinstance(node, ast.Dict):
            yield from (key for key in node.keys if key is not None)
        elif isinstance(node, ast.Subscript):
            yield node.slice
        elif isinstance(node, ast.keyword) and node.arg in KEYWORDS:
            yield node.value
            if isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
                yield from node.value.elts
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in ("get", "setdefault", "pop"):
                yield node.args[0]


def spelt_by_hand(folder: Path) -> set[tuple[str, str]]:
    """(file relative to `folder`, value) of each concept value spelt as a literal there."""
    found: set[tuple[str, str]] = set()
    for path in sorted(folder.rglob("*.py")):
        for node in _deciding(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and (node.value in SPELLINGS)
            ):
                found.add((path.relative_to(folder).as_posix(), node.value))
    return found


def test_the_viewer_decides_by_enum_members_not_by_strings() -> None:
    found = spelt_by_hand(VIEWER)
    new = sorted(found - NOT_THE_CONCEPT.keys())
    assert not new, f"spell these with their enum ({SPELLINGS}): {new}"
    stale = sorted(NOT_THE_CONCEPT.keys() - found)
    assert not stale, f"no longer needed, remove from NOT_THE_CONCEPT: {stale}"


def test_the_check_sees_a_hand_spelt_kind(tmp_path: Path) -> None:
    """The rule is not vacuous: each position it covers is caught."""
    (tmp_path / "widget.py").write_text(
        "style = 'red' if alert.kind == 'oom' else ''\n"
        "colours = {'weights': '#fff'}\n"
        "value = piles['activations']\n"
        "parser.add_argument('--nan-check', choices=('default', 'full'))\n"
        "End(status='killed')\n"
        "label = 'weights'  # display text: allowed\n"
    )
    assert spelt_by_hand(tmp_path) == {
        ("widget.py", "oom"),
        ("widget.py", "weights"),
        ("widget.py", "activations"),
        ("widget.py", "default"),
        ("widget.py", "full"),
        ("widget.py", "killed"),
    }


def test_cli_choices_are_the_enums() -> None:
    """`--nan-check` and `--activations` offer exactly the members, defaulting to theirs."""
    command_action = next(action for action in build_parser()._actions if action.dest == "command")
    assert isinstance(command_action, argparse._SubParsersAction)
    subcommands: dict[str, argparse.ArgumentParser] = command_action.choices
    for command in ("run", "demo"):
        actions = {action.dest: action for action in subcommands[command]._actions}
        activations = actions["activations"]
        assert activations.choices is not None
        assert list(activations.choices) == [mode.value for mode in ActivationMode]
        assert activations.default == ActivationMode.AUTO
    nan_check = {action.dest: action for action in subcommands["run"]._actions}["nan_check"]
    assert nan_check.choices is not None
    assert list(nan_check.choices) == [check.value for check in NanCheck]
    assert nan_check.default == NanCheck.DEFAULT
