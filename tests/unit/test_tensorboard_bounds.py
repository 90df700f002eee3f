"""`memtui export --format tensorboard` writes through nothing planted, and in work linear in
steps plus alerts.

Its folder (-o DIR, or RECORDING.tensorboard) and each run's folder are opened relative to
their parent without following links (made 0700 when missing), and the event file is created
in its run's folder with O_CREAT|O_EXCL|O_NOFOLLOW (0600): a link (to a folder, to a file,
dangling), a FIFO, a file, or another user's folder at either name is refused in one line, and
nothing appears where a link points. Before, TensorBoard's own writer made the folders and
opened the file by path: a link planted by another user made root's export write an event file
into a root-only folder."""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Callable
from contextlib import redirect_stderr
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from memtui.commands.cli import main
from memtui.reports.tensorboard_export import count_points
from memtui_protocol import schema

pytest.importorskip("tensorboard", reason="TensorBoard is in the [test] extra")

STRANGER = 65534


def _link_to_folder(where: Path, name: Path) -> None:
    private = where / "root-only"
    private.mkdir(mode=0o700)
    name.symlink_to(private)


def _link_to_file(where: Path, name: Path) -> None:
    (where / "precious").write_bytes(b"keep")
    name.symlink_to(where / "precious")


def _dangling(where: Path, name: Path) -> None:
    name.symlink_to(where / "nowhere")


def _fifo(where: Path, name: Path) -> None:
    os.mkfifo(name)


def _file(where: Path, name: Path) -> None:
    name.write_bytes(b"keep")


def _strangers_folder(where: Path, name: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a folder of another user")
    name.mkdir()
    os.chown(name, STRANGER, STRANGER)


PLANTED: dict[str, Callable[[Path, Path], None]] = {
    "link to a folder": _link_to_folder,
    "link to a file": _link_to_file,
    "dangling link": _dangling,
    "fifo": _fifo,
    "file": _file,
    "another user's folder": _strangers_folder,
}


def export(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["export", *argv, "--format", "tensorboard"])
    return code, err.getvalue()


def untouched(where: Path) -> None:
    """Nothing appeared through a link: the root-only folder is empty, the file kept."""
    if (where / "root-only").exists():
        assert list((where / "root-only").iterdir()) == []
    if (where / "precious").exists():
        assert (where / "precious").read_bytes() == b"keep"
    assert not (where / "nowhere").exists()


@pytest.mark.parametrize("kind", sorted(PLANTED))
@pytest.mark.parametrize("level", ["the export folder", "the run folder"])
def test_nothing_is_written_through_what_is_planted(
    tmp_path: Path, builder: ModuleType, kind: str, level: str
) -> None:
    recording = tmp_path / "demo.memtui"
    recording.write_bytes(builder.encode_recording(builder.demo_messages()))
    default = tmp_path / "demo.tensorboard"  # where the export goes without -o
    if level == "the export folder":
        PLANTED[kind](tmp_path, default)
    else:
        default.mkdir()
        PLANTED[kind](tmp_path, default / "demo")
    code, err = export([str(recording)])
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("memtui: error: "), err
    assert "refusing" in err or "not a folder" in err, err
    untouched(tmp_path)


def test_the_files_are_private_whatever_the_umask(tmp_path: Path, builder: ModuleType) -> None:
    recording = tmp_path / "demo.memtui"
    recording.write_bytes(builder.encode_recording(builder.demo_messages()))
    old = os.umask(0)
    try:
        code, err = export([str(recording), "-o", str(tmp_path / "tb")])
    finally:
        os.umask(old)
    assert code == 0, err
    run = tmp_path / "tb" / "demo"
    assert stat.S_IMODE((tmp_path / "tb").stat().st_mode) == 0o700
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    [events] = list(run.iterdir())
    assert events.name.startswith("events.out.tfevents.")
    assert stat.S_IMODE(events.stat().st_mode) == 0o600


def many_kinds(builder: ModuleType, steps: int) -> list[schema.Message]:
    """A recording whose every step raises an alert of a kind of its own (a newer agent's
    kinds, kept as written)."""
    messages: list[schema.Message] = builder.demo_messages(with_end=False)[:2]
    for number in range(1, steps + 1):
        alert = schema.Alert(kind=f"kind-{number}", message=f"at step {number}")
        step = builder.make_step((number - 1) % builder.STEPS + 1)
        messages.append(msgspec.structs.replace(step, step=number, alerts=[alert]))
    return messages


def test_alert_counts_grow_with_alerts_not_steps_times_kinds(
    tmp_path: Path, builder: ModuleType
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator

    steps = 120
    recording = tmp_path / "kinds.memtui"
    recording.write_bytes(builder.encode_recording(many_kinds(builder, steps)))
    code, err = export([str(recording), "-o", str(tmp_path / "tb")])
    assert code == 0, err
    accumulator = EventAccumulator(str(tmp_path / "tb" / "kinds"), size_guidance={TENSORS: 0})
    accumulator.Reload()
    tags = [tag for tag in accumulator.Tags()["tensors"] if tag.startswith("alerts/")]
    assert len(tags) == steps  # one curve per kind
    values = {tag: {e.step: e.tensor_proto.float_val[0] for e in accumulator.Tensors(tag)}
              for tag in tags}  # fmt: skip
    written = sum(len(points) for points in values.values())
    assert written <= 2 * steps + 3 * steps  # 2 x kinds + 3 x alerts; before: steps x kinds
    for number in (1, 50, steps):  # each curve holds its exact count at every step
        points = values[f"alerts/kind-{number}"]
        for at in range(1, steps + 1):
            assert points[max(p for p in points if p <= at)] == (1 if at == number else 0)


def test_count_points_keeps_the_curve_and_only_its_bends() -> None:
    from collections import Counter

    order = [1, 2, 3, 4, 5, 6, 7, 8]
    per_step = {3: Counter({"a": 2}), 4: Counter({"a": 2}), 5: Counter({"a": 2}), 7: Counter(b=1)}
    points = count_points(order, ["a", "b"], per_step)
    assert [sorted(p.items()) for p in points] == [
        [("a", 0), ("b", 0)],  # the first step: every kind
        [("a", 0)],
        [("a", 2)],
        [("a", 2)],
        [("a", 2)],
        [("a", 0), ("b", 0)],
        [("b", 1)],
        [("a", 0), ("b", 0)],  # the last step: every kind
    ]
    assert count_points([], ["a"], {}) == []
