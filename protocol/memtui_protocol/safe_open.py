"""Every file memtui opens that it made or will make, opened without ever following a planted link.

The one opener of the project: a recording, its `.log`, an export, a sidecar, a reply file, a
notes file, a counter are all created or reopened here, never by hand (the bootstrap
`sitecustomize` alone keeps a copy of the notes writer: `notes.py` says why).

Recordings are often written into shared folders (`/tmp`, a 1777 scratch directory), and the job
may run as root. So no name is ever resolved first (`Path.resolve()` would follow a planted link
and hand the kernel the link's target): the folder is opened once (`O_DIRECTORY|O_NOFOLLOW`) and
the file created relative to that descriptor with `O_CREAT|O_EXCL|O_NOFOLLOW`, so the kernel
refuses an existing name and never follows a link, a FIFO is never opened (it would block), and
the folder cannot be swapped for a link between a check and the create. A name that already holds
a regular file of ours is replaced only when the caller's `Replace` allows it: an earlier
recording no process still writes (a rerun with the same `-o`), a job log memtui wrote, any file of
ours under `--force` (`memtui_protocol.written` holds the proofs); the name is unlinked and created
anew, which replaces the name only, never the file another link points to. Anything else there
(a link, a folder, a FIFO, another user's file, a file memtui cannot prove it wrote) is refused
with one line.

A session folder (one recording per process) must also be private: ours, and writable by nobody
else, or anyone who can write there could plant names the job then writes.

A file that must already be there (a notes file `memtui run` made, a recording the agent reopens
after the job closed its descriptor, a counter in a session folder) is opened by `open_own`: with
`O_NOFOLLOW|O_NONBLOCK`, then checked on the open descriptor to be a regular file of ours, so a
link, a FIFO (which would block), a folder or another user's file planted at the name is refused
in one line and never written.

Modes are set explicitly (`fchmod`) after the create: a job that set `umask(0o777)` still gets a
usable 0600 file. Only the standard library at import, not even msgspec (`written`, which proves
what memtui wrote, is imported only when an existing file is to be replaced): the attach bootstrap's
reply file (`attach.py`) is written from here inside a job that may have no msgspec, and the
runtime folder (`runtime_dir.py`), which `written` itself imports, writes its sidecars here.
"""

from __future__ import annotations

import errno
import os
import stat
from enum import Enum
from pathlib import Path

FLAGS = (
    os.O_WRONLY
    | os.O_CREAT
    | os.O_EXCL
    | os.O_NOFOLLOW
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_NONBLOCK", 0)
)
FOLDER_FLAGS = (
    os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
)
MODE = 0o600
"""Recordings hold the job's command line and working directory: private to the user."""
FOLDER_MODE = 0o700
PASSABLE_FOLDER_MODE = 0o711
"""A session folder of a job that serves metrics: other users may pass through it to the
`file_sd` targets in `prometheus/` (a system Prometheus runs as its own user), never list it or
write to it; every recording in it stays 0600."""


EXISTING_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
"""Added to every open of a name that may already be there: never through a link, never
blocking on a FIFO (the descriptor is made blocking again once it is known to be a file)."""


class Replace(Enum):
    """What a create may replace at its name (anything else there is refused in one line)."""

    NOTHING = "nothing"
    """An export without `--force`: an existing name is refused, whatever it holds."""
    OWN_FILE = "a regular file of ours"
    """`--force`, and names in folders nobody else writes whose file memtui alone makes."""
    RECORDING = "a memtui recording"
    """The agent's recording: an earlier recording that no process still writes."""
    JOB_LOG = "a log memtui wrote"
    """`memtui run`'s `<recording>.log`: one that begins with `JOB_LOG_MARKER`, not written."""


class RefusedPath(OSError):
    """The path is not one we may create; `str()` is the one line to show."""

    def __str__(self) -> str:
        return str(self.strerror)


def own_file_refusal(path: Path | str, info: os.stat_result) -> str | None:
    """Why the file `info` describes (an `lstat` or `fstat` of `path`) is not ours to write or
    replace (None: a regular file of ours)."""
    if stat.S_ISLNK(info.st_mode):
        return f"{path}: is a symbolic link; refusing to follow it (remove it or choose another -o)"
    if not stat.S_ISREG(info.st_mode):
        return f"{path}: exists and is not a regular file; refusing to overwrite it"
    if info.st_uid != os.geteuid():
        return f"{path}: belongs to another user; refusing to overwrite it"
    return None


def refusal(path: Path | str) -> str | None:
    """Why `path` must not be written (None when it is free or holds our own regular file).

    Checked by `memtui run` before the job starts; `create_private` checks again atomically.
    """
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: cannot check ({exc.strerror or exc}); refusing to write there"
    return own_file_refusal(path, info)


def folder_refusal(
    path: Path | str, info: os.stat_result, what: str = "the session folder"
) -> str | None:
    """Why a session folder (or another folder `what` names) is not ours alone to write (None:
    ours, and writable by nobody else)."""
    if info.st_uid != os.geteuid():
        return f"{path}: {what} belongs to uid {info.st_uid}, not to you; refusing it"
    if info.st_mode & 0o022:
        mode = stat.S_IMODE(info.st_mode)
        return (
            f"{path}: {what} is writable by other users (mode {mode:o}); "
            "refusing it (chmod go-w it, or choose another -o)"
        )
    return None


def open_folder(path: Path | str, *, private: bool = False) -> int:
    """A descriptor of the folder `path` itself, never of a link planted there.

    `private`: refuse a folder that is not ours or that others may write (a session folder).

    Raises:
        RefusedPath: a link, not a folder, or (private) someone else's or group/other writable.
        OSError: missing or unreadable.
    """
    try:
        descriptor = os.open(path, FOLDER_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise RefusedPath(
                exc.errno, refusal(path) or f"{path}: is not a folder; refusing to write there"
            ) from None
        raise
    if private:
        problem = folder_refusal(path, os.fstat(descriptor))
        if problem is not None:
            os.close(descriptor)
            raise RefusedPath(errno.EPERM, problem)
    return descriptor


def open_own(
    name: str | os.PathLike[str],
    flags: int,
    *,
    folder: int | None = None,
    shown: str | os.PathLike[str] | None = None,
    mode: int = MODE,
) -> int:
    """An existing regular file of ours at `name` (relative to the open `folder` when given),
    opened with `flags` (`O_RDONLY`, `O_WRONLY|O_APPEND`, `O_RDWR|O_CREAT`...) plus
    `EXISTING_FLAGS`: its descriptor, blocking again. With `O_CREAT` a missing name is created
    with `mode` (the caller sets the mode it wants with `fchmod`: the umask applies here).

    Checked on the open descriptor, so a name swapped between a check and the open cannot slip
    through. `shown` is the path said in a refusal (default: `name`).

    Raises:
        RefusedPath: a link, a FIFO, a folder or anything not a regular file, another user's.
        OSError: missing (without `O_CREAT`), unreadable.
    """
    shown = os.fspath(name if shown is None else shown)
    try:
        descriptor = os.open(name, flags | EXISTING_FLAGS, mode, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise RefusedPath(exc.errno, f"{shown}: is a symbolic link; refusing it") from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO nobody reads, a folder
            raise RefusedPath(exc.errno, f"{shown}: is not a regular file; refusing it") from None
        raise
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise RefusedPath(errno.EINVAL, f"{shown}: is not a regular file; refusing it")
        if info.st_uid != os.geteuid():
            raise RefusedPath(
                errno.EPERM, f"{shown}: is owned by uid {info.st_uid}, not by you; refusing it"
            )
        os.set_blocking(descriptor, True)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def append_own(path: str | os.PathLike[str], data: bytes) -> None:
    """Append `data` in one write to the existing regular file of ours at `path` (`open_own`):
    a line in a file memtui made for it, never a file planted in its place.

    Raises:
        RefusedPath, OSError: as `open_own`, or the write failed.
    """
    descriptor = open_own(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(descriptor, data)
    finally:
        os.close(descriptor)


def open_existing(folder: int, name: str) -> int:
    """The file at `name` in the open `folder`, for reading its head and taking its lock,
    never through a link, never blocking on a FIFO (read-write where we may: NFS grants an
    exclusive lock only on a descriptor open for writing). Not checked: the caller has
    `lstat`ed it, or judges what it holds (`written.replace_refusal`).

    Raises:
        OSError: it cannot be opened.
    """
    try:
        return os.open(name, os.O_RDWR | EXISTING_FLAGS, dir_fd=folder)
    except PermissionError:
        return os.open(name, os.O_RDONLY | EXISTING_FLAGS, dir_fd=folder)


def remove_in(folder: int, name: str, shown: Path | str, replaces: Replace) -> str | None:
    """Unlink `name` in the open `folder` when `replaces` allows what it holds.

    Returns None when the name is free now (removed, or nothing was there), else the one line
    saying why it was left (a link, a folder, another user's file, a file memtui cannot prove
    it wrote, one a process still writes). Only the name goes: another link to the file keeps it.
    """
    shown = Path(shown)
    try:
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return None
    reason = own_file_refusal(shown, info)
    if reason is not None:
        return reason
    from memtui_protocol.written import replace_refusal  # needs msgspec: see the docstring

    try:
        descriptor = open_existing(folder, name)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{shown}: cannot check ({exc.strerror or exc}); refusing to replace it"
    try:
        now = os.fstat(descriptor)
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            return f"{shown}: changed while it was checked; refusing to replace it"
        try:
            reason = replace_refusal(descriptor, str(shown), replaces)
        except OSError as exc:
            reason = f"{shown}: cannot read ({exc.strerror or exc}); refusing to replace it"
        if reason is not None:
            return reason
        try:
            os.unlink(name, dir_fd=folder)  # the name only, while the writer's lock is ours
        except FileNotFoundError:
            pass
    finally:
        os.close(descriptor)
    return None


def remove_written(path: Path | str, replaces: Replace) -> str | None:
    """`remove_in` for a path: its folder opened once, never through a link."""
    path = Path(path)
    try:
        folder = open_folder(path.parent)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return str(exc) if isinstance(exc, RefusedPath) else f"{path}: {exc.strerror or exc}"
    try:
        return remove_in(folder, path.name, path, replaces)
    finally:
        os.close(folder)


def create_in(
    folder: int,
    name: str,
    shown: Path | str,
    mode: int = MODE,
    replaces: Replace = Replace.NOTHING,
) -> int:
    """A new, empty file `name` in the open folder `folder`, mode `mode`: its descriptor.

    `shown` is the path said in a refusal; `replaces` what an existing name may hold for it to
    be replaced (`remove_in`).

    Raises:
        RefusedPath: the name holds a link, a non-regular file, another user's file, or a
            file `replaces` does not allow.
        OSError: the folder is not writable, the disk is full.
    """
    shown = Path(shown)
    for _attempt in range(2):
        try:
            descriptor = os.open(name, FLAGS, mode, dir_fd=folder)
        except FileExistsError:
            reason = remove_in(folder, name, shown, replaces)
            if reason is not None:
                raise RefusedPath(errno.EEXIST, reason) from None
            continue
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
                raise RefusedPath(errno.ELOOP, f"{shown}: is a symbolic link") from None
            raise
        try:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode):  # cannot be, after O_EXCL: never write there
                raise RefusedPath(errno.EEXIST, f"{shown}: is not a regular file")
            os.set_blocking(descriptor, True)
            os.fchmod(descriptor, mode)  # explicit: the job's umask must not make it 000
        except BaseException:
            os.close(descriptor)
            raise
        return descriptor
    raise RefusedPath(errno.EEXIST, f"{shown}: keeps being recreated; refusing to write there")


def create_private(
    path: Path | str,
    *,
    private_folder: bool = False,
    mode: int = MODE,
    replaces: Replace = Replace.NOTHING,
) -> int:
    """A new, empty file at `path`, mode 0600 (or `mode`), opened for writing: its descriptor.

    `private_folder`: `path` is in a session folder, which must be ours alone (`open_folder`).
    `replaces`: what an existing file there may be for it to be replaced (`create_in`).

    Raises:
        RefusedPath: the folder or the name is not one we may write (one line).
        OSError: the folder is missing or not writable.
    """
    path = Path(path)
    if not path.name or path.name in (".", ".."):
        raise RefusedPath(errno.EISDIR, f"{path}: is not a file name")
    folder = open_folder(path.parent, private=private_folder)
    try:
        return create_in(folder, path.name, path, mode, replaces)
    finally:
        os.close(folder)


def write_new(path: Path | str, data: bytes, replaces: Replace = Replace.NOTHING) -> None:
    """Write `data` to a new file at `path` (mode 0600), by `create_private`'s rules.

    Raises:
        RefusedPath, OSError: as `create_private`.
    """
    descriptor = create_private(path, replaces=replaces)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view) :]
    finally:
        os.close(descriptor)


def session_folder_mode(metrics: bool) -> int:
    """The mode a new session folder gets: 0700, or 0711 for a job whose ranks write Prometheus
    targets into it (`PASSABLE_FOLDER_MODE`)."""
    return PASSABLE_FOLDER_MODE if metrics else FOLDER_MODE


def make_folder(path: Path | str, mode: int = FOLDER_MODE) -> None:
    """Create the folder `path` with exactly `mode` (whatever the umask); an existing one is
    left as it is (its owner and mode are checked where it is used)."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        return
    descriptor = open_folder(path)
    try:
        os.fchmod(descriptor, mode)
    finally:
        os.close(descriptor)


def open_or_make_folder_in(
    parent: int,
    name: str,
    shown: Path | str,
    mode: int = FOLDER_MODE,
    *,
    private: str | None = None,
) -> int:
    """The folder `name` inside the open folder `parent`, made with exactly `mode` when it is
    missing: its descriptor (`O_DIRECTORY|O_NOFOLLOW`, relative to `parent`, so no name is
    resolved first and a link planted there is never followed).

    An export's folders (`export --format tensorboard`'s DIR and its runs): a planted link, a
    FIFO or any other non-folder, and a folder of another user, are refused in one line.
    `private` (what the folder is, for the refusal): it must also be writable by nobody else
    (`folder_refusal`, the rule of session folders), and it gets exactly `mode` even when it was
    there already (the agent's Prometheus target folder).

    Raises:
        RefusedPath: as above.
        OSError: `parent` is not writable, the disk is full.
    """
    shown = Path(shown)
    if not name or name in (".", "..") or "/" in name:
        raise RefusedPath(errno.EINVAL, f"{shown}: is not a folder name")
    made = False
    try:
        os.mkdir(name, mode, dir_fd=parent)
        made = True
    except FileExistsError:
        pass
    try:
        descriptor = os.open(name, FOLDER_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            try:
                info = os.stat(name, dir_fd=parent, follow_symlinks=False)
                reason = own_file_refusal(shown, info)
            except OSError:
                reason = None
            raise RefusedPath(
                exc.errno, reason or f"{shown}: is not a folder; refusing to write there"
            ) from None
        raise
    try:
        info = os.fstat(descriptor)
        if private is not None:
            problem = folder_refusal(shown, info, private)
            if problem is not None:
                raise RefusedPath(errno.EPERM, problem)
        elif info.st_uid != os.geteuid():
            raise RefusedPath(
                errno.EPERM, f"{shown}: belongs to another user; refusing to write into it"
            )
        if made or (private is not None and stat.S_IMODE(info.st_mode) != mode):
            os.fchmod(descriptor, mode)  # explicit: the umask must not decide
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def open_or_make_folder(
    path: Path | str, mode: int = FOLDER_MODE, *, private: str | None = None
) -> int:
    """`open_or_make_folder_in` for a path: its parent opened as `open_folder` does (the
    user's own path up to there), then the last name relative to it.

    Raises:
        RefusedPath, OSError: as `open_or_make_folder_in`; the parent missing or a link.
    """
    path = Path(path)
    if path.name in ("", ".", ".."):  # "." or "/": no last name to create
        descriptor = open_folder(path)
        info = os.fstat(descriptor)
        if private is not None:
            problem = folder_refusal(path, info, private)
        elif info.st_uid != os.geteuid():
            problem = f"{path}: belongs to another user; refusing to write into it"
        else:
            problem = None
        if problem is not None:
            os.close(descriptor)
            raise RefusedPath(errno.EPERM, problem)
        return descriptor
    parent = open_folder(path.parent)
    try:
        return open_or_make_folder_in(parent, path.name, path, mode, private=private)
    finally:
        os.close(parent)
