"""TensorBoard as it opens shows every pile curve of an export, exact to the byte (issue 38).

`tensorboard --logdir DIR` with no other flag loads through its Rust data server, which reads a
scalar only as a `simple_value` or a rank-0 `DT_FLOAT` tensor. The export wrote 64-bit tensors:
the data server dropped every point, the Scalars and Time Series dashboards listed no curve
(only the text tag `alerts`), and the curves showed only with `--load_fast=false`. A real job
(tests/fixtures/odd_sized_train.py) whose weights, 67,141,636 bytes, are no float32 is recorded,
exported, and read back over the HTTP routes TensorBoard 2.21's own pages call: the Time Series
dashboard's `/experiment/defaultExperiment/data/plugin/timeseries/{tags,timeSeries}` and the
Scalars dashboard's `/data/plugin/scalars/{tags,scalars}`. Every pile curve is listed, each
point is the figure of `memtui report --json` as a float32 holds it, and the exact series
(`exact/<tag>/hi_16MiB` x 16,777,216 + `exact/<tag>/lo_bytes`) equals it to the byte.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from cli_harness import run_memtui, scrubbed_env
from repo_paths import FIXTURES

from memtui_protocol.schema import PILES

pytestmark = pytest.mark.slow  # starts a torch job and a TensorBoard

JOB = FIXTURES / "odd_sized_train.py"
STEPS = 3
JOB_TIMEOUT_S = 240
READY_TIMEOUT_S = 180
"""How long TensorBoard may take to serve and load the run: generous, the machine is shared."""
QUIET_S = 15
"""With the run listed, a tag list unchanged this long is the data server's whole load."""
POLL_S = 0.5
BLOCK = 16_777_216
SERVED_AT = re.compile(r"TensorBoard \S+ at (http://[^/\s]+)/")


def as_float32(value: int) -> float:
    """What a float32 holds of `value` (the data server keeps every scalar as one)."""
    rounded: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return rounded


def without_proxies() -> dict[str, str]:
    """The suite's environment less its proxies: TensorBoard reaches its own data server over
    gRPC, which follows `http_proxy`; where that fails it serves with its Python loader, the one
    the export always worked with (measured: with an unreachable `http_proxy` every curve here
    showed, from the Python loader; only the fast-loading note missing from the log told)."""
    return {
        key: value
        for key, value in os.environ.items()
        if key.lower() not in {"http_proxy", "https_proxy", "all_proxy", "grpc_proxy"}
    }


@contextmanager
def served(logdir: Path, log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """`tensorboard --logdir DIR` as a user types it (only a free port and the loopback host
    added); its base URL. It and its data server are ended with their process group."""
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
             "--port", "0", "--host", "127.0.0.1"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=without_proxies(),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (found := SERVED_AT.search(log.read_text(errors="replace"))):
            assert server.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(POLL_S)
        yield found.group(1), server
    finally:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        except ProcessLookupError:
            pass


LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Straight to the server on 127.0.0.1, whatever proxy the suite's environment names."""


def get(url: str, data: dict[str, str] | None = None) -> Any:
    """The JSON of a GET (a form POST with `data`), as TensorBoard's pages fetch it."""
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    with LOOPBACK.open(url, data=body, timeout=60) as response:
        return json.loads(response.read())


def time_series_tags(base: str, run: str) -> set[str]:
    listing = get(f"{base}/experiment/defaultExperiment/data/plugin/timeseries/tags")
    return set(listing["scalars"]["runTagInfo"].get(run, []))


def wait_for_tags(base: str, run: str, wanted: set[str], log: Path) -> set[str]:
    """The Time Series dashboard's scalar tags of `run` once the data server has loaded it: all
    of `wanted`, or the list it kept for QUIET_S once the run is listed."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last: set[str] | None = None
    since = time.monotonic()
    while time.monotonic() < deadline:
        listed = time_series_tags(base, run)
        if wanted <= listed:
            return listed
        if listed != last:
            last, since = listed, time.monotonic()
        elif run in get(f"{base}/data/runs") and time.monotonic() - since > QUIET_S:
            return listed
        time.sleep(POLL_S)
    raise AssertionError(f"TensorBoard never loaded {run}: {log.read_text(errors='replace')}")


def time_series(base: str, run: str, tag: str) -> dict[int, float]:
    """step -> value of one scalar curve, as the Time Series dashboard fetches it."""
    request = json.dumps([{"plugin": "scalars", "tag": tag, "run": run}])
    [answer] = get(
        f"{base}/experiment/defaultExperiment/data/plugin/timeseries/timeSeries",
        {"requests": request},
    )
    assert "error" not in answer, answer
    return {point["step"]: point["value"] for point in answer["runToSeries"][run]}


def figures(document: dict[str, Any]) -> dict[str, dict[int, int]]:
    """tag -> step -> bytes, the pile figures (and RSS) `memtui report --json` states."""
    values: dict[str, dict[int, int]] = {}
    for step in document["steps"]:
        stated = {
            f"piles/{stat}/{pile}": step[stat][pile] for stat in ("end", "max") for pile in PILES
        }
        stated |= {f"piles/peak/{pile}": step["peak"]["piles"][pile] for pile in PILES}
        stated |= {"piles/peak_total": step["peak"]["total"], "host/rss": step["host"]["rss"]}
        for tag, value in stated.items():
            if value is not None:
                values.setdefault(tag, {})[step["step"]] = value
    return values


def test_every_pile_curve_shows_exactly_in_tensorboards_default_loader(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard is in the [test] extra")
    data_server = pytest.importorskip("tensorboard_data_server", reason="TensorBoard's default")
    assert Path(data_server.server_binary()).is_file()  # so TensorBoard loads with it
    job = run_memtui(
        "run", "--headless", "-o", "rec.memtui", str(JOB), str(STEPS),
        cwd=tmp_path, env=scrubbed_env(tmp_path / "rt"), timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr
    counted = [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")]
    assert len(counted) == STEPS
    reported = run_memtui("report", str(tmp_path / "rec.memtui"), "--json")
    assert reported.returncode == 0, reported.stderr
    document = json.loads(reported.stdout)
    assert [step["end"]["weights"] for step in document["steps"]] == [
        line["weights"] for line in counted
    ]  # the report is the job's own count
    expected = figures(document)
    assert len(expected["piles/end/weights"]) == STEPS
    assert as_float32(67_141_636) != 67_141_636 == counted[0]["weights"]  # no float32 holds it

    board = tmp_path / "tb"
    exported = run_memtui(
        "export", str(tmp_path / "rec.memtui"), "--format", "tensorboard", "-o", str(board)
    )
    assert exported.returncode == 0, exported.stderr
    [run] = [path.name for path in board.iterdir()]
    exact = {f"exact/{tag}/{part}" for tag in expected for part in ("hi_16MiB", "lo_bytes")}
    log = tmp_path / "tensorboard.log"
    with served(board, log) as (base, _):
        listed = wait_for_tags(base, run, set(expected) | exact, log)
        assert set(expected) <= listed, sorted(set(expected) - listed)
        assert exact <= listed, sorted(exact - listed)
        scalars_dashboard = get(f"{base}/data/plugin/scalars/tags")[run]
        assert set(expected) | exact <= set(scalars_dashboard)
        for tag, by_step in expected.items():
            curve = time_series(base, run, tag)
            assert curve == {step: as_float32(value) for step, value in by_step.items()}, tag
            hi = time_series(base, run, f"exact/{tag}/hi_16MiB")
            lo = time_series(base, run, f"exact/{tag}/lo_bytes")
            assert {step: hi[step] * BLOCK + lo[step] for step in hi} == by_step, tag
            query = urllib.parse.urlencode({"run": run, "tag": f"exact/{tag}/lo_bytes"})
            points = get(f"{base}/data/plugin/scalars/scalars?{query}")
            assert {step: value for _, step, value in points} == lo, tag
    assert "fast data loading" in log.read_text(errors="replace")  # the Rust data server
