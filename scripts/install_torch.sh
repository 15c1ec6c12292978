#!/usr/bin/env bash
# Installs torch 2.13.0 for this machine unless one is installed already (an installed torch is left as it is):
# where nvidia-smi lists a GPU, PyPI's torch (the CUDA build on Linux x86_64); elsewhere the CPU build from PyTorch's
# CPU index, or, where that index cannot be reached (or fails), the plain requirement from pip's own index (a bare
# `torch` from PyPI is the multi-GB CUDA build). scripts/install.sh and scripts/check_install.sh run it.
# Usage: [PYTHON=python3] bash scripts/install_torch.sh [--print-command]   (--print-command: say, install nothing)
set -euo pipefail
PY=${PYTHON:-python3}
TORCH="torch==2.13.0"
CPU_INDEX="https://download.pytorch.org/whl/cpu"

has_gpu() {  # nvidia-smi present and working: a broken driver's nvidia-smi exits non-zero
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null) && [[ $gpus == *"GPU "* ]]
}

cpu_index_reachable() {  # one request, given 5 s (pip retries an index that does not answer for over a minute)
  "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5).close()' \
    "$CPU_INDEX" 2>/dev/null
}

# WHY, CMD (empty: nothing to install) and FALLBACK (what runs if CMD fails)
CMD=() FALLBACK=()
if "$PY" -c "import torch" 2>/dev/null; then
  WHY="torch is already installed: left as it is"
elif has_gpu; then
  WHY="a GPU (nvidia-smi): PyPI's $TORCH, the CUDA build on Linux x86_64"
  CMD=("$PY" -m pip install -q "$TORCH")
elif cpu_index_reachable; then
  WHY="no GPU: the CPU build of $TORCH from $CPU_INDEX"
  CMD=("$PY" -m pip install -q --index-url "$CPU_INDEX" "$TORCH")
  FALLBACK=("$PY" -m pip install -q "$TORCH")
else
  WHY="no GPU, and $CPU_INDEX cannot be reached: $TORCH from pip's own index"
  CMD=("$PY" -m pip install -q "$TORCH")
fi

if [[ ${1:-} == --print-command ]]; then
  echo "torch: $WHY"
  if (( ${#CMD[@]} )); then echo "${CMD[*]}"; fi
  if (( ${#FALLBACK[@]} )); then echo "if that fails: ${FALLBACK[*]}"; fi
  exit 0
fi
echo "tlt install: torch: $WHY"
if (( ${#CMD[@]} )) && ! "${CMD[@]}"; then
  (( ${#FALLBACK[@]} )) || exit 1
  echo "tlt install: installing from $CPU_INDEX failed; $TORCH from pip's own index instead" >&2
  "${FALLBACK[@]}"
fi
