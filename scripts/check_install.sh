#!/usr/bin/env bash
# A non-editable install (`pip install .`, what a wheel gives a user) into a fresh virtual environment keeps every
# fast path: the C kernels' sources ship as package data and build on first use. CI runs this after the tests.
# Usage: bash scripts/check_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=$(mktemp -d)/venv
trap 'rm -rf "$(dirname "$VENV")"' EXIT
$PY -m venv "$VENV"
PYTHON="$VENV/bin/python" bash scripts/install_torch.sh   # as scripts/install.sh: the CPU build without a GPU
"$VENV/bin/python" -m pip install -q .
cd "$(dirname "$VENV")"  # away from the checkout: import the installed package, not the source tree
TLT_CACHE="$(dirname "$VENV")/cache" "$VENV/bin/python" - <<'PY'
import shutil
from pathlib import Path

import torch

import tlt
from tlt.models import kernels

where = Path(tlt.__file__).parent
assert "site-packages" in str(where), f"imported the source tree, not the install: {where}"
missing = [f.name for f in kernels._SRCS if not f.is_file()]
assert not missing, f"kernel sources missing from the installed package: {missing}"
capable = kernels.cpu_capability() in ("AVX2", "AVX512") and (shutil.which("cc") or shutil.which("gcc"))
if capable:
    assert kernels.small_gemm_lib() is not None, "the installed package could not build its C kernels"
    with torch.no_grad():  # an ordinary (not inference-mode) weight, as a model's
        path = kernels.matmul_path(torch.ones(2, 8), torch.ones(8, 8))
    assert path == "small_gemm", f"fp32 small-row matmuls take {path}, not tlt's kernel"
print(f"check_install: tlt {tlt.__version__ if hasattr(tlt, '__version__') else ''} installed in {where}; "
      f"C kernels {'built and serving' if capable else 'not buildable on this CPU (torch serves)'}")
PY
