"""Prometheus' HTTP API, read with the standard library (`memtui cluster`).

Bounded in time and memory whatever the other end does: every request has a deadline (the
socket's timeout covers a silent server, the deadline a server that drips bytes), and an answer
is read to at most `MAX_ANSWER_BYTES`, then refused. A dead Prometheus, a URL that is not one,
an HTTP error or an answer that is not the API's JSON is one `PrometheusError` line.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from memtui.errors import UserError

MAX_ANSWER_BYTES = 16 * 1024 * 1024
TIMEOUT_SECONDS = 5.0
_CHUNK = 64 * 1024
_API_ERROR = "error"
"""The key of the API's error text in a failed answer (a field name of Prometheus', not an
`ExitStatus`)."""


class PrometheusError(UserError):
    """Prometheus cannot be asked, or answered something unusable; `str()` is the one line."""


@dataclass(frozen=True)
class Sample:
    """One series of an instant vector: its labels (the name under `__name__`) and value."""

    labels: dict[str, str]
    value: float
    time: float


class PrometheusClient:
    """Instant queries and the target list of one Prometheus server."""

    def __init__(
        self,
        url: str,
        timeout: float = TIMEOUT_SECONDS,
        max_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise PrometheusError(f"--prometheus {url!r}: give an http:// or https:// URL")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_bytes = max_bytes

    def query(self, promql: str, at: float | None = None) -> list[Sample]:
        """An instant query whose result is a vector (`/api/v1/query`)."""
        parameters = {"query": promql}
        if at is not None:
            parameters["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", parameters)
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            raise self._malformed("a query answer that is not an instant vector")
        samples = []
        for item in _list(data.get("result"), self):
            metric = item.get("metric") if isinstance(item, dict) else None
            value = item.get("value") if isinstance(item, dict) else None
            if not isinstance(metric, dict) or not isinstance(value, list) or len(value) != 2:
                raise self._malformed("a sample without labels or value")
            try:
                stamp, number = float(value[0]), float(value[1])
            except (TypeError, ValueError):
                raise self._malformed("a sample whose value is not a number") from None
            if not math.isfinite(stamp):
                raise self._malformed("a sample without a time")
            samples.append(Sample({str(k): str(v) for k, v in metric.items()}, number, stamp))
        return samples

    def range_samples(self, promql: str) -> list[tuple[dict[str, str], list[tuple[float, float]]]]:
        """A range-vector selector's raw samples (`metric[5m]` as an instant query): each
        series' labels with its (time, value) pairs, as they were scraped."""
        data = self._get("/api/v1/query", {"query": promql})
        if not isinstance(data, dict) or data.get("resultType") != "matrix":
            raise self._malformed("a query answer that is not a range vector")
        series = []
        for item in _list(data.get("result"), self):
            if not isinstance(item, dict) or not isinstance(item.get("metric"), dict):
                raise self._malformed("a series without labels")
            try:
                values = [(float(t), float(v)) for t, v in _list(item.get("values"), self)]
            except (TypeError, ValueError):
                raise self._malformed("a sample whose value is not a number") from None
            series.append(({str(k): str(v) for k, v in item["metric"].items()}, values))
        return series

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (`/api/v1/targets`): labels, health, last error."""
        data = self._get("/api/v1/targets", {"state": "active"})
        if not isinstance(data, dict):
            raise self._malformed("a target list that is not an object")
        return [item for item in _list(data.get("activeTargets"), self) if isinstance(item, dict)]

    # ----- one request ------------------------------------------------------------------------

    def _get(self, path: str, parameters: dict[str, str]) -> Any:
        address = f"{self.url}{path}?{urllib.parse.urlencode(parameters)}"
        request = urllib.request.Request(address, headers={"Accept": "application/json"})
        deadline = time.monotonic() + self.timeout
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                body = self._read(answer, deadline)
        except urllib.error.HTTPError as exc:
            body = self._read(exc, deadline) if exc.fp is not None else b""
            raise PrometheusError(
                f"Prometheus at {self.url} answered HTTP {exc.code}{_api_error(body)}"
            ) from None
        except urllib.error.URLError as exc:
            reason = getattr(exc.reason, "strerror", None) or exc.reason
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {reason}") from None
        except TimeoutError:
            raise PrometheusError(
                f"Prometheus at {self.url} did not answer within {self.timeout:g} s"
            ) from None
        except OSError as exc:
            raise PrometheusError(
                f"cannot reach Prometheus at {self.url}: {exc.strerror or exc}"
            ) from None
        try:
            document = json.loads(body)
        except ValueError:
            raise self._malformed("an answer that is not JSON") from None
        if not isinstance(document, dict) or document.get("status") != "success":
            raise PrometheusError(f"Prometheus at {self.url} refused the query{_api_error(body)}")
        return document.get("data")

    def _read(self, answer: Any, deadline: float) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"Prometheus at {self.url} did not answer within {self.timeout:g} s"
                )
            chunk = answer.read(_CHUNK)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self.max_bytes:
                raise PrometheusError(
                    f"Prometheus at {self.url} answered more than "
                    f"{self.max_bytes // (1024 * 1024)} MiB; refusing to read it (narrow it "
                    "with --job)"
                )
            chunks.append(chunk)

    def _malformed(self, what: str) -> PrometheusError:
        return PrometheusError(
            f"{self.url} is not a Prometheus query API (it sent {what}); give the server's "
            "base URL, e.g. http://127.0.0.1:9090"
        )


def _list(value: Any, client: PrometheusClient) -> list[Any]:
    if not isinstance(value, list):
        raise client._malformed("a result that is not a list")
    return value


def _api_error(body: bytes) -> str:
    """`: <error>` from an API error answer (bounded), or nothing."""
    try:
        document = json.loads(body)
    except ValueError:
        return ""
    if isinstance(document, dict) and isinstance(document.get(_API_ERROR), str):
        return f": {document[_API_ERROR][:300]}"
    return ""
