"""Opening a file someone hands to `memtui report`/`replay`: regular files only, never blocking.

`open()` on a FIFO with no writer blocks forever, and a device file can read forever, so the
path is opened with `O_NONBLOCK` (which returns at once for a FIFO and changes nothing for a
regular file) and checked with `fstat` on the open descriptor, so a path swapped between a check
and the open cannot slip through.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from memtui.errors import UserError


class InputFileError(UserError):
    """The path is not a readable regular file; `str()` is the one line to show."""


def open_input(path: str | os.PathLike[str]) -> BinaryIO:
    """`path` opened for binary reading, if it is a regular file.

    Raises:
        InputFileError: missing, a directory, a FIFO, socket or device, or unreadable.
    """
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputFileError(f"{path}: is a directory, not a recording") from None
    except OSError as exc:
        raise InputFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise InputFileError(f"{path}: is a directory, not a recording")
        if not stat.S_ISREG(mode):
            raise InputFileError(f"{path}: not a regular file ({_kind(mode)}); refusing to read it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def first_hole(fd: int, size: int, start: int = 0) -> int | None:
    """Where the first hole of a sparse file starts at or after `start` (None: none before
    `size`, or the file system cannot tell). A hole reads as zeros without being stored: a file
    of 8 GiB apparent size may hold 44 KiB, and reading it whole costs its apparent size."""
    seek_hole = getattr(os, "SEEK_HOLE", None)
    if seek_hole is None or start >= size:
        return None
    try:
        here = os.lseek(fd, 0, os.SEEK_CUR)
    except OSError:
        return None
    try:
        hole = os.lseek(fd, start, seek_hole)
    except OSError:
        return None  # not supported here: read as a plain file
    finally:
        os.lseek(fd, here, os.SEEK_SET)
    return hole if hole < size else None
