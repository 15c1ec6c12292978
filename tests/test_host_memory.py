"""trainer.retain_freed_memory: memory the update frees is reused in the process, not page-faulted back each time."""
import os
import platform
import subprocess
import sys

import pytest
import torch

from tlt.rl.trainer import retains_freed_memory

# a fresh process allocates and frees a 64 MiB tensor six times and prints the page faults of the last three (the
# first ones grow the heap: small allocations made in between take a slice of a freed block)
PROBE = """
import resource, sys, torch
from tlt.device import retain_freed_host_memory
if sys.argv[1] == "retain":
    assert retain_freed_host_memory()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)  # 64 MiB of float32, every page written
    n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del x
    return n
print(sum([faults() for _ in range(6)][3:]))
"""
PAGES = 64 * 2**20 // 4096


def _reallocation_faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_reused_without_page_faults():
    # control: glibc maps a block this large on its own and unmaps it on free, so every page faults again
    assert _reallocation_faults("plain") > 3 * PAGES // 2
    assert _reallocation_faults("retain") < PAGES // 10


def test_retained_by_default_on_cpu_only():
    assert retains_freed_memory(None, torch.device("cpu"))
    assert not retains_freed_memory(None, torch.device("cuda"))
    assert not retains_freed_memory(False, torch.device("cpu")) and retains_freed_memory(True, torch.device("cuda"))
