"""Prometheus' HTTP API, read with the standard library (`memtui cluster`).

Bounded in time and memory whatever the other end does: `timeout` is one overall deadline
for a round of queries (`begin_round`; `memtui cluster --once` is one round, the TUI asks one
round per poll), kept by every step of every request (`http_get`: a silent server, a server
that drips one byte at a time and a slow name lookup all end at the deadline), and an answer is
read to at most `MAX_ANSWER_BYTES`, then refused. A dead Prometheus, a URL that is not one, an
HTTP error or an answer that is not the API's JSON (nested past Python's recursion limit
included) is one `PrometheusError` line.
"""

from __future__ import annotations

import json
import math
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from memtui.errors import UserError
from memtui.input.http_get import HttpError, Target, TooLarge, get, without_credentials

MAX_ANSWER_BYTES = 16 * 1024 * 1024
TIMEOUT_SECONDS = 5.0
MAX_TIMEOUT_SECONDS = 3600.0
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
        shown = without_credentials(url)
        try:
            self.target = Target.parse(url)
        except HttpError as exc:
            raise PrometheusError(f"--prometheus {shown!r}: {exc}") from None
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= MAX_TIMEOUT_SECONDS):
            raise PrometheusError(
                f"--timeout {timeout!r}: give seconds above 0, at most {MAX_TIMEOUT_SECONDS:g}"
            )  # NaN fails the comparison too
        self.url = shown.rstrip("/")
        """The server's URL as shown: a password in it never reaches the screen or a report."""
        self.timeout = float(timeout)
        self.max_bytes = max_bytes
        self._deadline: float | None = None

    def begin_round(self) -> None:
        """Start a round of queries: all of them must be answered within `timeout` from now."""
        self._deadline = time.monotonic() + self.timeout

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
        deadline = self._deadline if self._deadline is not None else time.monotonic() + self.timeout
        try:
            answer = get(
                self.target,
                f"{path}?{urllib.parse.urlencode(parameters)}",
                deadline,
                self.max_bytes,
            )
        except TooLarge:
            raise PrometheusError(
                f"Prometheus at {self.url} answered more than "
                f"{self.max_bytes // (1024 * 1024)} MiB; refusing to read it (narrow it "
                "with --job)"
            ) from None
        except HttpError as exc:
            if exc.timeout:
                raise PrometheusError(
                    f"Prometheus at {self.url} did not answer within {self.timeout:g} s "
                    "(--timeout, for all of its queries)"
                ) from None
            raise PrometheusError(f"cannot reach Prometheus at {self.url}: {exc}") from None
        if answer.status != 200:
            raise PrometheusError(
                f"Prometheus at {self.url} answered HTTP {answer.status}{_api_error(answer.body)}"
            )
        document = _json(answer.body)
        if document is None:
            raise self._malformed("an answer that is not JSON")
        if not isinstance(document, dict) or document.get("status") != "success":
            raise PrometheusError(
                f"Prometheus at {self.url} refused the query{_api_error(answer.body)}"
            )
        return document.get("data")

    def _malformed(self, what: str) -> PrometheusError:
        return PrometheusError(
            f"{self.url} is not a Prometheus query API (it sent {what}); give the server's "
            "base URL, e.g. http://127.0.0.1:9090"
        )


def _list(value: Any, client: PrometheusClient) -> list[Any]:
    if not isinstance(value, list):
        raise client._malformed("a result that is not a list")
    return value


def _json(body: bytes) -> Any:
    """The decoded document; None when it is not JSON, or nested too deep to decode (100,000
    open brackets make the decoder recurse past Python's limit)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _api_error(body: bytes) -> str:
    """`: <error>` from an API error answer (bounded), or nothing."""
    document = _json(body)
    if isinstance(document, dict) and isinstance(document.get(_API_ERROR), str):
        return f": {document[_API_ERROR][:300]}"
    return ""
