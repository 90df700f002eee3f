"""Reliability, round three (issue 27), security: nothing written through a planted link, no
injection into a process other than the one checked.

S1: every file the agent and memtui write is created relative to an opened folder with
`O_CREAT|O_EXCL|O_NOFOLLOW`, never through a resolved name; session folders must be private.
What a user gets when a link is planted at a recording's name: the job runs exactly as without
memtui, unrecorded (its live socket still works), with one line on stderr naming the path.
S2: `memtui export` writes through the same creator. J5: modes are explicit, whatever the job's
umask. The kinds of things planted are the fuzz inputs of the adversarial round: links to a file,
to a folder, dangling links, FIFOs, folders, another user's file. S3: `memtui attach` pins its
target (uid, start time, pidfd) and checks the pin again right before the injection and, under
gdb, once gdb holds the process; gdb cannot call into processes on this machine, so the pin is
tested directly, through the refusal path, and through gdb's own check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import cast

import msgspec
import pytest
from cli_harness import MEMTUI, scrubbed_env
from hypothesis import given, settings
from hypothesis import strategies as st
from repo_paths import FIXTURES

from memtui.commands.attach_command import (
    PENDING_SUFFIX,
    attach_pending,
    clear_pending,
    mark_pending,
)
from memtui.commands.attach_inject import deliver_gdb, gdb_script, runner_lines
from memtui.commands.attach_target import (
    REUSED,
    AttachRefused,
    Pin,
    Target,
    check_target,
    confirm_pin,
    pin_process,
    read_pin,
    release_pin,
)
from memtui.commands.run_command import bootstrap_dir
from memtui.commands.stop_record import record_stop
from memtui.model.recording import read_recording
from memtui_agent.memory.descriptors import OwnedFd
from memtui_agent.startup.autostart import PROCESS_INDEX_FILE, claim_process_index
from memtui_protocol import notes
from memtui_protocol.attach import Action, Answer, write_reply
from memtui_protocol.runtime_dir import Sidecar, ensure_private_dir, runtime_dir, write_sidecar
from memtui_protocol.safe_open import (
    RefusedPath,
    Replace,
    create_private,
    make_folder,
    write_new,
)

DEMO = FIXTURES / "demo.memtui"
STRANGER = 65534
PRECIOUS = b"a file the job must never replace\n"


def _precious(folder: Path) -> Path:
    target = folder / "precious"
    target.write_bytes(PRECIOUS)
    return target


# ----- what may be planted at a name (the fuzz inputs) ------------------------------------------


def _link_to_file(folder: Path, name: Path) -> None:
    name.symlink_to(_precious(folder))


def _dangling_link(folder: Path, name: Path) -> None:
    name.symlink_to(folder / "nowhere" / "x")


def _link_to_folder(folder: Path, name: Path) -> None:
    (folder / "elsewhere").mkdir()
    name.symlink_to(folder / "elsewhere")


def _fifo(folder: Path, name: Path) -> None:
    os.mkfifo(name)


def _folder(folder: Path, name: Path) -> None:
    name.mkdir()


def _strangers_file(folder: Path, name: Path) -> None:
    name.write_bytes(PRECIOUS)
    if os.geteuid() == 0:
        os.chown(name, STRANGER, STRANGER)
    else:
        pytest.skip("needs root to make a file of another user")


PLANTED: dict[str, Callable[[Path, Path], None]] = {
    "link to a file": _link_to_file,
    "dangling link": _dangling_link,
    "link to a folder": _link_to_folder,
    "fifo": _fifo,
    "folder": _folder,
    "another user's file": _strangers_file,
}


def _untouched(folder: Path) -> None:
    """The planted thing's target still holds what it held, and nothing appeared through the
    links (a dangling link's target, a linked folder's contents)."""
    precious = folder / "precious"
    if precious.exists():
        assert precious.read_bytes() == PRECIOUS
    assert not (folder / "nowhere").exists()
    if (folder / "elsewhere").exists():
        assert list((folder / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_create_private_never_writes_through_what_is_planted(tmp_path: Path, kind: str) -> None:
    name = tmp_path / "rec.memtui"
    PLANTED[kind](tmp_path, name)
    done: list[BaseException | int] = []

    def create() -> None:
        try:
            done.append(create_private(name))
        except BaseException as exc:
            done.append(exc)

    worker = threading.Thread(target=create, daemon=True)
    worker.start()
    worker.join(10)
    assert done, "create_private blocked (a FIFO opened?)"
    assert isinstance(done[0], RefusedPath), done
    message = str(done[0])
    assert "\n" not in message and str(name) in message
    _untouched(tmp_path)


def test_a_link_planted_in_place_of_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "session").symlink_to(tmp_path / "real")
    with pytest.raises(RefusedPath, match="symbolic link"):
        create_private(tmp_path / "session" / "proc-0.memtui", private_folder=True)
    assert list((tmp_path / "real").iterdir()) == []


@pytest.mark.parametrize("mode", [0o770, 0o777, 0o1777, 0o720])
def test_a_session_folder_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    session = tmp_path / "session"
    session.mkdir()
    os.chmod(session, mode)
    with pytest.raises(RefusedPath, match="writable by other users"):
        create_private(session / "proc-0.memtui", private_folder=True)
    os.chmod(session, 0o755)  # readable by others is fine: nobody else can plant a name
    os.close(create_private(session / "proc-0.memtui", private_folder=True))


def test_a_session_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a folder of another user")
    session = tmp_path / "session"
    session.mkdir(mode=0o700)
    os.chown(session, STRANGER, STRANGER)
    with pytest.raises(RefusedPath, match=f"belongs to uid {STRANGER}"):
        create_private(session / "rank-0.memtui", private_folder=True)


def test_modes_are_explicit_whatever_the_umask(tmp_path: Path) -> None:
    """J5 at the creators: a umask of 0o777 does not make a 000 file or folder."""
    previous = os.umask(0o777)
    try:
        os.close(create_private(tmp_path / "rec.memtui"))
        make_folder(tmp_path / "session")
        ensure_private_dir(tmp_path / "rt")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "rec.memtui").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "session").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "rt").stat().st_mode) == 0o700
    (tmp_path / "broken").mkdir(mode=0o700)
    os.chmod(tmp_path / "broken", 0)  # what an older memtui left under umask 0o777
    ensure_private_dir(tmp_path / "broken")
    assert stat.S_IMODE((tmp_path / "broken").stat().st_mode) == 0o700


def test_rerun_replaces_only_our_own_file_by_name(tmp_path: Path) -> None:
    own = tmp_path / "rec.memtui"
    own.write_bytes(b"old run")
    other_name = tmp_path / "hardlink"
    os.link(own, other_name)  # another name for the same file: it keeps the old content
    write_new(own, b"new run", Replace.OWN_FILE)  # what --force allows
    assert own.read_bytes() == b"new run" and other_name.read_bytes() == b"old run"


# ----- S1 for every writer: each goes through the protocol's opener (issue 33) ------------------


def _finishes(call: Callable[[], object]) -> object:
    """What `call` returned or raised; it must return (a FIFO opened for writing blocks)."""
    done: list[object] = []

    def attempt() -> None:
        try:
            done.append(call())
        except BaseException as exc:
            done.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)  # a safety net: a writer that opened the FIFO never returns
    assert done, "the writer blocked (a FIFO opened?)"
    return done[0]


def _still_planted(folder: Path, name: Path, kind: str) -> None:
    """Nothing was written through the planted thing, and it is still there as planted."""
    _untouched(folder)
    if kind == "another user's file":
        assert name.read_bytes() == PRECIOUS
    elif kind == "fifo":
        assert stat.S_ISFIFO(os.lstat(name).st_mode)
    elif kind == "folder":
        assert list(name.iterdir()) == []


def _bootstrap_note() -> Callable[[str], None]:
    """The bootstrap `sitecustomize`'s `_note`, loaded under another name (its `_main` runs
    only when `site` imports it as `sitecustomize`)."""
    spec = importlib.util.spec_from_file_location(
        "memtui_bootstrap_under_test", bootstrap_dir() / "sitecustomize.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return cast(Callable[[str], None], module._note)


NOTE_WRITERS: dict[str, Callable[[], Callable[[str], None]]] = {
    "protocol": lambda: notes.note,
    "bootstrap": _bootstrap_note,
}
"""`memtui_protocol.notes.note` and the bootstrap's copy, which must never drift from it."""


def test_both_note_writers_write_the_same_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = {}
    message = "agent unavailable\nin this interpreter " + "x" * 600
    for writer, load in NOTE_WRITERS.items():
        path = tmp_path / f"notes-{writer}.txt"
        path.write_bytes(b"")
        path.chmod(0o600)
        monkeypatch.setenv(notes.NOTES_VARIABLE, str(path))
        load()(message)
        written[writer] = path.read_bytes()
    assert written["bootstrap"] == written["protocol"] == notes.note_line(message)
    assert written["protocol"].count(b"\n") == 1 and len(written["protocol"]) == 501


@pytest.mark.parametrize("writer", sorted(NOTE_WRITERS))
@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_the_note_writers_refuse_what_is_planted_at_the_notes_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, writer: str
) -> None:
    """Both writers of `MEMTUI_NOTES` lines refuse the same things: a link, a FIFO (without
    blocking), a folder, another user's file; neither raises into the job."""
    name = tmp_path / "notes.txt"
    PLANTED[kind](tmp_path, name)
    monkeypatch.setenv(notes.NOTES_VARIABLE, str(name))
    note = NOTE_WRITERS[writer]()
    assert _finishes(lambda: note("pid 7 trained but was not recorded: why")) is None
    _still_planted(tmp_path, name, kind)


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_the_process_index_refuses_what_is_planted(tmp_path: Path, kind: str) -> None:
    session = tmp_path / "session"
    session.mkdir(mode=0o700)
    assert [claim_process_index(str(session)) for _ in range(3)] == [0, 1, 2]
    name = session / PROCESS_INDEX_FILE
    name.unlink()
    PLANTED[kind](tmp_path, name)
    outcome = _finishes(lambda: claim_process_index(str(session)))
    assert isinstance(outcome, RefusedPath), outcome
    assert "\n" not in str(outcome) and str(name) in str(outcome)
    _still_planted(tmp_path, name, kind)


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_a_reopened_recording_is_never_what_is_planted_at_its_name(
    tmp_path: Path, kind: str
) -> None:
    """After a job closed the agent's descriptor, the recording is reopened by its name only if
    the name still holds that very file: a link, even one to the recording itself, is not."""
    name = tmp_path / "rec.memtui"
    owned = OwnedFd(create_private(name))
    assert owned.fd is not None
    os.close(owned.fd)  # what a job's `os.closerange` does
    assert owned.reopen(name) and owned.close()
    moved = tmp_path / "moved.memtui"
    name.rename(moved)
    PLANTED[kind](tmp_path, name)
    assert _finishes(lambda: owned.reopen(name)) is False
    _still_planted(tmp_path, name, kind)
    if name.is_dir() and not name.is_symlink():
        name.rmdir()
    else:
        name.unlink()
    name.symlink_to(moved)  # the very file, through a link: never followed
    assert owned.reopen(name) is False and moved.read_bytes() == b""


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_a_pending_attach_mark_refuses_what_is_planted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    monkeypatch.setenv("MEMTUI_RUNTIME_DIR", str(tmp_path / "rt"))
    pid = os.getpid()
    mark_pending(pid)
    assert attach_pending(pid)
    clear_pending(pid)
    name = runtime_dir() / f"{pid}{PENDING_SUFFIX}"
    PLANTED[kind](tmp_path, name)
    assert _finishes(lambda: mark_pending(pid)) is None
    assert _finishes(lambda: attach_pending(pid)) is False
    _still_planted(tmp_path, name, kind)


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_the_attach_reply_refuses_what_is_planted_at_its_temporary_name(
    tmp_path: Path, kind: str
) -> None:
    if kind == "another user's file" and os.geteuid() != 0:
        pytest.skip("needs root to make a file of another user")
    reply = tmp_path / "reply.json"
    write_reply(str(reply), Answer.STARTED, "ok")
    assert json.loads(reply.read_text())["state"] == Answer.STARTED.value
    reply.unlink()

    def planted_then_replied() -> Path:  # the temporary name holds the writing thread's id
        name = Path(f"{reply}.{os.getpid()}.{threading.get_ident()}.tmp")
        PLANTED[kind](tmp_path, name)
        write_reply(str(reply), Answer.REFUSED, "no")
        return name

    name = _finishes(planted_then_replied)
    assert isinstance(name, Path), name
    assert not reply.exists()
    _still_planted(tmp_path, name, kind)


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_a_sidecar_refuses_what_is_planted_at_its_temporary_name(tmp_path: Path, kind: str) -> None:
    runtime = ensure_private_dir(tmp_path / "rt")
    sidecar = Sidecar(pid=os.getpid(), socket=str(runtime / "1.sock"), argv=["train.py"])
    assert write_sidecar(runtime, "1", sidecar) == runtime / "1.json"
    name = runtime / ".2.json.tmp"
    PLANTED[kind](tmp_path, name)
    outcome = _finishes(lambda: write_sidecar(runtime, "2", sidecar))
    assert isinstance(outcome, RefusedPath), outcome
    assert not (runtime / "2.json").exists()
    _still_planted(tmp_path, name, kind)


@pytest.mark.parametrize("kind", ["link to a file", "another user's file"])
def test_memtuis_stop_frame_is_never_appended_through_what_is_planted(
    tmp_path: Path, builder: ModuleType, kind: str
) -> None:
    """`record_stop` appends only to a regular recording of ours: a link to a recording, or
    another user's recording, that would otherwise take the frame is left as it is."""
    dead = msgspec.structs.replace(builder.hello(), process_create_time=1.0)  # not this pid's
    messages = [dead, *builder.demo_messages(with_end=False)[1:]]
    data = builder.encode_recording(messages)
    own = tmp_path / "own.memtui"
    own.write_bytes(data)
    assert record_stop(own, 143) == 1  # the control: a recording of ours takes the frame
    name = tmp_path / "rec.memtui"
    if kind == "link to a file":
        (tmp_path / "precious").write_bytes(data)
        name.symlink_to(tmp_path / "precious")
    else:
        name.write_bytes(data)
        if os.geteuid() != 0:
            pytest.skip("needs root to make a file of another user")
        os.chown(name, STRANGER, STRANGER)
    assert record_stop(name, 143) == 0
    kept = tmp_path / "precious" if kind == "link to a file" else name
    assert kept.read_bytes() == data


# ----- S2: memtui export ------------------------------------------------------------------------


def _export(folder: Path, output: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MEMTUI, "export", str(DEMO), "--format", "csv", "-o", output, *extra],
        cwd=folder, env=scrubbed_env(folder / "rt"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("kind", sorted(PLANTED))
@pytest.mark.slow  # starts an interpreter
def test_export_refuses_what_is_planted_in_one_line(tmp_path: Path, kind: str) -> None:
    """Before issue 27 `write_text` followed the link (overwrote the target) and blocked forever
    on a FIFO (here: the 60 s timeout)."""
    name = tmp_path / "out.csv"
    PLANTED[kind](tmp_path, name)
    result = _export(tmp_path, str(name))
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memtui: error: "), result.stderr
    assert "Traceback" not in result.stderr
    _untouched(tmp_path)


@pytest.mark.slow  # starts an interpreter
def test_export_writes_a_new_file_and_replaces_one_only_with_force(tmp_path: Path) -> None:
    """Issue 32: an existing output is refused in one line, even an earlier export (nothing
    proves it is still what memtui wrote); `--force` replaces it."""
    name = tmp_path / "out.csv"
    result = _export(tmp_path, str(name))
    assert result.returncode == 0, result.stderr
    name.write_text("the user's edits\n")
    again = _export(tmp_path, str(name))
    assert again.returncode == 1, again.stderr
    assert again.stderr.strip().splitlines() == [
        f"memtui: error: {name}: exists; refusing to overwrite it (--force replaces it)"
    ]
    assert name.read_text() == "the user's edits\n"
    forced = _export(tmp_path, str(name), "--force")
    assert forced.returncode == 0, forced.stderr
    assert name.read_text().startswith("step,")
    assert stat.S_IMODE(name.stat().st_mode) == 0o600


# ----- S1 in real jobs: a link at proc-N, rank-N, or at -o after memtui run's own check ----------

JOB = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for step in range(3):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        print(step, loss.item().hex(), flush=True)
""")


@pytest.mark.slow
def test_links_planted_at_recording_names_are_never_followed(tmp_path: Path) -> None:
    """Three jobs at once, each with a link planted where its recording goes: in a session
    folder (`proc-0.memtui` under `memtui run -- COMMAND`; `rank-1.memtui` of a rank), and at
    the `-o` file after `memtui run`'s own check (the agent gets the name as memtui passes it).
    Each job prints what a plain run prints and exits 0, the linked file keeps its content, and
    stderr says once why this process is unrecorded."""
    (tmp_path / "job.py").write_text(JOB)
    plain = subprocess.run(
        [sys.executable, "job.py"],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stderr
    cases = {}
    for name, planted, extra in (
        ("proc", "proc-0.memtui", {}),
        ("rank", "rank-1.memtui", {"RANK": "1", "WORLD_SIZE": "2"}),
        ("file", None, {}),
    ):
        folder = tmp_path / name
        folder.mkdir()
        target = folder / "precious"
        target.write_bytes(PRECIOUS)
        if name == "file":
            # What `memtui run -o rec.memtui job.py` starts, the link planted after its check.
            output = folder / "rec.memtui"
            output.symlink_to(target)
            env = scrubbed_env(folder / "rt", MEMTUI_RECORD=str(output), **extra)
            command = [sys.executable, "-m", "memtui_agent.startup.runner", "job.py"]
        else:
            session = folder / "session"
            session.mkdir(mode=0o700)
            (session / planted).symlink_to(target)  # type: ignore[operator]
            command = [*MEMTUI, "run", "--headless", "-o", str(session), "--"]
            command += [sys.executable, "job.py"]
            env = scrubbed_env(folder / "rt", **extra)
        (folder / "job.py").write_text(JOB)
        process = subprocess.Popen(
            command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        cases[name] = (target, process)
    for name, (target, process) in cases.items():
        stdout, stderr = process.communicate(timeout=240)
        assert process.returncode == 0, f"{name}: {stderr}"
        assert stdout == plain.stdout, name
        assert target.read_bytes() == PRECIOUS, f"{name}: the link was followed"
        said = [line for line in stderr.splitlines() if "symbolic link" in line]
        assert len(said) == 1, f"{name}: {stderr}"
        assert "Traceback" not in stderr


@pytest.mark.slow
def test_a_umask_0777_job_gets_a_usable_recording_and_later_jobs_their_socket(
    tmp_path: Path,
) -> None:
    """J5: a job that sets `umask(0o777)` before importing torch: its recording is 0600 and
    reads, the runtime folder it made is 0700, and the next job of the user serves its live
    socket (before issue 27 both were mode 000 and every later job lost its socket)."""
    (tmp_path / "umask_job.py").write_text("import os\nos.umask(0o777)\n" + JOB)
    first = subprocess.run(
        [*MEMTUI, "run", "--headless", "-o", "first.memtui", "umask_job.py"],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr
    recording = tmp_path / "first.memtui"
    assert stat.S_IMODE(recording.stat().st_mode) == 0o600
    assert len(read_recording(recording).steps) == 3
    assert stat.S_IMODE((tmp_path / "rt").stat().st_mode) == 0o700
    later = textwrap.dedent("""
        import os
        import torch
        import memtui_agent
        agent = memtui_agent.start(record="later.memtui")
        print("SOCKET", agent.socket_path is not None and os.path.exists(agent.socket_path))
        memtui_agent.stop()
    """)
    second = subprocess.run(
        [sys.executable, "-c", later],
        cwd=tmp_path,
        env=scrubbed_env(tmp_path / "rt"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0, second.stderr
    assert "SOCKET True" in second.stdout, second.stderr
    assert "failed" not in second.stderr


# ----- S3: attach pins its target by uid, start time and pidfd --------------------------------


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process of ours that idles (not Python: nothing could be injected into it anyway)."""
    process = subprocess.Popen(["sleep", "120"])
    yield process
    if process.poll() is None:
        process.kill()
    process.wait()


def test_a_pin_holds_the_process_not_its_pid(sleeper: subprocess.Popen[bytes]) -> None:
    pin = pin_process(sleeper.pid)
    try:
        assert (pin.uid, pin.start_ticks) == read_pin(sleeper.pid)
        assert pin.uid == os.getuid()
        confirm_pin(sleeper.pid, pin)  # still the same process
        # The same pid naming a process that started at another moment: a reused pid.
        with pytest.raises(AttachRefused, match="no longer the process memtui checked"):
            confirm_pin(sleeper.pid, Pin(pin.uid, pin.start_ticks + 1))
        with pytest.raises(AttachRefused, match="no longer the process memtui checked"):
            confirm_pin(sleeper.pid, Pin(pin.uid + 1, pin.start_ticks))
        sleeper.kill()
        sleeper.wait()
        with pytest.raises(AttachRefused, match=r"ended|no process"):
            confirm_pin(sleeper.pid, pin)  # the pidfd knows it ended, whoever has the pid now
    finally:
        release_pin(pin)


def test_the_injection_confirms_the_pin_right_before_delivering(
    sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pid changed hands between the checks and the injection: refused in one line, and
    neither gdb nor sys.remote_exec is ever started."""
    from memtui.commands import attach_inject

    delivered: list[int] = []
    monkeypatch.setattr(attach_inject, "deliver_gdb", lambda pid, *a, **k: delivered.append(pid))
    monkeypatch.setattr(
        attach_inject, "deliver_remote_exec", lambda pid, *a, **k: delivered.append(pid)
    )
    uid, ticks = read_pin(sleeper.pid)
    for method in ("gdb", "remote_exec"):
        target = Target(sleeper.pid, (3, 11), ["sleep"], pin=Pin(uid, ticks - 1))
        injection = attach_inject.Injection(target, method, Action.ATTACH)
        try:
            with pytest.raises(AttachRefused) as refused:
                injection.deliver()
        finally:
            injection.close()
        assert str(refused.value) == REUSED.format(pid=sleeper.pid)
    assert delivered == []
    pinned = Target(sleeper.pid, (3, 11), ["sleep"], pin=Pin(uid, ticks))
    injection = attach_inject.Injection(pinned, "gdb", Action.ATTACH)
    try:
        injection.deliver()  # the same process: delivered
    finally:
        injection.close()
    assert delivered == [sleeper.pid]


def _gdb_traces() -> bool:
    if shutil.which("gdb") is None:
        return False
    probe = subprocess.Popen(["sleep", "30"])
    try:
        result = subprocess.run(
            ["gdb", "-batch", "-nx", "-p", str(probe.pid), "-ex", "python print(1)"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        probe.kill()
        probe.wait()
    return "1" in result.stdout.splitlines()


@pytest.mark.skipif(not _gdb_traces(), reason="needs a gdb with Python that may trace here")
def test_gdb_confirms_the_pin_once_it_holds_the_process(
    sleeper: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    """gdb checks uid and start time after it stopped the process (which then cannot end and
    hand its pid on) and before any breakpoint: a mismatch detaches and is refused in one line;
    a match goes on (here to the end of what a `sleep` allows: it has no Python API)."""
    uid, ticks = read_pin(sleeper.pid)
    lines = runner_lines(tmp_path / "boot.py", tmp_path / "request.json")
    wrong = tmp_path / "wrong.gdb"
    wrong.write_text(gdb_script(lines, Pin(uid, ticks + 7)))
    with pytest.raises(AttachRefused) as refused:
        deliver_gdb(sleeper.pid, wrong, seconds=60)
    assert str(refused.value) == REUSED.format(pid=sleeper.pid)
    right = tmp_path / "right.gdb"
    right.write_text(gdb_script(lines, Pin(uid, ticks)))
    output = subprocess.run(
        ["gdb", "-batch", "-nx", "-p", str(sleeper.pid), "-x", str(right)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    text = output.stdout + output.stderr
    assert "MEMTUI_PINNED" in text and "MEMTUI_NOT_PINNED" not in text
    assert sleeper.poll() is None  # left running


def test_check_target_pins_what_it_checked(sleeper: subprocess.Popen[bytes]) -> None:
    """The checks of `memtui attach` read the process through its pin (a `sleep` is refused as
    not Python, after the pin was taken and released)."""
    with pytest.raises(AttachRefused, match="not a Python process"):
        check_target(sleeper.pid)
    target = check_target(os.getppid(), need_torch=False) if _is_python(os.getppid()) else None
    if target is not None:
        assert target.pin is not None
        assert (target.pin.uid, target.pin.start_ticks) == read_pin(os.getppid())
        release_pin(target.pin)


def _is_python(pid: int) -> bool:
    try:
        return "python" in os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False


def test_a_gdb_that_cannot_check_the_pin_injects_nothing() -> None:
    """A gdb without Python stops at the check (an error ends its script before any
    breakpoint): refused in one line, never taken for success."""
    from memtui.commands.attach_inject import explain_gdb

    captured = (
        "MEMTUI_ATTACHED\nMEMTUI_CHECKING_PIN\n"
        "/tmp/attach.gdb:7: Error in sourced command file:\n"
        "Python scripting is not supported in this copy of GDB.\n"
        "[Inferior 1 (process 4242) detached]\n"
    )
    with pytest.raises(AttachRefused) as refused:
        explain_gdb(4242, captured, timed_out=False, seconds=20.0)
    message = str(refused.value)
    assert "\n" not in message and "could not confirm that pid 4242" in message
    assert "nothing was injected" in message


@settings(max_examples=60, deadline=None, database=None)
@given(mode=st.integers(min_value=0, max_value=0o7777))
def test_a_session_folder_is_accepted_exactly_when_only_we_may_write_it(mode: int) -> None:
    """Fuzzed folder modes: refused exactly when group or others may write (readable is fine);
    the owner's own bits are set so that the create itself could succeed."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        session = Path(scratch) / "session"
        session.mkdir()
        os.chmod(session, mode | 0o700)
        try:
            os.close(create_private(session / "proc-0.memtui", private_folder=True))
            refused = False
        except RefusedPath:
            refused = True
        assert refused == bool(mode & 0o022), oct(mode)
