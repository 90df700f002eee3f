#!/usr/bin/env bash
# The GPU check (issue 5), one command on a machine with an NVIDIA GPU, under five minutes:
#   bash benchmarks/gpu_check.sh
# 1. `memtui demo --headless` on CUDA, then the reconciliation per step:
#    tracked <= allocated <= reserved <= process GPU (NVML) <= device used <= device total.
# 2. A forced CUDA out-of-memory: the recording must say oom, with the requested size and the
#    free memory from the allocator's observer, and --snapshot-on-oom must leave a snapshot that
#    `memtui report` reads.
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
sys.exit(1 if failures else 0)
PY
status=$?
if [ -f "$work/oom.memtui.oom-snapshot.pickle" ]; then
  memtui report "$work/oom.memtui.oom-snapshot.pickle" | head -20
fi
exit $status
