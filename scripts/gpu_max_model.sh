#!/usr/bin/env bash
# The largest Qwen2-shaped model that completes a GRPO step on one GPU with FSDP and CPU offload: for each size, a
# random model of Qwen2.5-{0.5B,1.5B,3B,7B}-Instruct's shape is built on the GPU machine (tlt.bench.random_model;
# nothing is downloaded or copied over), then `tlt bench memory` runs one GRPO step in a one-process torchrun world
# with actor.strategy=fsdp and actor.fsdp_offload=true, and reports the step time, the measured peak GPU memory per
# phase and the plan beside it (docs/design.md §16). A companion of scripts/gpu_bench.sh, not one of its stages:
# a 7B size alone takes minutes, so run one size per call where a call is limited to 10 minutes.
#
#   SIZES=7b bash scripts/gpu_max_model.sh [RESULTS_DIR]   # default sizes: 0.5b 1.5b 3b 7b; default dir: $OUT
#   bash scripts/gpu_max_model.sh --dry-run [RESULTS_DIR]  # the same commands on CPU with a tiny model (gloo,
#                                                          # no offload); TLT_GPU_BENCH_CPU=1 does the same
#
# Settings: the policy is held in bf16 (model.dtype=$MODEL_DTYPE, default bfloat16: 7B's fp32 weights, gradients
# and AdamW state would need ~120 GB of host memory offloaded; MODEL_DTYPE=float32 keeps fp32 master weights under
# FSDP's bf16 mixed precision, as scripts/gpu_bench.sh's fsdp stage does at 0.5B), no KL term (no reference model),
# no speculative decoding; 4 prompts x 4 responses of up to $MAX_RESPONSE tokens (default 256) on the smoke prompts.
# Per size in RESULTS_DIR/max_model: <size>.log, <size>.rc (124 = timed out; an out-of-memory error is in the log)
# and <size>.json (the benchmark's JSON line); summary.json and summary.txt list step time, peak and plan for every
# size in RESULTS_DIR (earlier calls' too) and the largest that completed. Exit status 1 when no size of this call
# completed.
set -u
cd "$(dirname "$0")/.."

CPU=${TLT_GPU_BENCH_CPU:-0}
if [ "${1:-}" = "--dry-run" ]; then CPU=1; shift; fi
RESULTS=${1:-${OUT:-results/gpu_bench}}/max_model
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tlt_max_model.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TLT_CACHE="$WORK/cache" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
MAX_RESPONSE=${MAX_RESPONSE:-256}
MODEL_DTYPE=${MODEL_DTYPE:-bfloat16}
if [ "$CPU" = 1 ]; then   # tiny scale on CPU: checks the commands and files, measures nothing about GPUs
    SIZES=${SIZES:-tiny}; DEVICE=cpu; OFFLOAD=false; T_BUILD=60; T_STEP=240; MAX_RESPONSE=8
else
    SIZES=${SIZES:-0.5b 1.5b 3b 7b}; DEVICE=cuda; OFFLOAD=true; T_BUILD=240; T_STEP=540
fi

completed=0
for size in $SIZES; do
    shape=qwen2-$size; [ "$size" = tiny ] && shape=tiny
    model=$WORK/model-$size
    echo "== $size: build $shape on $DEVICE"
    timeout --kill-after=5 "$T_BUILD" $PY -m tlt.bench.random_model --shape "$shape" --out "$model" \
        --dtype bfloat16 --device "$DEVICE" >"$RESULTS/$size.log" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then
        echo "== $size: one GRPO step, fsdp + offload=$OFFLOAD"
        timeout --kill-after=5 "$T_STEP" $PY -m torch.distributed.run --standalone --nproc_per_node 1 \
            -m tlt bench memory configs/smoke.yaml --steps 1 model.path="$model" model.device="$DEVICE" \
            model.dtype="$MODEL_DTYPE" actor.strategy=fsdp actor.fsdp_offload="$OFFLOAD" actor.use_kl_loss=false \
            speculative.enabled=false data.train_batch_size=4 rollout.n=4 actor.ppo_mini_batch_size=4 \
            data.max_response_length="$MAX_RESPONSE" reward.num_workers=0 >>"$RESULTS/$size.log" 2>&1
        rc=$?
    fi
    echo "$rc" >"$RESULTS/$size.rc"
    grep '^{' "$RESULTS/$size.log" | tail -n 1 >"$RESULTS/$size.json"
    [ "$rc" = 0 ] && [ -s "$RESULTS/$size.json" ] && completed=$((completed + 1))
    echo "   rc=$rc"
    rm -rf "$model"
done

$PY - "$RESULTS" $SIZES <<'EOF'
import json, sys
from pathlib import Path
ORDER = ["tiny", "0.5b", "1.5b", "3b", "7b"]  # by parameter count; every size with results here, this call's or not
out = Path(sys.argv[1])
sizes = sorted({p.stem for p in out.glob("*.rc")} | set(sys.argv[2:]),
               key=lambda s: ORDER.index(s) if s in ORDER else len(ORDER))
rows, largest = {}, None
lines = [f"{'size':6s} {'rc':>4s} {'step_s':>8s} {'peak_GiB':>9s} {'plan_GiB':>9s} {'ratio':>6s}"]
for size in sizes:
    rc = int((out / f"{size}.rc").read_text().strip() or -1)
    text = (out / f"{size}.json").read_text().strip()
    result = json.loads(text) if text else None
    row = {"rc": rc, "completed": rc == 0 and result is not None}
    if row["completed"]:
        rank = result["ranks"][0]
        overall = rank["phases"]["overall"]
        row.update(step_s=rank["step_s"][-1], peak_bytes=overall["measured"], plan_bytes=overall["plan"],
                   ratio=overall["ratio"], phases=rank["phases"])
        largest = size
        lines.append(f"{size:6s} {rc:4d} {row['step_s']:8.1f} {overall['measured'] / 2**30:9.2f} "
                     f"{overall['plan'] / 2**30:9.2f} {overall['ratio']:6.2f}")
    else:
        lines.append(f"{size:6s} {rc:4d}  did not complete (see {size}.log)")
    rows[size] = row
lines.append(f"largest completed: {largest}")
(out / "summary.json").write_text(json.dumps({"sizes": rows, "largest_completed": largest}, indent=1) + "\n")
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
print(json.dumps({"bench": "gpu_max_model", "largest_completed": largest, "rc": {k: v["rc"] for k, v in rows.items()}}))
EOF
[ "$completed" -gt 0 ]
