"""The agent's own file descriptors, and the proof that a number still means the agent's file.

A descriptor is only a number in the job's table. A job that closes descriptors it does not know
(`os.closerange(3, 1024)` before daemonising, a launcher tidying up) and then opens its own files
gets the agent's numbers back for them; writing a frame to such a number would put it in the
job's file, and closing it (`memtui detach`) would close the job's. So every descriptor the
agent keeps is held with the identity of what it opened (`st_dev`, `st_ino`, from `fstat`), and
checked before each write and each close: a number that no longer names that file is forgotten,
never written, never closed. The check is one `fstat` (well under a microsecond), once per frame
or read, never per byte.
"""

from __future__ import annotations

import os
import socket

from memtui_protocol.safe_open import open_own
from memtui_protocol.written import hold_as_writer

Identity = tuple[int, int]


def identity_of(descriptor: int) -> Identity | None:
    """(st_dev, st_ino) of what `descriptor` names now; None if it names nothing."""
    try:
        info = os.fstat(descriptor)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


class OwnedFd:
    """A descriptor the agent opened, with the identity of the file it opened."""

    __slots__ = ("fd", "identity")

    def __init__(self, descriptor: int) -> None:
        self.fd: int | None = descriptor
        self.identity = identity_of(descriptor)

    def ours(self) -> bool:
        """Whether the number still names the file the agent opened."""
        return (
            self.fd is not None
            and self.identity is not None
            and (identity_of(self.fd) == self.identity)
        )

    def forget(self) -> None:
        """Drop the number without closing it (the job owns it now)."""
        self.fd = None

    def close(self) -> bool:
        """Close the descriptor if it is still the agent's; False when it was not (then the
        number is forgotten and the job's file left open)."""
        descriptor, self.fd = self.fd, None
        if descriptor is None or self.identity is None or identity_of(descriptor) != self.identity:
            return False
        try:
            os.close(descriptor)
        except OSError:
            pass
        return True

    def reopen(self, path: str | os.PathLike[str]) -> bool:
        """After the job closed our number: open `path` again for appending (a regular file of
        ours, `safe_open.open_own`), kept only if it is the very file opened first (same
        identity; never a file put at that name since)."""
        try:
            descriptor = open_own(path, os.O_WRONLY | os.O_APPEND)
        except OSError:
            return False
        found = identity_of(descriptor)
        if found is None or found != self.identity:
            os.close(descriptor)
            return False
        hold_as_writer(descriptor)  # the job's close of our number dropped the writer's lock
        self.fd = descriptor
        return True


def socket_identity(sock: socket.socket) -> Identity | None:
    """The identity of a socket's descriptor now (None: closed)."""
    try:
        return identity_of(sock.fileno())
    except (OSError, ValueError):
        return None


def release_socket(sock: socket.socket, identity: Identity | None) -> None:
    """Close `sock` if its number still names the socket of `identity`; otherwise let go of
    the number without closing it (the job's now), so neither `close()` nor the socket
    object's finaliser ever closes a descriptor of the job's."""
    try:
        if identity is not None and socket_identity(sock) == identity:
            sock.close()
        else:
            sock.detach()
    except OSError:
        pass
