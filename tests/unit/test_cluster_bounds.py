"""`memtui cluster` against a hostile or broken server: `--timeout` is one deadline for the whole
command (a server dripping one byte at a time is cut off by it), values Prometheus holds as
NaN or infinite, rank labels that are digits only to `str.isdigit` (`²`) and JSON nested
100,000 deep are no traceback; bad `--timeout` values and malformed URLs are one line.

Each command runs on a helper thread whose join limit is only a safety net: what is asserted is
that it ended, with which line."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import redirect_stderr, redirect_stdout

import pytest

from memtui.commands.cli import main
from memtui.input.prometheus_api import PrometheusClient, PrometheusError

SAFETY_NET = 120.0


class RawServer:
    """A loopback TCP server answering every connection with `answer(connection)`."""

    def __init__(self, answer: Callable[[socket.socket], None]) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.answer = answer
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(connection,), daemon=True).start()

    def _one(self, connection: socket.socket) -> None:
        with connection:
            try:
                connection.recv(65536)
                self.answer(connection)
            except OSError:
                pass  # the client gave up: what a deadline does

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


def run_cli(argv: list[str]) -> tuple[int | None, str, str]:
    """`main(argv)` on a helper thread: (exit code or None if it never ended, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    result: list[int] = []

    def target() -> None:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                result.append(main(argv))
            except SystemExit as exc:
                result.append(int(exc.code or 0))

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(SAFETY_NET)
    return (result[0] if result else None), out.getvalue(), err.getvalue()


def drip(prefix: bytes) -> Callable[[socket.socket], None]:
    """Send `prefix`, then one byte every 0.1 s for as long as the client listens."""

    def answer(connection: socket.socket) -> None:
        connection.sendall(prefix)
        while True:
            connection.sendall(b" ")
            time.sleep(0.1)

    return answer


def json_answer(document: object, status: int = 200) -> Callable[[socket.socket], None]:
    body = json.dumps(document).encode()
    return raw_answer(body, status)


def raw_answer(body: bytes, status: int = 200) -> Callable[[socket.socket], None]:
    def answer(connection: socket.socket) -> None:
        connection.sendall(
            f"HTTP/1.0 {status} X\r\nContent-Type: application/json\r\n\r\n".encode() + body
        )

    return answer


@pytest.fixture
def servers() -> Iterator[list[RawServer]]:
    made: list[RawServer] = []
    yield made
    for server in made:
        server.close()


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err
    assert not any((ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F for c in err), err
    return err


@pytest.mark.parametrize(
    "prefix",
    [b"HTTP/1.0 200 OK\r\nX-Slow: ", b"HTTP/1.0 200 OK\r\n\r\n"],
    ids=["dripping-headers", "dripping-body"],
)
def test_a_dripping_server_is_cut_off_by_the_one_deadline(
    servers: list[RawServer], prefix: bytes
) -> None:
    """Before: 145 s against one byte every 2 s, then 'did not answer within 5 s'."""
    server = RawServer(drip(prefix))
    servers.append(server)
    code, out, err = run_cli(["cluster", "--prometheus", server.url, "--once", "--timeout", "1"])
    assert code is not None, "memtui cluster was still reading the dripping server"
    assert code == 1 and not out
    assert "did not answer within 1 s" in one_line(err)


def test_the_deadline_covers_every_query_of_a_round(servers: list[RawServer]) -> None:
    """Each query answered in time, but the round's queries together are not: one deadline."""

    def slow_answer(connection: socket.socket) -> None:
        time.sleep(0.3)
        json_answer({"status": "success", "data": {"resultType": "vector", "result": []}})(
            connection
        )

    server = RawServer(slow_answer)
    servers.append(server)
    client = PrometheusClient(server.url, timeout=1.0)
    client.begin_round()
    answered = 0
    with pytest.raises(PrometheusError, match="did not answer within 1 s"):
        for _ in range(100):  # 100 queries of 0.3 s each cannot all fit in 1 s
            client.query("memtui_step")
            answered += 1
    assert answered < 100


def series(name: str, value: str, **labels: str) -> dict[str, object]:
    metric = {"__name__": name, "job": "j", "host": "h", "rank": "0", **labels}
    return {"metric": metric, "value": [1_800_000_000.0, value]}


def prometheus_of(result: list[dict[str, object]]) -> Callable[[socket.socket], None]:
    def answer(connection: socket.socket) -> None:
        document = {"status": "success", "data": {"resultType": "vector", "result": result}}
        json_answer(document)(connection)

    return answer


@pytest.mark.parametrize(
    "value, labels",
    [
        ("NaN", {}),
        ("+Inf", {}),
        ("-Inf", {}),
        ("1e300", {}),
        ("-5", {}),
        ("3", {"rank": "²"}),
        ("3", {"rank": "٣"}),
        ("3", {"rank": "1_0"}),
        ("3", {"rank": "9" * 400}),
        ("3", {"local_rank": "²", "world_size": "NaN", "pid": "¹²"}),
    ],
)
def test_odd_values_and_labels_are_no_traceback(
    servers: list[RawServer], value: str, labels: dict[str, str]
) -> None:
    names = [
        "memtui_step",
        "memtui_pile_bytes",
        "memtui_device_bytes",
        "memtui_host_rss_bytes",
        "memtui_alerts_total",
        "memtui_step_end_timestamp_seconds",
        "memtui_step_duration_seconds",
        "memtui_agent_info",
    ]
    result = [
        series(name, value, stat="peak", pile="weights", kind="allocated", **labels)
        for name in names
    ]
    server = RawServer(prometheus_of(result))
    servers.append(server)
    for shown in ("--once", "--json"):
        code, out, err = run_cli(["cluster", "--prometheus", server.url, shown, "--timeout", "30"])
        assert code is not None
        assert "Traceback" not in err
        if code == 0:
            assert out and not err
            if shown == "--json":
                json.loads(out)  # strict JSON: no NaN token
        else:
            one_line(err)


def test_json_nested_past_the_recursion_limit_is_one_line(servers: list[RawServer]) -> None:
    server = RawServer(raw_answer(b"[" * 100_000 + b"]" * 100_000))
    servers.append(server)
    code, out, err = run_cli(["cluster", "--prometheus", server.url, "--once", "--timeout", "30"])
    assert code == 1 and not out
    assert "is not a Prometheus query API" in one_line(err)
    server = RawServer(raw_answer(b'{"error": ' + b"[" * 100_000, status=400))
    servers.append(server)
    code, out, err = run_cli(["cluster", "--prometheus", server.url, "--once", "--timeout", "30"])
    assert code == 1 and "answered HTTP 400" in one_line(err)


@pytest.mark.parametrize("timeout", ["nan", "inf", "-inf", "-1", "0", "1e309", "", "x", "4000"])
def test_a_bad_timeout_is_one_line(timeout: str) -> None:
    code, out, err = run_cli(
        ["cluster", "--prometheus", "http://127.0.0.1:9", "--once", "--timeout", timeout]
    )
    assert code == 2 and not out
    assert "--timeout" in one_line(err)


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), -1.0, 0.0])
def test_the_client_refuses_a_timeout_that_is_no_duration(timeout: float) -> None:
    with pytest.raises(PrometheusError, match="--timeout"):
        PrometheusClient("http://127.0.0.1:9", timeout=timeout)


@pytest.mark.parametrize(
    "url",
    [
        "http://[::1",
        "http://host:port",
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "http://\x1b[31m",
        "http://a b",
        "http://" + "a" * 300,
        "http://127.0.0.1:1\udcff",
        "http://\u202eevil",
        "http://127.0.0.1:9?x=1",
        "ftp://127.0.0.1",
        "",
        "http://" + "a." * 2000,
    ],
)
def test_a_malformed_url_is_one_line(url: str) -> None:
    code, out, err = run_cli(["cluster", "--prometheus", url, "--once", "--timeout", "5"])
    assert code == 1 and not out
    assert "Prometheus" in one_line(err) or "--prometheus" in err


def test_credentials_in_the_url_are_sent_as_basic_auth_and_never_shown() -> None:
    """A Prometheus behind basic auth (`https://user:secret@host:9090`): the password goes in
    the Authorization header, and no message shows it."""
    heads: list[bytes] = []

    def refuse(connection: socket.socket) -> None:
        connection.sendall(b"HTTP/1.0 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")

    server = RawServer(refuse)

    def keep_head(connection: socket.socket) -> None:
        with connection:
            heads.append(connection.recv(65536))
            refuse(connection)

    server._one = keep_head  # type: ignore[method-assign]
    try:
        url = server.url.replace("http://", "http://us%40er:s3cr%3At@")
        code, out, err = run_cli(["cluster", "--prometheus", url, "--once", "--timeout", "30"])
    finally:
        server.close()
    assert code == 1 and not out
    line = one_line(err)
    assert "401" in line and "s3cr" not in line and "us%40er" not in line
    assert heads
    assert b"Authorization: Basic dXNAZXI6czNjcjp0\r\n" in heads[0]  # base64 of us@er:s3cr:t
