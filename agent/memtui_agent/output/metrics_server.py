"""The `/metrics` HTTP endpoint: one thread, a few connections, a deadline on each.

`prometheus_client.start_http_server` starts a thread per connection and waits on each without
a timeout, so anyone who can reach the port grows the job's thread count without bound (three
idle connections a second made 414 threads in a minute). This server runs on one thread
whatever clients do: it serves at most `MAX_CONNECTIONS` at a time (further clients wait in the
kernel's accept queue, `BACKLOG`, and cost nothing here), every socket is non-blocking, and
each connection has one overall deadline (`CONNECTION_SECONDS`) for its request, its answer and
the sending of it, so a client that drips one byte at a time (slowloris) or never reads its
answer is closed when its time is up, not when it stops sending. A request head is read to at
most `MAX_REQUEST_BYTES`. Memory is bounded by the cap times one answer.

The answer is rendered by a callable handed in (`Render`: `prometheus_client`'s encoder over
the rank's registry, chosen by the request's `Accept` header), so the format is the library's own
text or OpenMetrics and Prometheus scrapes it as any exporter. One request per connection
(`Connection: close`), as the library's own server answers.

Every descriptor is checked before use (`memtui_agent.memory.descriptors`): a job that closes
descriptors it does not know and reuses the numbers never has its file read, written or closed
here.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable

from memtui_agent.memory.descriptors import Identity, release_socket, socket_identity

MAX_CONNECTIONS = 8
"""Connections served at once; Prometheus needs one per scrape (a few at most, with HA pairs)."""
BACKLOG = 16
"""Connections the kernel holds for us beyond the cap (further ones it refuses)."""
CONNECTION_SECONDS = 10.0
"""From accept to the last byte sent: Prometheus' default scrape timeout. A scrape of a rank
takes milliseconds; only a client that stalls meets this."""
MAX_REQUEST_BYTES = 8192
"""A request line and headers longer than this is not a scrape: closed unanswered."""
POLL_SECONDS = 0.5
"""The longest the thread sleeps: how soon `close()` is noticed (as `prometheus_client`'s own
server, which polls every 0.5 s)."""
ACCEPTS_PER_POLL = 4

Render = Callable[[str], tuple[bytes, str]]
"""The `Accept` header -> (the metrics, their content type)."""

_EVENTS = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | select.POLLNVAL


class _Connection:
    """One client: what it sent so far, or what it still has to receive."""

    __slots__ = ("answer", "deadline", "identity", "request", "sock")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.identity: Identity | None = socket_identity(sock)
        self.deadline = deadline
        self.request = bytearray()
        self.answer: memoryview | None = None
        """Set once the request head is complete: the unsent rest of the answer."""


def answer_for(request: bytes, render: Render) -> bytes:
    """The whole HTTP answer to one request head (`/metrics` or `/`, GET or HEAD)."""
    try:
        head = request.decode("latin-1")
        line, _, rest = head.partition("\r\n")
        method, target, _version = line.split(" ", 2)
    except ValueError:
        return _status(400, "Bad Request")
    if method not in ("GET", "HEAD"):
        return _status(405, "Method Not Allowed")
    if target.split("?", 1)[0] not in ("/metrics", "/"):
        return _status(404, "Not Found")
    accept = ""
    for header in rest.split("\r\n"):
        name, _, value = header.partition(":")
        if name.strip().lower() == "accept":
            accept = value.strip()
    try:
        body, content_type = render(accept)
    except Exception:  # a collector's failure is this scrape's, never the thread's
        return _status(500, "Internal Server Error")
    headers = (
        "HTTP/1.1 200 OK\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    return headers if method == "HEAD" else headers + body


def _status(code: int, reason: str) -> bytes:
    return (f"HTTP/1.1 {code} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").encode(
        "latin-1"
    )


def _resolve(address: str, port: int) -> tuple[socket.AddressFamily, tuple[object, ...]]:
    """The family and socket address to bind `address:port` to (IPv4 or IPv6, a name too)."""
    infos = socket.getaddrinfo(
        address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, _type, _proto, _name, sockaddr = infos[0]
    return family, sockaddr


class MetricsServer:
    """A listening TCP socket and the one thread that serves it."""

    def __init__(
        self,
        address: str,
        port: int,
        render: Render,
        *,
        max_connections: int = MAX_CONNECTIONS,
        seconds: float = CONNECTION_SECONDS,
    ) -> None:
        """Bind and listen (the thread starts with `start`).

        Raises:
            OSError: the address cannot be resolved or bound (a port in use).
        """
        family, sockaddr = _resolve(address, port)
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(sockaddr)
            listener.listen(BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._listener_identity = socket_identity(listener)
        self.port: int = int(listener.getsockname()[1])
        self._render = render
        self._max = max_connections
        self._seconds = seconds
        self._connections: list[_Connection] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="memtui-metrics", daemon=True)

    def start(self) -> None:
        """Start serving on the server's own (daemon) thread."""
        self.thread.start()

    @property
    def open_connections(self) -> int:
        """Connections being served now (at most the cap)."""
        return len(self._connections)

    def close(self) -> None:
        """Stop serving: the thread closes every socket as it leaves (within `POLL_SECONDS`)."""
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=2 * POLL_SECONDS + 1.0)
        if not self.thread.is_alive():
            self._close_all()

    def forget_in_child(self) -> None:
        """A forked child (a DataLoader worker) has no server thread: it closes its copies of
        the listener and of the connections, so the port is free and a client sees its answer
        end once the rank itself closes it; the parent's server is untouched."""
        self._stop.set()
        self._close_all()

    # ----- the server thread -----------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._poll_once()
        finally:
            self._close_all()

    def _poll_once(self) -> None:
        now = time.monotonic()
        for connection in [c for c in self._connections if c.deadline <= now]:
            self._drop(connection)  # too slow: a slowloris, or a client that does not read
        poller = select.poll()
        watched: dict[int, _Connection | None] = {}
        listening = self._listener_identity is not None
        if listening and len(self._connections) < self._max:
            if socket_identity(self._listener) != self._listener_identity:
                self._stop_listening()  # the job closed our number and may use it now
            else:
                poller.register(self._listener.fileno(), select.POLLIN)
                watched[self._listener.fileno()] = None
        for connection in list(self._connections):
            if socket_identity(connection.sock) != connection.identity:
                self._forget(connection)
                continue
            events = select.POLLOUT if connection.answer is not None else select.POLLIN
            poller.register(connection.sock.fileno(), events)
            watched[connection.sock.fileno()] = connection
        deadlines = [c.deadline for c in self._connections]
        wait = min([POLL_SECONDS, *(max(0.0, d - now) for d in deadlines)])
        try:
            ready = poller.poll(wait * 1000)
        except InterruptedError:
            return
        for descriptor, events in ready:
            target = watched.get(descriptor)
            if target is None:
                self._accept()
            elif events & (select.POLLERR | select.POLLNVAL):
                self._drop(target)
            elif target.answer is not None:
                self._send(target)
            elif events & _EVENTS:
                self._receive(target)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_POLL):
            if len(self._connections) >= self._max:
                return  # the rest wait in the kernel's queue, costing nothing here
            try:
                sock, _address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # a connection reset before we took it, out of descriptors: next poll
            sock.setblocking(False)
            self._connections.append(_Connection(sock, time.monotonic() + self._seconds))

    def _receive(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(connection)
            return
        if not data:
            self._drop(connection)
            return
        connection.request += data
        end = connection.request.find(b"\r\n\r\n")
        if end < 0:
            if len(connection.request) > MAX_REQUEST_BYTES:
                self._drop(connection)  # not a scrape
            return
        answer = answer_for(bytes(connection.request[:end]), self._render)
        connection.request = bytearray()
        connection.answer = memoryview(answer)
        self._send(connection)

    def _send(self, connection: _Connection) -> None:
        answer = connection.answer
        assert answer is not None
        try:
            sent = connection.sock.send(answer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(connection)
            return
        connection.answer = answer[sent:]
        if not connection.answer:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_WR)
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        if connection in self._connections:
            self._connections.remove(connection)
        release_socket(connection.sock, connection.identity)

    def _forget(self, connection: _Connection) -> None:
        """The job closed this connection's number: let go of it without closing anything."""
        self._connections.remove(connection)
        release_socket(connection.sock, None)

    def _stop_listening(self) -> None:
        release_socket(self._listener, None)
        self._listener_identity = None

    def _close_all(self) -> None:
        for connection in list(self._connections):
            self._drop(connection)
        if self._listener_identity is not None:
            identity, self._listener_identity = self._listener_identity, None
            release_socket(self._listener, identity)


__all__ = ["MAX_CONNECTIONS", "MetricsServer", "Render", "answer_for"]
