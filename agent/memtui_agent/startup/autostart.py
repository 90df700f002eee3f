"""Start the agent when the job imports torch, configured from the environment `memtui run` sets.

Starting at the import of torch, not before, keeps the job's own start-up intact: scripts often set
`OMP_NUM_THREADS` or allocator options before importing torch, and importing it for them would
silently change those. A post-import hook on `sys.meta_path` wraps torch's loader once, calls
`start()` after torch's module has executed, and restores the original loader on the module.

The configuration travels as the environment variables of `AgentConfig.to_env` (all optional,
read by `AgentConfig.from_env`: memtui_protocol/config.py).

MEMTUI_AGENT_OWNER is set by the first process that starts an agent, so its children
(spawned DataLoader workers) do not start duplicates at torch's import; a child that is a new
rank (another `LOCAL_RANK`, as Lightning's DDP launcher starts them) does. The other children are
followed (`children.py`): one that trains (a trainer a driver starts, a Pool worker) starts its
agent at the end of its first optimizer step and records as `proc-N`.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.util
import os
import stat
import sys
from collections.abc import Callable
from typing import Any, NoReturn, cast

from memtui_protocol.config import AgentConfig
from memtui_protocol.launch import launch_identity
from memtui_protocol.safe_open import make_folder, open_folder, open_own, session_folder_mode
from memtui_protocol.shown_text import terminal_safe

OWNER_VARIABLE = "MEMTUI_AGENT_OWNER"
OWNER_RANK_VARIABLE = "MEMTUI_AGENT_OWNER_RANK"
"""The `LOCAL_RANK` of the owning process (absent: 0), to tell its helpers from new ranks."""


def config_from_environment() -> AgentConfig:
    """The configuration `memtui run` put in this process's environment."""
    return AgentConfig.from_env(os.environ)


class _LoaderProxy:
    """Delegates to torch's loader and runs a callback after torch's module has executed."""

    def __init__(self, loader: Any, callback: Callable[[], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._callback()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _TorchImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's spec so that `callback` runs once torch is loaded."""

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._busy = False

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch" or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._busy = False
        _remove_watcher(self)
        if spec is None or spec.loader is None:
            return spec
        # Duck-typed: every other Loader attribute reaches torch's loader (`__getattr__`).
        spec.loader = cast(importlib.abc.Loader, _LoaderProxy(spec.loader, self._callback))
        return spec


def _remove_watcher(watcher: Any) -> None:
    try:
        sys.meta_path.remove(watcher)
    except ValueError:
        pass


def when_torch_imported(callback: Callable[[], None]) -> None:
    """Run `callback` right after torch is imported (at once if it already is)."""
    if "torch" in sys.modules:
        callback()
        return
    sys.meta_path.insert(0, _TorchImportWatcher(callback))


LAUNCHERS = ("torch/distributed/run.py", "torch/distributed/launch.py")


def is_launcher(argv: list[str]) -> bool:
    """Whether this process is a distributed launcher (torchrun), not a training rank."""
    program = argv[0].replace(os.sep, "/") if argv else ""
    return os.path.basename(program) == "torchrun" or program.endswith(LAUNCHERS)


def is_launched_rank(argv: list[str], environ: dict[str, str]) -> bool:
    """Whether a process that inherited a monitored parent is a training rank of its own.

    Launchers such as Lightning's DDP re-run the script as a fresh interpreter per rank, with
    `LOCAL_RANK` set; those ranks are monitored too. Helper processes of a monitored process
    (DataLoader workers, a forkserver) keep their parent's `LOCAL_RANK`, and multiprocessing's
    spawned children carry `--multiprocessing-fork`: they stay unmonitored.
    """
    if "--multiprocessing-fork" in argv:
        return False
    local = environ.get("LOCAL_RANK", "0")
    return local.isdigit() and local != environ.get(OWNER_RANK_VARIABLE, "0")


def record_path_for_rank(
    record: str | None, environ: dict[str, str], metrics: bool = False
) -> str | None:
    """A session folder (an existing directory) gets one recording per process.

    A multi-rank job (`WORLD_SIZE` > 1) always records into a session folder, made here if the
    path is new; so does every `memtui run -- COMMAND` (`memtui run` makes the folder), whose
    command may start any number of Python processes, one after another or side by side.

    Ranks are named by their global rank (`rank-3.memtui`), other processes by a process index
    (`proc-0.memtui`, `proc-1.memtui`, in the order their agents start), so every process of a
    multi-process job writes its own file and none overwrites another's. `metrics`: the ranks
    write Prometheus targets into a folder made here, which other users may then pass through
    (`session_folder_mode`).
    """
    rank = environ.get("RANK")
    if not rank and environ.get("NODE_RANK", "0") == "0":
        rank = environ.get("LOCAL_RANK")  # launchers that set only LOCAL_RANK (Lightning)
    world = environ.get("WORLD_SIZE", "")
    multi_rank = world.isdigit() and int(world) > 1
    # A task of a scheduler's launch (`srun memtui run -o run.memtui train.py`, one `memtui run`
    # per task) that finds the file already there: a sibling task records into it (`memtui run`
    # let this one start only then), so this one records beside it, never into it.
    sibling = launch_identity(environ) is not None and os.path.lexists(record or "")
    if record and not _is_folder(record) and (multi_rank or sibling):
        # Ranks of a launcher `memtui run` did not recognise: one file would be written by
        # every rank at once, so they make a session folder instead (beside a file, if one
        # is already there). Made 0700 whatever the job's umask.
        record = record + "-ranks" if os.path.lexists(record) else record
        make_folder(record, session_folder_mode(metrics))
        rank = rank or environ.get("SLURM_PROCID")
    if not record or not _is_folder(record):
        return record
    if rank and rank.isdigit():
        return os.path.join(record, f"rank-{int(rank)}.memtui")
    return os.path.join(record, f"proc-{claim_process_index(record)}.memtui")


def _is_folder(path: str) -> bool:
    """A folder at `path` itself: a link planted there is not followed (the recording's create
    then refuses the name in one line)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


PROCESS_INDEX_FILE = ".process-index"


def claim_process_index(folder: str) -> int:
    """The next process index of a session folder, claimed once, by whichever process asks.

    The counter lives in a small file beside the recordings, read and advanced under an
    exclusive `flock`, so siblings starting at the same moment never get the same index; an
    index is never reused, not even after its process ended (a pid would be, by the system).
    The folder must be private (ours, writable by nobody else) and the counter a regular file
    of ours, opened relative to the folder without following a link or blocking on a FIFO
    (`safe_open.open_own`).

    Raises:
        RefusedPath: the folder or the counter is not one we may write (one line).
    """
    import fcntl

    directory = open_folder(folder, private=True)
    try:
        descriptor = open_own(
            PROCESS_INDEX_FILE,
            os.O_RDWR | os.O_CREAT,
            folder=directory,
            shown=os.path.join(folder, PROCESS_INDEX_FILE),
        )
    finally:
        os.close(directory)
    try:
        os.fchmod(descriptor, 0o600)
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        text = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
        index = int(text) if text.isdigit() else 0
        os.pwrite(descriptor, str(index + 1).encode("ascii"), 0)  # never fewer digits
    finally:
        os.close(descriptor)  # releases the lock
    return index


def arm_from_environment(install_exit_handlers: bool) -> bool:
    """Arm the agent for this process; False when another process already owns monitoring.

    Args:
        install_exit_handlers: record uncaught exceptions (via `sys.excepthook`) and the end of
            the process (via `atexit`). The runner, which sees exceptions itself, passes False.
    """
    owner = os.environ.get(OWNER_VARIABLE)
    config = config_from_environment()
    if owner and owner != str(os.getpid()) and not is_launched_rank(sys.argv, dict(os.environ)):
        # Started by a monitored process (a worker, a trainer a driver launched): followed
        # from its first optimizer step on, if it ever takes one (`children.py`).
        def follow() -> None:
            try:
                from memtui_agent.startup import children

                children.follow_when_training(
                    config, f"started by pid {owner}", install_exit_handlers
                )
            except Exception as exc:  # never into the user's import of torch
                print(f"memtui: not following this process ({terminal_safe(exc)})", file=sys.stderr)

        when_torch_imported(follow)
        return False

    def start_agent() -> None:
        from memtui_agent.startup import api

        if is_launcher(sys.argv):
            return  # torchrun itself trains nothing; its workers get their own agents
        try:
            try:
                metrics = config.metrics_port is not None
                record = record_path_for_rank(config.record, dict(os.environ), metrics)
            except OSError as exc:  # a session folder we may not write: run unrecorded
                print(f"memtui: not recording this process: {terminal_safe(exc)}", file=sys.stderr)
                record = None
            in_folder = record is not None and record != config.record
            started = api.start(config=config.replace(record=record, record_in_folder=in_folder))
            if started is not None:
                os.environ[OWNER_VARIABLE] = str(os.getpid())
                os.environ[OWNER_RANK_VARIABLE] = os.environ.get("LOCAL_RANK", "0")
        except Exception as exc:  # never into the user's import of torch
            why = terminal_safe(f"{type(exc).__name__}: {exc}")
            print(f"memtui: agent not started ({why})", file=sys.stderr)

    when_torch_imported(start_agent)
    if install_exit_handlers:
        record_process_end()
    return True


def record_process_end() -> None:
    """Record the end of a process that no runner wraps (`memtui run -- COMMAND`).

    An uncaught exception reaches `sys.excepthook`. A `SystemExit` never does and atexit cannot
    see its code, so `sys.exit` is wrapped to remember the requested code (a bare
    `raise SystemExit(N)` is still recorded as a clean exit: a documented limitation).
    """
    from memtui_agent.startup import api
    from memtui_agent.steps.failures import exit_code_of, without_agent_frames

    api.exit_owned = True  # the handlers below record the end; api's fallback stays out
    previous_hook = sys.excepthook
    original_exit = sys.exit
    requested: list[str | int | None] = []

    def excepthook(kind: type[BaseException], error: BaseException, traceback: Any) -> None:
        try:
            api.stop(exit_code=1, error=error)
            traceback = without_agent_frames(traceback)
            error = error.with_traceback(traceback)
        except Exception:
            pass
        previous_hook(kind, error, traceback)

    def exit(status: str | int | None = None) -> NoReturn:
        requested[:] = [status]
        original_exit(status)

    def at_exit() -> None:
        code = exit_code_of(SystemExit(requested[0])) if requested else 0
        api.stop(exit_code=code, error=SystemExit(code) if code else None)

    sys.excepthook = excepthook
    sys.exit = exit
    atexit.register(at_exit)
