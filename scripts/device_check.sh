#!/usr/bin/env bash
# GPU check on ONE GPU, under 8 minutes, results as JSON in ${OUT:-build/device}:
#  (a) the 2-rank functional tests (parity of the LoRA-A strategies) on the GPU, when 2 GPUs are present;
#      with one GPU they cannot pair two NCCL ranks, and the JSON says so;
#  (b) peak memory (torch.cuda.max_memory_allocated, reset per step, each variant in a fresh process) of
#      rank 0 of a TP=2 job on a Qwen3-8B-shaped stack, via a fake 2-rank process group;
#  (c) median step time of each variant (same runs as (b));
#  (e) the memory estimate of each of those runs against its max_memory_allocated (target within 5%).
# Needs Megatron Core/Bridge importable: on a machine without them, first run scripts/device_wheels.sh
# where the package index is reachable and carry .whl/ along; this script installs from it.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/device}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ! python3 -c "import megatron.core" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
layers=${LAYERS:-4}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.csv" 2>&1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node=2 -m pytest tests/functional -q \
    -p no:cacheprovider > "$out/functional.log" 2>&1
  echo "{\"functional_exit\": $?}" > "$out/functional.json"
else
  echo '{"functional_exit": null, "reason": "one GPU: two NCCL ranks cannot share it; run tests/functional on >= 2 GPUs"}' \
    > "$out/functional.json"
fi
: > "$out/peak.jsonl"
for variant in baseline regather shard_local; do
  timeout 200 python3 scripts/peak_memory.py --variant "$variant" --layers "$layers" --estimate --json \
    >> "$out/peak.jsonl" 2>> "$out/peak.err" || echo "{\"variant\": \"$variant\", \"error\": $?}" >> "$out/peak.jsonl"
done
python3 - "$out" <<'PY'
import json, sys, datetime
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/peak.jsonl") if l.startswith("{")]
base = next((r for r in rows if r.get("variant") == "baseline" and r.get("peak")), None)
for r in rows:
    if base and r.get("peak"):
        r["peak_delta_vs_baseline_bytes"] = r["peak"]["max_allocated"] - base["peak"]["max_allocated"]
        r["step_time_ratio"] = r["step_time_ms"] / base["step_time_ms"]
estimates = [r.get("estimate", {}) for r in rows if r.get("peak")]
summary = {"date": datetime.date.today().isoformat(), "functional": json.load(open(f"{out}/functional.json")), "variants": rows,
           "estimate_within_target": bool(estimates) and all(e.get("within_target") for e in estimates)}
json.dump(summary, open(f"{out}/device_check.json", "w"), indent=2)
print(json.dumps(summary, indent=2))
PY

# (d) allocator: the fragmentation workload under a 1 GiB + 48 MiB cap, once with the default
#     allocator (expected: OOM diagnosed as fragmentation) and once with expandable segments via
#     megatron_bridge_ext.init() (expected: completes, reserved stays under the cap, verify_allocator
#     finds the probe's segment expandable); each in its own process.
: > "$out/fragmentation.jsonl"
for mode in default expandable; do
  env -u PYTORCH_ALLOC_CONF -u PYTORCH_CUDA_ALLOC_CONF timeout 120 python3 scripts/fragmentation_workload.py \
    --mode "$mode" --json >> "$out/fragmentation.jsonl" 2>> "$out/fragmentation.err" \
    || echo "{\"mode\": \"$mode\", \"exit\": $?}" >> "$out/fragmentation.jsonl"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/fragmentation.jsonl") if l.startswith("{")]
done = [r for r in rows if "expected" in r]  # a run that crashed leaves only {"mode", "exit"}
summary = {"runs": rows, "as_expected": len(done) == 2 and all(r["expected"] for r in done)}
json.dump(summary, open(f"{out}/fragmentation.json", "w"), indent=2)
print(json.dumps({"fragmentation_as_expected": summary["as_expected"]}))
PY
