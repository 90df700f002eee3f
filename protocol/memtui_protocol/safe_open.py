"""Create a file (a recording, its `.log`, an export) without ever writing through a planted link.

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

Modes are set explicitly (`fchmod`) after the create: a job that set `umask(0o777)` still gets a
usable 0600 file. Standard library only: `memtui run`, `export` and the agent share it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from memtui_protocol.written import Replace, open_existing, replace_refusal

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


class RefusedPath(OSError):
    """The path is not one we may create; `str()` is the one line to show."""

    def __str__(self) -> str:
        return str(self.strerror)


def _describe(path: Path, info: os.stat_result) -> str | None:
    """Why an existing name must not be replaced (None: a regular file of ours)."""
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
    return _describe(path, info)


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
    reason = _describe(shown, info)
    if reason is not None:
        return reason
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
    parent: int, name: str, shown: Path | str, mode: int = FOLDER_MODE
) -> int:
    """The folder `name` inside the open folder `parent`, made with exactly `mode` when it is
    missing: its descriptor (`O_DIRECTORY|O_NOFOLLOW`, relative to `parent`, so no name is
    resolved first and a link planted there is never followed).

    An export's folders (`export --format tensorboard`'s DIR and its runs): a planted link, a
    FIFO or any other non-folder, and a folder of another user, are refused in one line.

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
                reason = _describe(shown, info)
            except OSError:
                reason = None
            raise RefusedPath(
                exc.errno, reason or f"{shown}: is not a folder; refusing to write there"
            ) from None
        raise
    try:
        info = os.fstat(descriptor)
        if info.st_uid != os.geteuid():
            raise RefusedPath(
                errno.EPERM, f"{shown}: belongs to another user; refusing to write into it"
            )
        if made:
            os.fchmod(descriptor, mode)  # explicit: the umask must not decide
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def open_or_make_folder(path: Path | str, mode: int = FOLDER_MODE) -> int:
    """`open_or_make_folder_in` for a path: its parent opened as `open_folder` does (the
    user's own path up to there), then the last name relative to it.

    Raises:
        RefusedPath, OSError: as `open_or_make_folder_in`; the parent missing or a link.
    """
    path = Path(path)
    if path.name in ("", ".", ".."):  # "." or "/": no last name to create
        descriptor = open_folder(path)
        if os.fstat(descriptor).st_uid != os.geteuid():
            os.close(descriptor)
            raise RefusedPath(
                errno.EPERM, f"{path}: belongs to another user; refusing to write into it"
            )
        return descriptor
    parent = open_folder(path.parent)
    try:
        return open_or_make_folder_in(parent, path.name, path, mode)
    finally:
        os.close(parent)
