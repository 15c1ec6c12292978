"""Device and dtype resolution, decided at run time: bf16 where the hardware runs it fast, fp32 otherwise."""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import time

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def _cpuinfo(field: str) -> str:
    """The value of /proc/cpuinfo's first `field` line; "" where there is none or the file cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(field)), "")
    except OSError:
        return ""
    return line.split(":", 1)[1].strip() if ":" in line else ""


@functools.cache
def _cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


@functools.cache
def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("GenuineIntel", "AuthenticAMD", ...); "" where it cannot be read."""
    return _cpuinfo("vendor_id")


@functools.cache  # asked on every inference matmul: the answer never changes in a process
def cpu_capability() -> str:
    """The instruction set torch dispatches its CPU kernels to: "AVX512", "AVX2", "DEFAULT", ... It is the CPU's
    best unless PyTorch's ATEN_CPU_CAPABILITY lowers it, and tlt follows it: with ATEN_CPU_CAPABILITY=avx2 tlt's own
    kernels use their AVX2 layout and `auto` picks fp32, as on a CPU without AVX-512 (docs/design.md §9)."""
    try:
        return torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # older torch
        return "DEFAULT"


def usable_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity; every CPU where the OS does not say)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def idle_cpu_cores(sample_s: float = 0.25) -> float | None:
    """Cores this process may run on (its CPU affinity, at most its cgroup's CPU quota) that other processes leave
    idle now: those CPUs' idle share over `sample_s` in /proc/stat, while this process sleeps. None where /proc/stat
    is unreadable (not Linux)."""
    cpus = usable_cpus()

    def busy_total() -> tuple[int, int]:
        busy = total = 0
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu"):
                    break  # the per-CPU lines come first
                if name == "cpu" or int(name[3:]) not in cpus:
                    continue
                ticks = [int(x) for x in fields[:8]]  # guest time is counted in user time already
                busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
                total += sum(ticks)
        return busy, total
    try:
        busy0, total0 = busy_total()
        time.sleep(sample_s)
        busy1, total1 = busy_total()
    except (OSError, ValueError, IndexError):
        return None
    idle = len(cpus) * (1 - (busy1 - busy0) / max(total1 - total0, 1))
    quota = cgroup_cpu_quota()
    return max(0.0, idle if quota is None else min(idle, quota))


def cgroup_cpu_quota() -> float | None:
    """The CPUs a container's cgroup lets this process use (cgroup v2 cpu.max, v1 cfs_quota_us); None without a
    quota."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as f:
            quota = int(f.read())
        with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 matrix instructions (avx512_bf16 or AMX) and torch may use AVX-512: bf16
    decode is ~2x fp32 there."""
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"}) and cpu_capability() == "AVX512"


def cpu_has_amx_bf16() -> bool:
    """True when the CPU has AMX with bf16 tiles (Sapphire Rapids and later Xeons) besides AVX512-BF16, and oneDNN's
    ONEDNN_MAX_CPU_ISA, where set, allows AMX: tlt's bf16 matmul kernel can then run on the tile unit (opt-in,
    TLT_BF16_AMX=1; docs/design.md §9)."""
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return {"amx_tile", "amx_bf16"} <= _cpu_flags() and cpu_has_avx512_bf16() and (not isa or "AMX" in isa
                                                                                     or isa == "ALL")


def cpu_has_avx512_bf16() -> bool:
    """True when the CPU has AVX512-BF16 (vdpbf16ps), which tlt's bf16 small-row matmul kernel needs, and torch may
    use AVX-512."""
    return "avx512_bf16" in _cpu_flags() and cpu_capability() == "AVX512"


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here: use device='cpu' or 'auto'")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def retain_freed_host_memory() -> bool:
    """Keep host memory this process frees for its own reuse instead of handing it back to the OS (glibc only;
    returns whether it applied). glibc serves a large block with its own mmap and unmaps it on free, and trims the
    heap's free top: a CPU policy update allocates and frees GBs of activations and gradients each micro-batch, so
    every one of their pages is faulted in and zeroed again by the kernel (docs/design.md §10). After this call
    large blocks come from the main heap (M_MMAP_MAX = 0) and it is never trimmed (M_TRIM_THRESHOLD = -1), so
    freed blocks are reused in place. Resident memory then stays near the largest peak so far, plus what small
    allocations splitting freed blocks add. Threads other than the main one allocate from pools of their own,
    where blocks over 64 MiB are still mapped and unmapped."""
    mallopt = _glibc("mallopt")
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return mallopt is not None and bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, -1))


THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages_mode(setting_file: str = THP_SETTING) -> str:
    """The kernel's THP mode: "always", "madvise" or "never" ("never" where the setting cannot be read)."""
    try:
        with open(setting_file) as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "never"


def huge_pages_for_host_tensors(setting_file: str = THP_SETTING) -> bool:
    """Ask PyTorch's CPU allocator to back each tensor of 2 MiB or more with transparent huge pages
    (THP_MEM_ALLOC_ENABLE: it aligns the block and madvises it). One fault then maps 2 MiB instead of 4 KiB, and
    the GEMMs miss the TLB less. PyTorch reads the variable once, at the process's first tensor allocation, so a
    process calls this before it allocates any (docs/design.md §10). A value the user set is kept. Returns whether
    huge pages apply: the variable is on and the kernel's THP mode is "always" or "madvise"."""
    if transparent_huge_pages_mode(setting_file) not in ("always", "madvise"):
        return False
    return os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1") == "1"


def trim_host_memory() -> None:
    """Hand the memory glibc's malloc holds but no allocation uses back to the OS (malloc_trim; a no-op elsewhere)."""
    if (malloc_trim := _glibc("malloc_trim")) is not None:
        malloc_trim(0)


def _glibc(name: str):
    """A function of this process's glibc, or None where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def host_tensor(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(data, device=device) without waiting for the device: on CUDA the host copy is pinned and sent
    asynchronously, where a plain host-to-device copy first waits for every kernel queued before it (a speculative
    step makes several: docs/design.md §9). The pinned block is reused only once the copy has run."""
    t = data.to(dtype) if isinstance(data, torch.Tensor) and dtype else \
        data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
