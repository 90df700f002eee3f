"""Create a recording (or its `.log`) without ever writing through a planted link.

Recordings are often written into shared folders (`/tmp`, a 1777 scratch directory). Opening the
name with `O_TRUNC` would follow a symbolic link someone else planted there and overwrite the file
it points to, with the rights of the job (root, sometimes). So the file is created with
`O_CREAT | O_EXCL | O_NOFOLLOW`: the kernel refuses an existing name and never follows a link. A
name that already holds a regular file of ours (a rerun with the same `-o`) is unlinked and
created anew, which replaces the name only, never the file another link points to. Anything
else there (a link, a folder, another user's file) is refused with one line. Standard library
only: `memtui run` uses it to refuse before the job starts.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
MODE = 0o600
"""Recordings hold the job's command line and working directory: private to the user."""


class RefusedPath(OSError):
    """The path is not one we may create; `str()` is the one line to show."""

    def __str__(self) -> str:
        return str(self.strerror)


def refusal(path: Path) -> str | None:
    """Why `path` must not be written (None when it is free or holds our own regular file).

    Checked by `memtui run` before the job starts; `create_private` checks again atomically.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{path}: cannot check ({exc.strerror or exc}); refusing to write there"
    if stat.S_ISLNK(info.st_mode):
        return f"{path}: is a symbolic link; refusing to follow it (remove it or choose another -o)"
    if not stat.S_ISREG(info.st_mode):
        return f"{path}: exists and is not a regular file; refusing to overwrite it"
    if info.st_uid != os.geteuid():
        return f"{path}: belongs to another user; refusing to overwrite it"
    return None


def create_private(path: Path | str, mode: int = MODE) -> int:
    """A new, empty file at `path`, mode 0600 (or `mode`), opened for writing: its descriptor.

    Raises:
        RefusedPath: the name holds a link, a non-regular file or another user's file.
        OSError: the folder is missing or not writable.
    """
    path = Path(path)
    for _attempt in range(2):
        try:
            return os.open(path, FLAGS, mode)
        except FileExistsError:
            reason = refusal(path)
            if reason is not None:
                raise RefusedPath(errno.EEXIST, reason) from None
            try:
                path.unlink()  # our own earlier file: replace the name, not the file's other links
            except FileNotFoundError:
                pass
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link created after the check
                raise RefusedPath(errno.ELOOP, refusal(path) or f"{path}: is a link") from None
            raise
    raise RefusedPath(errno.EEXIST, f"{path}: keeps being recreated; refusing to write there")
