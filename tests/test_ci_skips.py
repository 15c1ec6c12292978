"""CI says what it skipped: .ci/run's pytest lines print every skipped test with its reason (-rs), and the bf16
exactness tests give avx512_bf16's absence as the reason where tlt's bf16 CPU paths do not run (here: torch held
below AVX-512 with ATEN_CPU_CAPABILITY=avx2, as on a CPU without it)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BF16_EXACTNESS = ["tests/test_kernels_bf16.py", "tests/test_spec.py::test_seeded_sampling_identical_with_sd_on_or_off",
                  "tests/test_kernels.py::test_a_forward_of_some_tree_nodes_is_the_full_forward_there"]


def test_ci_lists_the_reason_of_every_skip():
    runs = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
            if "-m pytest" in line and not line.lstrip().startswith("#")]
    assert len(runs) == 2, runs  # the suite, then the default run's learning test
    assert all(" -rs" in f" {line} " for line in runs), runs


def test_bf16_exactness_tests_say_they_skip_for_want_of_avx512_bf16():
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "-k", "bfloat16 or vdpbf16ps or amx", *BF16_EXACTNESS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
    assert not re.search(r"\d+ passed", r.stdout), r.stdout[-2000:]  # none of them ran as if bf16 were fast here
    assert all("avx512_bf16" in line for line in skips), skips
    for path in ("tests/test_kernels_bf16.py", "tests/test_spec.py", "tests/test_kernels.py"):
        assert any(path in line for line in skips), (path, skips)
