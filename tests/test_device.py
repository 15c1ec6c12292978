"""Device and dtype resolution (tlt/device.py): tlt follows the instruction set torch dispatches to."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tlt.device import cpu_capability, cpu_has_avx512_bf16
from tlt.models import kernels

_PROBE = """
import json, torch
from tlt.device import cpu_capability, cpu_has_avx512_bf16, resolve_dtype
from tlt.models import kernels
lib = kernels.small_gemm_lib()
w = torch.randn(64, 32, dtype=torch.bfloat16)  # a model's weight: made outside inference mode
with torch.inference_mode():
    path_bf16 = kernels.matmul_path(torch.randn(2, 32, dtype=torch.bfloat16), w)
print(json.dumps({"isa": cpu_capability(), "dtype": str(resolve_dtype("auto", "cpu")),
                  "panel": lib.tlt_fp32_panel_width() if lib else None, "bf16_path": path_bf16}))
"""


def _probe(capability: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cpu_capability() != "AVX512" or not cpu_has_avx512_bf16() or kernels.small_gemm_lib() is None,
                    reason="needs an avx512_bf16 CPU and tlt's kernels: only there does lowering torch's instruction "
                           "set change what tlt runs")
def test_aten_cpu_capability_avx2_runs_tlt_as_on_an_avx2_cpu():
    """ATEN_CPU_CAPABILITY=avx2 (PyTorch's own switch) makes tlt choose what it chooses on a CPU without AVX-512:
    fp32 for dtype=auto, the fp32 kernels' AVX2 layout (panels of 16 columns), no bf16 kernel. Control: the same
    probe without the variable, on this avx512_bf16 CPU, picks bf16, panels of 64 and the bf16 kernel."""
    native = _probe(None)
    assert native == {"isa": "AVX512", "dtype": "torch.bfloat16", "panel": 64, "bf16_path": "small_gemm_bf16"}
    avx2 = _probe("avx2")
    assert avx2["isa"] == "AVX2" and avx2["dtype"] == "torch.float32" and avx2["bf16_path"] != "small_gemm_bf16"
    assert avx2["panel"] == 16


def test_idle_cpu_cores_takes_other_processes_busy_time(monkeypatch):
    """Two /proc/stat readings 100 ticks a CPU apart: cpu0 50% busy, cpu1 idle, cpu2 fully busy. Idle cores are
    counted on this process's CPUs only (affinity {0, 1}: 1.5; {0, 1, 2}: 1.5 of 3), at most a cgroup quota (1.2);
    guest time (inside user time) is not counted twice; unreadable (not Linux): None."""
    import io

    import tlt.device as device
    before = ("cpu  1 2 3 4 5 6 7 8 9 10\ncpu0 100 0 0 100 0 0 0 0 0 0\ncpu1 0 0 0 200 0 0 0 0 0 0\n"
              "cpu2 200 0 0 0 0 0 0 0 50 0\nintr 1 2 3\n")
    after = ("cpu  1 2 3 4 5 6 7 8 9 10\ncpu0 130 0 20 150 0 0 0 0 0 0\ncpu1 0 0 0 300 0 0 0 0 0 0\n"
             "cpu2 300 0 0 0 0 0 0 0 90 0\nintr 1 2 3\n")
    readings, quota = [], [None]

    def fake_open(path):
        if path == "/proc/stat":
            return io.StringIO(readings.pop(0))
        if quota[0] is None:
            raise FileNotFoundError(path)
        return io.StringIO(quota[0] if path.endswith("cpu.max") else "")
    monkeypatch.setattr(device, "open", fake_open, raising=False)
    monkeypatch.setattr(device.time, "sleep", lambda s: None)
    for cpus, idle, q in (({0, 1}, 1.5, None), ({0, 1, 2}, 1.5, None), ({0, 1}, 1.2, "120000 100000"),
                          ({0, 1}, 1.5, "max 100000")):
        readings[:], quota[0] = [before, after], q
        monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid, c=cpus: c, raising=False)
        assert device.idle_cpu_cores() == pytest.approx(idle)

    def unreadable(path):
        raise FileNotFoundError(path)
    monkeypatch.setattr(device, "open", unreadable, raising=False)
    assert device.idle_cpu_cores() is None
