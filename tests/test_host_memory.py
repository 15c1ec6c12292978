"""trainer.retain_freed_memory: memory the update frees is reused in the process, not page-faulted back each time."""
import os
import platform
import subprocess
import sys

import pytest
import torch

from tlt.device import transparent_huge_pages_mode
from tlt.rl.trainer import retains_freed_memory

# a fresh process allocates and frees a 64 MiB tensor ten times and prints the page faults of the last three (the
# first ones grow the heap: small allocations made in between take a slice of a freed block; on a 2-core Zen 4 the
# heap settled after 2-5 rounds, so counting rounds 4-6 failed about one run in three)
PROBE = """
import ctypes, resource, sys, torch
from tlt.device import retain_freed_host_memory
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: count 4 KiB pages where THP is "always"
if sys.argv[1] == "retain":
    assert retain_freed_host_memory()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)  # 64 MiB of float32, every page written
    n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del x
    return n
print(sum([faults() for _ in range(10)][7:]))
"""
PAGES = 64 * 2**20 // 4096


def _faults(probe: str, mode: str) -> int:
    """Run a probe in a fresh process (one thread, torch's allocator as it comes) and return the faults it prints."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, timeout=120,
                         env={**env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_reused_without_page_faults():
    # control: glibc maps a block this large on its own and unmaps it on free, so every page faults again
    assert _faults(PROBE, "plain") > 3 * PAGES // 2
    assert _faults(PROBE, "retain") < PAGES // 10


# a fresh process allocates a 64 MiB tensor, writes every page and prints the page faults that took
HUGE_PROBE = """
import resource, sys
from tlt.device import huge_pages_for_host_tensors
if sys.argv[1] == "huge":
    assert huge_pages_for_host_tensors()
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones(16 * 2**20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(transparent_huge_pages_mode() != "madvise",
                    reason="needs the kernel's THP in madvise mode (the control needs it off by default)")
def test_huge_pages_for_host_tensors_fault_2mib_at_a_time():
    assert _faults(HUGE_PROBE, "plain") > PAGES // 2  # control: 4 KiB pages, one fault each
    assert _faults(HUGE_PROBE, "huge") < PAGES // 10


def test_huge_pages_keep_the_users_setting_and_need_the_kernels(tmp_path, monkeypatch):
    from tlt.device import huge_pages_for_host_tensors
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    assert not huge_pages_for_host_tensors(str(setting)) and "THP_MEM_ALLOC_ENABLE" not in os.environ
    assert not huge_pages_for_host_tensors(str(tmp_path / "missing"))
    setting.write_text("always [madvise] never\n")
    assert huge_pages_for_host_tensors(str(setting)) and os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")  # the user's choice stands
    assert not huge_pages_for_host_tensors(str(setting)) and os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def test_a_trainer_process_asks_for_huge_pages_where_it_retains_freed_memory(monkeypatch, capsys):
    from tlt.config import load_config
    from tlt.rl import trainer
    from tlt.rl.trainer import DEFAULT_CONFIG
    asked = []
    monkeypatch.setattr(trainer, "huge_pages_for_host_tensors", lambda: asked.append(1) or True)
    monkeypatch.setattr(trainer, "retain_freed_host_memory", lambda: True)
    trainer.retain_freed_memory_for(load_config(str(DEFAULT_CONFIG), ["model.device=cpu"]))
    assert asked == [1] and "in transparent huge pages" in capsys.readouterr().out
    trainer.retain_freed_memory_for(load_config(str(DEFAULT_CONFIG), ["model.device=cpu",
                                                                      "trainer.retain_freed_memory=false"]))
    assert asked == [1]


def test_retained_by_default_on_cpu_only():
    assert retains_freed_memory(None, torch.device("cpu"))
    assert not retains_freed_memory(None, torch.device("cuda"))
    assert not retains_freed_memory(False, torch.device("cpu")) and retains_freed_memory(True, torch.device("cuda"))


def test_bench_trims_waiting_modes_only_when_memory_is_short(tmp_path):
    from tlt.bench.e2e import _memory_short

    def files(avail_kb: int, total_kb: int, cg_max: str | None = None, cg_current: int = 0):
        (tmp_path / "meminfo").write_text(f"MemTotal: {total_kb} kB\nMemFree: 1 kB\nMemAvailable: {avail_kb} kB\n")
        cg = tmp_path / "cg"
        cg.mkdir(exist_ok=True)
        for name in ("memory.max", "memory.current"):
            (cg / name).unlink(missing_ok=True)
        if cg_max is not None:
            (cg / "memory.max").write_text(cg_max + "\n")
            (cg / "memory.current").write_text(f"{cg_current}\n")
        return str(tmp_path / "meminfo"), str(cg)

    assert not _memory_short(*files(20, 24))
    assert _memory_short(*files(7, 24))
    assert not _memory_short(*files(20, 24, "max", 5))              # no cgroup limit
    assert _memory_short(*files(20, 24, str(10 * 2**30), 8 * 2**30))  # the cgroup's limit is the tighter one
    assert not _memory_short(str(tmp_path / "none"), str(tmp_path / "none"))  # nothing to read: do not trim
