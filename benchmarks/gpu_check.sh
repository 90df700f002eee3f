#!/usr/bin/env bash
# The GPU check (issue 5), one command on a machine with an NVIDIA GPU, under five minutes:
#   bash benchmarks/gpu_check.sh
# 1. `memtui demo --headless` on CUDA, then the reconciliation per step:
#    tracked <= allocated <= reserved <= process GPU (NVML) <= device used <= device total.
# 2. A forced CUDA out-of-memory: the recording must say oom, with the requested size and the
#    free memory from the allocator's observer, and --snapshot-on-oom must leave a snapshot that
#    `memtui report` reads.
# 3. --alloc-events: every step of a demo run carries its largest allocations with a source line
#    outside torch, the OOM run's final frame carries the OOM event, and the cost against the
#    default is printed (median step time of steps 6+, two interleaved runs each, as a ratio).
# Prints the figures and PASS/FAIL per check; exits non-zero if any check fails.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/memtui ]; then
  python3 -m venv .venv && .venv/bin/pip install -q -e . || exit 2
fi
export PATH="$PWD/.venv/bin:$PATH"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python - <<'PY' || exit 2
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device (install a CUDA build of torch)")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
PY
memtui demo --headless -o "$work/demo.memtui" --device cuda --steps 20 --quiet || exit 1
cat > "$work/oom.py" <<'PY'
import torch
model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.AdamW(model.parameters())
for step in range(3):
    opt.zero_grad()
    model(torch.randn(64, 1024, device="cuda")).sum().backward()
    opt.step()
    if step == 1:
        free, total = torch.cuda.mem_get_info()
        torch.empty(total * 2, dtype=torch.uint8, device="cuda")  # cannot fit
PY
memtui run --headless --snapshot-on-oom -o "$work/oom.memtui" "$work/oom.py"
memtui run --headless --snapshot-on-oom --alloc-events -o "$work/oom-events.memtui" "$work/oom.py"
# Default vs --alloc-events on the same demo job, interleaved so drift hits both alike.
size=(--device cuda --steps 40 --dim 512 --layers 6 --batch 16 --seq 256 --quiet)
for round in 1 2; do
  memtui run --headless -o "$work/base-$round.memtui" -m memtui_agent.demo.tiny_lm "${size[@]}" \
    || exit 1
  memtui run --headless --alloc-events -o "$work/events-$round.memtui" \
    -m memtui_agent.demo.tiny_lm "${size[@]}" || exit 1
done
for name in oom-events base-1 base-2 events-1 events-2; do
  memtui report "$work/$name.memtui" --json > "$work/$name.json" || exit 1
done
memtui report "$work/demo.memtui" --json > "$work/demo.json" || exit 1
memtui report "$work/oom.memtui" --json > "$work/oom.json" || exit 1
python - "$work" <<'PY'
import json, sys, pathlib
work = pathlib.Path(sys.argv[1])
failures = 0
def check(name, ok, detail=""):
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}")
demo = json.load(open(work / "demo.json"))
gib = 2**30
for step in demo["steps"][-3:]:
    a = step["allocator"]
    tracked = sum(step["end"].values())
    chain = [("tracked", tracked), ("allocated", a["allocated"]), ("reserved", a["reserved"]),
             ("process", a["process_gpu"]), ("device used", a["device_used"]),
             ("device total", a["device_total"])]
    shown = "  ".join(f"{k} {v / gib:.3f}GiB" if v is not None else f"{k} n/a" for k, v in chain)
    values = [v for _, v in chain]
    ok = None not in values and all(x <= y for x, y in zip(values, values[1:]))
    check(f"reconciliation step {step['step']}", ok, shown)
oom = json.load(open(work / "oom.json"))
ending = oom["exit"]
check("oom recorded", ending["status"] == "error" and ending.get("oom") is True, str(ending))
check("oom requested size", bool(ending.get("requested")), str(ending.get("requested")))
alerts = [a for a in oom["alerts"] if a["kind"] == "oom"]
check("oom alert names free memory", bool(alerts) and "free on the device" in alerts[0]["message"],
      alerts[0]["message"] if alerts else "no oom alert")
snapshot = work / "oom.memtui.oom-snapshot.pickle"
check("snapshot on oom written", snapshot.exists(), str(snapshot))

# --alloc-events: what it records, and what it costs.
import statistics
load = lambda name: json.load(open(work / f"{name}.json"))
runs = {kind: [load(f"{kind}-{r}") for r in (1, 2)] for kind in ("base", "events")}
recorded = [s.get("alloc_events") for rep in runs["events"] for s in rep["steps"]]
check("alloc events in every step", bool(recorded) and all(recorded),
      f"{sum(bool(r) for r in recorded)} of {len(recorded)} steps")
if recorded and recorded[-1]:
    last = recorded[-1]
    top = last["largest"][0] if last["largest"] else {"where": "", "size": 0}
    check("largest allocation has a source line outside torch",
          bool(top["where"]) and "/torch/" not in top["where"],
          f"{top['size'] / 2**20:.1f} MiB at {top['where']!r}; "
          f"{last['allocations']} allocations, lost {last['lost']}, overflowed {last['overflowed']}")
errors = [e for rep in runs["events"] for e in rep["agent_errors"] if e["component"] == "alloc-events"]
check("alloc events never turned off", not errors, str(errors))
ending = load("oom-events")["exit"]
events_oom = (ending.get("alloc_events") or {}).get("oom")
check("oom event with its source line", bool(events_oom) and "oom.py" in events_oom["where"],
      str(events_oom))
check("snapshot on oom still written with --alloc-events",
      (work / "oom-events.memtui.oom-snapshot.pickle").exists())
def step_ms(kind):
    return 1000 * statistics.median(
        s["duration_s"] for rep in runs[kind] for s in rep["steps"][5:])
base_ms, events_ms = step_ms("base"), step_ms("events")
print(f"COST  --alloc-events {events_ms:.2f} ms/step vs default {base_ms:.2f} ms/step: "
      f"ratio {events_ms / base_ms:.3f} (+{events_ms - base_ms:.2f} ms/step; median of "
      "steps 6+, two interleaved runs each)")
sys.exit(1 if failures else 0)
PY
status=$?
if [ -f "$work/oom.memtui.oom-snapshot.pickle" ]; then
  memtui report "$work/oom.memtui.oom-snapshot.pickle" | head -20
fi
exit $status
