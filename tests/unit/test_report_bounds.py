"""`memtui report` in bounded time and memory, and "running" only while the writer can write.

- A recording its job still writes (at 50 MB/s, `report` had not returned after 150 s) is read
  to its size when reading began, finishing the frame that size cuts, then reported.
- A writer that is a zombie (killed, not yet reaped by its parent) or has SIGKILL pending is
  not alive: right after a process-group SIGKILL, `report` says killed, not "job running".
- `report --json` writes its steps a batch at a time (a 200,000-step recording peaked at
  4.8 GB building the whole document; `benchmarks/viewer_bounds.py report` measures it), in
  the very bytes the whole document had.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from contextlib import redirect_stdout
from pathlib import Path
from types import ModuleType

import msgspec
import pytest

from memtui.commands.cli import main
from memtui.input.recording_file import writer_alive
from memtui.model.recording import read_recording
from memtui.reports.report import report_of
from memtui.reports.report_format import strict_json
from memtui.reports.report_json import BATCH, write_report_json
from memtui_protocol import schema, wire
from memtui_protocol.runtime_dir import pid_alive, process_create_time, process_ending

SAFETY_NET = 60.0


def long_messages(builder: ModuleType, steps: int) -> list[schema.Message]:
    """The demo job run for `steps` steps, an alert with unsafe characters now and then."""
    messages: list[schema.Message] = builder.demo_messages(with_end=False)[:2]
    for number in range(1, steps + 1):
        step = builder.make_step((number - 1) % builder.STEPS + 1)
        alerts = list(step.alerts)
        if number % 97 == 0:
            alerts.append(schema.Alert(kind="note\u202e", message="bidi \u202e and \x1b[31m"))
        messages.append(msgspec.structs.replace(step, step=number, alerts=alerts))
    return messages


@pytest.mark.parametrize("steps", [0, 1, BATCH - 1, BATCH, BATCH + 1, 3 * BATCH + 7])
def test_the_streamed_json_is_the_whole_documents_bytes(
    tmp_path: Path, builder: ModuleType, steps: int
) -> None:
    path = tmp_path / "long.memtui"
    path.write_bytes(builder.encode_recording(long_messages(builder, steps)))
    recording = read_recording(path)
    out = io.StringIO()
    write_report_json(recording, out.write)
    assert out.getvalue() == strict_json(report_of(recording)) + "\n"
    assert len(json.loads(out.getvalue())["steps"]) == steps


def test_the_fixture_report_is_unchanged(builder: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "demo.memtui"
    path.write_bytes(builder.encode_recording(builder.demo_messages()))
    recording = read_recording(path)
    out = io.StringIO()
    write_report_json(recording, out.write)
    assert out.getvalue() == strict_json(report_of(recording)) + "\n"


class Chunks(io.StringIO):
    """stdout that remembers the largest single write."""

    largest = 0

    def write(self, text: str) -> int:
        self.largest = max(self.largest, len(text))
        return super().write(text)


def test_report_json_is_written_a_batch_at_a_time(tmp_path: Path, builder: ModuleType) -> None:
    """Before, the whole document was built and printed in one piece."""
    path = tmp_path / "long.memtui"
    path.write_bytes(builder.encode_recording(long_messages(builder, 8 * BATCH)))
    stdout = Chunks()
    with redirect_stdout(stdout):
        assert main(["report", str(path), "--json"]) == 0
    document = stdout.getvalue()
    assert len(json.loads(document)["steps"]) == 8 * BATCH
    assert stdout.largest < len(document) / 4  # at most a batch's entries at once


def test_a_recording_that_keeps_growing_is_read_to_its_size_at_the_start(
    tmp_path: Path, builder: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read lets the 'job' append a frame (a writer faster than any reader): the read
    still ends, at the size the file had, with the frame that size cut in two finished."""
    path = tmp_path / "growing.memtui"
    messages: list[schema.Message] = builder.demo_messages(with_end=False)
    cut = wire.encode(msgspec.structs.replace(builder.make_step(1), step=builder.STEPS + 1))
    path.write_bytes(builder.encode_recording(messages) + cut[: len(cut) // 2])
    writer = os.open(path, os.O_WRONLY | os.O_APPEND)
    appended = [0]
    real_pread = os.pread

    def pread_while_it_grows(fd: int, size: int, offset: int) -> bytes:
        if appended[0] == 0:
            os.write(writer, cut[len(cut) // 2 :])
        elif appended[0] < 5000:  # a bound for the test only: the file would grow forever
            number = builder.STEPS + 1 + appended[0]
            os.write(writer, wire.encode(msgspec.structs.replace(cut_step, step=number)))
        appended[0] += 1
        return real_pread(fd, size, offset)

    cut_step = builder.make_step(2)
    monkeypatch.setattr(os, "pread", pread_while_it_grows)
    try:
        recording = read_recording(path)
    finally:
        monkeypatch.undo()
        os.close(writer)
    numbers = [step.step for step in recording.steps]
    assert numbers[: builder.STEPS + 1] == list(range(1, builder.STEPS + 2))  # the cut one too
    assert len(numbers) < builder.STEPS + 10, len(numbers)  # before: all 5,000 appended
    assert recording.warning is None


def wait_until(condition: object, limit: float = SAFETY_NET) -> None:
    give_up = time.monotonic() + limit
    while time.monotonic() < give_up and not condition():  # type: ignore[operator]
        time.sleep(0.01)


def state_of(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as handle:
        line = handle.read()
    return line[line.rindex(b")") + 2 :].split()[0]


def hello_of(pid: int) -> schema.Hello:
    return schema.Hello(
        format_version=schema.FORMAT_VERSION,
        agent_version="t",
        pid=pid,
        argv=["train.py"],
        started="",
        started_unix=time.time(),
        hostname=os.uname().nodename,
        process_create_time=process_create_time(pid),
    )


def test_a_zombie_writer_is_not_alive(tmp_path: Path) -> None:
    """Killed, not yet reaped: `kill(pid, 0)` still finds it, yet it will never write."""
    child = subprocess.Popen(["sleep", "600"])
    try:
        hello = hello_of(child.pid)
        assert writer_alive(hello) and not process_ending(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        wait_until(lambda: state_of(child.pid) == b"Z")
        assert state_of(child.pid) == b"Z"  # not reaped: we have not waited for it
        assert not pid_alive(child.pid, hello.process_create_time)
        assert not writer_alive(hello)
        path = tmp_path / "rec.memtui"
        path.write_bytes(wire.preamble() + wire.encode(hello))
        report = read_recording(path)
        assert report.how_it_ended() is schema.ExitStatus.KILLED
    finally:
        child.kill()
        child.wait()


def test_right_after_a_process_group_sigkill_the_writer_is_not_alive() -> None:
    """No wait at all between the kill and the question (pending SIGKILL, exiting, zombie)."""
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        hello = hello_of(child.pid)
        assert writer_alive(hello)
        os.killpg(child.pid, signal.SIGKILL)
        assert not writer_alive(hello)
    finally:
        child.kill()
        child.wait()
