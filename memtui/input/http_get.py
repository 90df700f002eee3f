"""One HTTP GET under an overall deadline and a size cap (`memtui cluster`'s reads of Prometheus).

`urllib`'s timeout is per socket operation: a server that sends one byte every 2 s never trips
a 5 s timeout, and `read(64 KiB)` waits for the whole chunk, so a dripping server held
`memtui cluster` for 145 s. Here every step (name lookup, connect, TLS handshake, request,
answer) waits in `select` for at most the time left before one deadline, on a non-blocking
socket, so the whole exchange ends by then whatever the other end does; the answer is read to
at most `max_bytes`. The request is HTTP/1.0 (`Connection: close`): the server sends the body
plain and closes, which is all Prometheus' API needs (no keep-alive, no compression). A proxy
from the environment is not used: the server is dialled directly.

A URL is checked before anything is sent (`Target.parse`): printable ASCII only (no control
characters, spaces or undecodable bytes), an http or https scheme, a host, a port in 1-65535
when given, no query or fragment. Credentials in the URL (`https://user:secret@host:9090`, a
Prometheus behind basic auth) are sent as HTTP basic authorization, never shown in messages.
Every failure is `HttpError` with one line.
"""

from __future__ import annotations

import base64
import errno
import math
import os
import select
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

MAX_URL_CHARS = 2048
MAX_HEAD_BYTES = 64 * 1024
_CHUNK = 64 * 1024


class HttpError(Exception):
    """The exchange failed; `str()` is the one line to show (`timeout` tells a deadline)."""

    def __init__(self, message: str, timeout: bool = False) -> None:
        super().__init__(message)
        self.timeout = timeout


class TooLarge(HttpError):
    """The answer is over the cap."""


@dataclass(frozen=True)
class Answer:
    """A status, the headers (names in lower case) and the body."""

    status: int
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Target:
    """Where a URL points: scheme, host, port and path prefix."""

    scheme: str
    host: str
    port: int
    path: str
    authorization: str | None = field(default=None, repr=False)
    """`Basic ...` from the URL's `user:password@`, or None."""

    @classmethod
    def parse(cls, url: str) -> Target:
        """The URL's parts, checked.

        Raises:
            HttpError: not an http(s) URL this client can dial (one line, the reason).
        """
        if len(url) > MAX_URL_CHARS:
            raise HttpError(f"the URL is longer than {MAX_URL_CHARS} characters")
        if not url.isascii() or not url.isprintable() or " " in url:
            raise HttpError(
                "the URL holds spaces, control characters or characters beyond ASCII "
                "(write an international host name in its xn-- form)"
            )
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError as exc:  # "Invalid IPv6 URL", "Port out of range 0-65535"
            raise HttpError(f"not a URL ({exc})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise HttpError("give an http:// or https:// URL")
        authorization = None
        if parts.username is not None or parts.password is not None:
            user = urllib.parse.unquote(parts.username or "")
            secret = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{secret}".encode()).decode("ascii")
            authorization = f"Basic {token}"
        if parts.query or parts.fragment or url.endswith(("?", "#")):
            raise HttpError("give the server's base URL, without a query or fragment")
        if port == 0:
            raise HttpError("port 0 is not a port to dial")
        host = parts.hostname
        labels = host.rstrip(".").split(".")
        if ":" not in host and not all(0 < len(label) <= 63 for label in labels):
            raise HttpError(f"{host!r} is not a host name")  # an IPv6 literal has no labels
        default = 443 if parts.scheme == "https" else 80
        return cls(parts.scheme, host, port or default, parts.path.rstrip("/"), authorization)


def without_credentials(url: str) -> str:
    """`url` with any `user:password@` taken out, for messages and reports."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        return url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = authority.rsplit("@", 1)[1]
    return f"{scheme}://{authority}{slash}{path}"


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise HttpError("no answer before the deadline", timeout=True)
    return left


def _wait(sock: socket.socket, write: bool, deadline: float) -> None:
    """Until `sock` is readable (writable), or `HttpError(timeout=True)` at the deadline."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT if write else select.POLLIN)
    while not poller.poll(_remaining(deadline) * 1000):
        pass


AddressInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]
"""One of `getaddrinfo`'s answers: family, type, protocol, name, socket address."""


def _addresses(host: str, port: int, deadline: float) -> list[AddressInfo]:
    """`getaddrinfo` on a helper thread (libc's lookup has no timeout of its own)."""
    found: list[object] = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as exc:
            found.append(exc)

    helper = threading.Thread(target=lookup, name="memtui-resolve", daemon=True)
    helper.start()
    helper.join(_remaining(deadline))
    if not found:
        raise HttpError(f"cannot resolve {host!r} before the deadline", timeout=True)
    result = found[0]
    if isinstance(result, UnicodeError):
        raise HttpError(f"{host!r} is not a host name")
    if isinstance(result, OSError):
        raise HttpError(f"cannot resolve {host!r}: {result.strerror or result}")
    assert isinstance(result, list)
    return result


def _connect(target: Target, deadline: float) -> socket.socket:
    problem = "no address"
    for family, kind, proto, _name, address in _addresses(target.host, target.port, deadline):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            error = sock.connect_ex(address)
            if error not in (0, errno.EINPROGRESS):
                raise OSError(error, os.strerror(error))
            _wait(sock, True, deadline)
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                raise OSError(error, os.strerror(error))
        except OSError as exc:
            sock.close()
            problem = exc.strerror or str(exc)
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise HttpError(problem)


def _handshake(sock: socket.socket, host: str, deadline: float) -> ssl.SSLSocket:
    import ssl  # only for https: `memtui report` and the rest never load it

    context = ssl.create_default_context()
    secure = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    while True:
        try:
            secure.do_handshake()
            return secure
        except ssl.SSLWantReadError:
            _wait(secure, False, deadline)
        except ssl.SSLWantWriteError:
            _wait(secure, True, deadline)
        except ssl.SSLError as exc:
            raise HttpError(f"TLS failed: {exc.reason or exc}") from None


def _want(exc: OSError) -> bool | None:
    """Which way a non-blocking (TLS) socket must wait: True to write, False to read, None:
    a real failure. `ssl.SSLWantReadError` and `SSLWantWriteError` are `OSError`s too."""
    if isinstance(exc, BlockingIOError):
        return False
    name = type(exc).__name__
    if name == "SSLWantWriteError":
        return True
    if name == "SSLWantReadError":
        return False
    return None


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except OSError as exc:
            way = _want(exc)
            if way is None:
                raise
            _wait(sock, way if not isinstance(exc, BlockingIOError) else True, deadline)


def _receive(sock: socket.socket, limit: int, deadline: float) -> bytes:
    """Everything until the server closes, or `TooLarge` past `limit` bytes."""
    received = bytearray()
    while True:
        try:
            chunk = sock.recv(_CHUNK)
        except OSError as exc:
            way = _want(exc)
            if way is None:
                raise
            _wait(sock, way, deadline)
            continue
        if not chunk:
            return bytes(received)
        received += chunk
        if len(received) > limit:
            raise TooLarge(f"answered more than {limit} bytes")


def get(target: Target, path: str, deadline: float, max_bytes: int) -> Answer:
    """GET `path` (with its query) from `target`, all of it before `deadline` (monotonic).

    Raises:
        HttpError: unreachable, too slow (`timeout`), too large (`TooLarge`), not HTTP.
    """
    if not math.isfinite(deadline):
        raise HttpError("the deadline is not a time")
    sock = _connect(target, deadline)
    try:
        if target.scheme == "https":
            sock = _handshake(sock, target.host, deadline)
        host = f"[{target.host}]" if ":" in target.host else target.host
        request = (
            f"GET {target.path}{path} HTTP/1.0\r\nHost: {host}:{target.port}\r\n"
            "Accept: application/json\r\nUser-Agent: memtui\r\nConnection: close\r\n"
            + (f"Authorization: {target.authorization}\r\n" if target.authorization else "")
            + "\r\n"
        ).encode("ascii")
        _send_all(sock, request, deadline)
        raw = _receive(sock, max_bytes + MAX_HEAD_BYTES, deadline)
    except OSError as exc:
        raise HttpError(exc.strerror or str(exc)) from None
    finally:
        sock.close()
    return _parse(raw, max_bytes)


def _parse(raw: bytes, max_bytes: int) -> Answer:
    head, separator, body = raw.partition(b"\r\n\r\n")
    if not separator or len(head) > MAX_HEAD_BYTES:
        raise HttpError("answered something that is not HTTP")
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/"):
        raise HttpError("answered something that is not HTTP")
    code = status_line[1]
    if not (code.isascii() and code.isdigit() and len(code) == 3):
        raise HttpError("answered something that is not HTTP")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = _unchunk(body)
    length = headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) < len(body):
        body = body[: int(length)]
    if len(body) > max_bytes:
        raise TooLarge(f"answered more than {max_bytes} bytes")
    return Answer(int(code), headers, body)


def _unchunk(data: bytes) -> bytes:
    """A chunked body's payload (a server may chunk even an HTTP/1.0 answer's body)."""
    out = bytearray()
    position = 0
    while True:
        end = data.find(b"\r\n", position)
        if end < 0:
            raise HttpError("answered a damaged chunked body")
        size_text = data[position:end].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpError("answered a damaged chunked body") from None
        if size == 0:
            return bytes(out)
        start = end + 2
        if size > len(data) - start:
            raise HttpError("answered a damaged chunked body")
        out += data[start : start + size]
        position = start + size + 2


__all__ = ["Answer", "HttpError", "Target", "TooLarge", "get", "without_credentials"]
