"""The Prometheus metrics a rank serves (`--metrics-port`): one spelling for the agent's exporter,
`memtui cluster`'s queries and the Grafana dashboard's test.

Names follow Prometheus' conventions: a `memtui_` prefix, the unit as a suffix (`_bytes`,
`_seconds`), `_total` on counters, `_info` on the constant-1 series that carries identity.
Every series carries `LABELS`; the other labels take values from small fixed sets (piles, stats,
device kinds, alert kinds) or are bounded by the exporter (`holder`: at most `MAX_LEAK_HOLDERS`
series of at most `MAX_HOLDER_CHARS` characters), so a job never grows the server's series count.

Standard library only: the viewer imports this module too.
"""

from __future__ import annotations

from memtui_protocol.schema import PILES

PILE_BYTES = "memtui_pile_bytes"
"""Gauge, `{pile, stat}`: each tracked pile at the step's close (`end`), its high during the step
(`max`) and at the moment the tracked total peaked (`peak`), as in `memtui report --json`."""
PEAK_BYTES = "memtui_peak_bytes"
"""Gauge: the latest step's peak as every memtui view states it: the piles at the peak plus DDP's
gradient buckets and FSDP's gathered parameters, which no pile counts (`memtui_protocol.peak`);
absent when a pile at the peak is not known."""
WRAPPER_BYTES = "memtui_wrapper_bytes"
"""Gauge, `{kind}` (`WRAPPER_KINDS`): what data-parallel wrappers hold outside the piles at the
close, as `Step.distributed` states it; only the kinds the job has (none without DDP/FSDP)."""
WRAPPER_KINDS = ("ddp_buckets", "ddp_in_gradients", "fsdp_gathered", "fsdp_gathered_max")
"""`memtui_wrapper_bytes{kind}`: the `schema.Distributed` fields of those names."""
STEP = "memtui_step"
"""Gauge: the number of the latest closed step."""
STEP_DURATION = "memtui_step_duration_seconds"
"""Gauge: how long the latest step took (its open to its close)."""
STEP_END_TIME = "memtui_step_end_timestamp_seconds"
"""Gauge: when the latest step closed (Unix time): a rank whose endpoint answers but whose
steps stopped (a hang in a collective) shows here."""
DEVICE_BYTES = "memtui_device_bytes"
"""Gauge, `{kind}`: the allocator's and NVML's figures at the close; only the kinds the job
has (a CPU job has none: an unknown is never served as 0)."""
HOST_RSS = "memtui_host_rss_bytes"
"""Gauge: the process's resident set size at the close (every job, CPU and GPU)."""
WORKERS_BYTES = "memtui_dataloader_workers_bytes"
"""Gauge, `{kind}` (`uss`, `pss`, `growth`): the job's DataLoader worker processes as last
sampled before the close (their private memory, its growth since they started); only on a job
with workers. Never part of `memtui_pile_bytes` or `memtui_host_rss_bytes`."""
ALERTS = "memtui_alerts"
"""Counter, `{kind}`: alerts raised so far (served as `memtui_alerts_total`)."""
ALERTS_TOTAL = ALERTS + "_total"
LEAK_BYTES = "memtui_leak_bytes"
"""Gauge, `{holder}`: bytes each leaking holder keeps, as the latest census found them."""
ACTIVATIONS_MEASURED = "memtui_activations_measured"
"""Gauge: 1 when the latest step's activations were measured, 0 when carried or not known."""
AGENT_INFO = "memtui_agent"
"""Info, `{pid, version, device}`: served as `memtui_agent_info 1`; the pid lets `memtui
cluster` name the live view of a rank on this host."""
AGENT_INFO_SERIES = AGENT_INFO + "_info"

SERVED = (
    PILE_BYTES,
    PEAK_BYTES,
    WRAPPER_BYTES,
    STEP,
    STEP_DURATION,
    STEP_END_TIME,
    DEVICE_BYTES,
    HOST_RSS,
    WORKERS_BYTES,
    ALERTS_TOTAL,
    LEAK_BYTES,
    ACTIVATIONS_MEASURED,
    AGENT_INFO_SERIES,
)
"""Every series name a rank's `/metrics` can hold (what a dashboard may query)."""

LABELS = ("job", "host", "rank", "local_rank", "world_size")
"""On every series, and on the `file_sd` target too (so Prometheus' own `up` carries them)."""
STATS = ("end", "max", "peak")
PILE_NAMES = PILES
DEVICE_KINDS = ("allocated", "reserved", "process", "device_used", "device_total")
"""`memtui_device_bytes{kind}`, from `Allocator.allocated`, `reserved`, `process_gpu`,
`device_used`, `device_total`."""
OTHER_ALERT_KIND = "other"
"""A kind this version does not know (a newer agent's) is counted under this one."""
MAX_LEAK_HOLDERS = 10
MAX_HOLDER_CHARS = 80

TARGETS_FOLDER = "prometheus"
"""The `file_sd` folder inside a session folder: `prometheus/HOST-rankN.json` per rank."""


def target_file_name(host: str, rank: int) -> str:
    """`HOST-rankN.json`, the host made safe for a file name."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in host)[:64] or "host"
    return f"{safe}-rank{rank}.json"


def short_holder(holder: str) -> str:
    """A leak holder as a label value: at most `MAX_HOLDER_CHARS` characters, the start kept
    (`model.encoder.cache...`) since a holder is a path from a name the user wrote."""
    if len(holder) <= MAX_HOLDER_CHARS:
        return holder
    return holder[: MAX_HOLDER_CHARS - 3] + "..."
