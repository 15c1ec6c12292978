"""Peak live tensor bytes per phase of an RL step, for `tlt bench memory` (docs/design.md §16).

CUDA: torch.cuda.max_memory_allocated, reset at every phase boundary. CPU: with memory profiling on (torch.profiler's
profile_memory), PyTorch's CPU allocator reports every allocation and free, with its size and address, to the
profiler. The meter profiles from before the trainer is built, so the running sum of those sizes counts every
tensor the run allocates (weights, optimiser state, KV cache, activations, temporaries inside kernels), and it reads
the peak of each stretch between phase boundaries from the events afterwards. The sum is taken from the events
themselves, block by address, not from the allocator's own running total that they carry: under FSDP with gloo
some frees happen where they are not reported, so that total drifts above the live bytes; a block handed out again
at the address of a live one shows the earlier free, which the address bookkeeping applies.
Memory profiling follows the thread that started it (the trainer's; on CPU autograd runs its backward there too):
allocations of helper threads such as the online drafter's spot training are not seen. Tensors the allocator did
not hand out are not seen either: safetensors weights loaded in their stored dtype are file-backed (load a bf16
checkpoint into the fp32 policy, as the benchmarks here do, and the weights are allocator copies).

The process's peak resident set (VmHWM, reset per phase by writing 5 to /proc/self/clear_refs) is a second,
coarser figure: it also counts the Python heap, libraries, the profiler's own buffers and freed memory the
allocator has not returned.
"""
from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from tlt.rl.logging import PhaseTimer

BOUNDARY = "tlt_memory_boundary"


def _status_bytes(field: str) -> int | None:
    """A size field of /proc/self/status (VmHWM, VmRSS) in bytes, or None where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_peak() -> int | None:
    """This process's peak resident set since start or the last `reset_rss_peak` (VmHWM), in bytes; None off Linux."""
    return _status_bytes("VmHWM")


def rss_now() -> int | None:
    """This process's resident set now (VmRSS), in bytes; None off Linux."""
    return _status_bytes("VmRSS")


def reset_rss_peak() -> bool:
    """Reset VmHWM to the resident set now (writing 5 to /proc/self/clear_refs); False where that is refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class CudaMeter:
    """Segment peaks straight from the CUDA caching allocator's counters."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: list[int] = []

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def boundary(self) -> None:
        torch.cuda.synchronize(self.device)
        self.peaks.append(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def finish(self) -> list[int]:
        return self.peaks


class CpuMeter:
    """Segment peaks of the CPU allocator's running total, read from the profiler's allocation events."""

    def __init__(self):
        self.count = 0

    def start(self) -> None:
        from torch._C._profiler import ProfilerActivity, ProfilerConfig, ProfilerState, _ExperimentalConfig
        from torch.autograd.profiler import _enable_profiler, _prepare_profiler
        # (state, record_shapes, profile_memory, with_stack, with_flops, with_modules, experimental)
        self._config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        activities = {ProfilerActivity.CPU}
        _prepare_profiler(self._config, activities)
        _enable_profiler(self._config, activities)
        self.boundary()

    def boundary(self) -> None:
        with torch.profiler.record_function(f"{BOUNDARY}{self.count}"):
            self.count += 1

    def finish(self) -> list[int]:
        """Peak of the allocator's total in each stretch between consecutive boundaries."""
        from torch._C._profiler import _EventType
        from torch.autograd.profiler import _disable_profiler
        result = _disable_profiler()
        events: list[tuple[int, int, int]] = []   # (time, address, bytes: + allocated, - freed)
        marks: dict[int, int] = {}                 # boundary index -> time
        stack = list(result.experimental_event_tree())
        while stack:
            node = stack.pop()
            if node.tag == _EventType.Allocation:
                events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
            elif node.name.startswith(BOUNDARY):
                marks[int(node.name[len(BOUNDARY):])] = node.start_time_ns
            stack.extend(node.children)
        events.sort()
        times, allocs = [], []       # (time, live bytes after the event)
        blocks: dict[int, int] = {}  # address -> size of the live blocks
        live = 0
        for t, ptr, size in events:
            # a block handed out again at a live address was freed unseen (another thread): it is gone
            live -= blocks.pop(ptr, 0)
            if size > 0:
                blocks[ptr] = size
                live += size
            times.append(t)
            allocs.append((t, live))
        peaks = []
        for k in range(1, self.count):
            lo, hi = bisect.bisect_left(times, marks[k - 1]), bisect.bisect_left(times, marks[k])
            level = allocs[lo - 1][1] if lo > 0 else 0   # what was live when the stretch began
            peaks.append(max([level] + [total for _, total in allocs[lo:hi]]))
        return peaks


@dataclass
class PhasePeaks:
    """Measured peaks (bytes) per phase over every step, plus the overall peak of the steps."""
    tensor: dict[str, int] = field(default_factory=dict)
    rss: dict[str, int] = field(default_factory=dict)
    overall: int = 0
    overall_rss: int | None = None
    init: int = 0                         # building the trainer (model loads, copies): not planned


class PhaseMemory:
    """Opens a segment at every phase boundary; each phase's peak is the largest of the segments it spanned.
    `timer()` is a PhaseTimer that also marks the boundaries (GRPOTrainer.phase_timer)."""

    def __init__(self, device: torch.device):
        self.meter = CudaMeter(device) if device.type == "cuda" else CpuMeter()
        self.open: list[str] = []
        self.segments: list[tuple[str, ...]] = []   # the phases open during each segment
        self.rss: list[int | None] = []
        self.step_seconds: list[float] = []
        self._rss_ok = False

    def start(self) -> None:
        self.meter.start()
        self._rss_ok = reset_rss_peak()

    def _boundary(self) -> None:
        """Close the running segment (recording the phases open during it) and open the next."""
        self.segments.append(tuple(self.open))
        self.rss.append(rss_peak() if self._rss_ok else None)
        self.meter.boundary()
        self._rss_ok = reset_rss_peak()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._boundary()
        self.open.append(name)
        try:
            yield
        finally:
            self._boundary()
            self.open.remove(name)

    def timer(self) -> PhaseTimer:
        return _MemoryPhaseTimer(self)

    def finish(self) -> PhasePeaks:
        self._boundary()
        peaks = self.meter.finish()
        out = PhasePeaks()
        for k, (phases, peak, rss) in enumerate(zip(self.segments, peaks, self.rss)):
            if k == 0:      # from start() to the first phase: building the trainer
                out.init = peak
                continue
            for name in phases:
                out.tensor[name] = max(out.tensor.get(name, 0), peak)
                if rss is not None:
                    out.rss[name] = max(out.rss.get(name, 0), rss)
            if "step" in phases:
                out.overall = max(out.overall, peak)
                if rss is not None:
                    out.overall_rss = max(out.overall_rss or 0, rss)
        return out


class _MemoryPhaseTimer(PhaseTimer):
    def __init__(self, memory: PhaseMemory):
        super().__init__()
        self.memory = memory

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        with self.memory.phase(phase), super().__call__(phase):
            yield
        if phase == "step":
            self.memory.step_seconds.append(self.seconds["step"])
