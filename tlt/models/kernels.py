"""CPU inference fast paths, used by the decoder wherever autograd is off (rollout, scoring, drafting).

`linear` serves an inference matmul from a copy of the weight laid out for a faster kernel:
- fp32 on an AVX2 or AVX-512 CPU, up to SMALL_GEMM_MAX_ROWS rows: tlt's kernel (csrc/small_gemm.c, built with the
  system C compiler on first use and cached), the weight packed in panels of 16 (AVX2) or 64 (AVX-512) columns
  contiguous over k, so one pass streams the weight for up to 6 rows (MKL's sgemm reads it far below the memory
  bandwidth at a few rows). Sums run in another order than MKL (~1e-6 relative).
- bf16 on a CPU with AVX512-BF16, up to BF16_GEMM_MAX_ROWS rows: its bf16 twin (csrc/small_gemm_bf16.c, vdpbf16ps,
  fp32 accumulation, the output rounded once). With TLT_BF16_AMX=1 (opt-in, docs/design.md §9) the same call runs
  on AMX's tile unit for the whole process, never mixed with vdpbf16ps (their last bits differ);
  ONEDNN_MAX_CPU_ISA without AMX keeps it off; `bf16_amx(on)` sets it inside a block.
- bf16 otherwise, and fp32 past SMALL_GEMM_MAX_ROWS on AVX-512 or under backend("onednn"): a oneDNN-prepacked
  weight (bf16 bit-identical to F.linear), where this torch build and CPU can prepack the dtype.
- otherwise, and always under autograd: F.linear.
Contract: the small-row kernels' rows do not depend on the batch, bit for bit (the invariant rule's seeded equality,
§7, relies on it); a prefetch of the next panel (`prefetch_min_rows`, by CPU vendor) changes no bit. A packed copy is
keyed by the weight's identity and version counter, so an optimizer step or load_state_dict repacks it: never stale.
`backend(name)` forces one path (tests compare them); "fused" forces the fused layer below, "small_gemm" the
op-by-op layer.

`decode_layer`: a whole decoder layer for a few new tokens per row (decode, verification, drafting) in one call
(csrc/decode_layer.c), with the op-by-op path's kernels over fp32 or bf16 weights (fp32 between the matmuls).
`small_query_attention`: a few new tokens per row reading each row's own keys (csrc/cached_attention.c) in fp32;
otherwise two batched matmuls over the cache (softmax in fp32). Measured speedups: docs/design.md §9.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tlt.cache import build_atomically, cache_root
from tlt.device import cpu_capability, cpu_has_amx_bf16, cpu_has_avx512_bf16, cpu_vendor

BACKENDS = ("auto", "torch", "onednn", "small_gemm", "fused")
# measured: 2.3x MKL at 4 rows (one core), 1.1-1.3x at 128-512 rows, 0.85x at 1024 (AVX2 EPYC, two cores). Its rows
# are independent (bit for bit the same in any batch), which drafter-invariant sampling leans on: a verify forward
# (batch x verify tokens rows) then rounds as the plain decode forward does.
SMALL_GEMM_MAX_ROWS = 512
BF16_GEMM_MAX_ROWS = 512  # the bf16 kernel (AVX512-BF16), rows up to which it serves bf16 weights
_CSRC = Path(__file__).parent / "csrc"
_SRCS = [_CSRC / name for name in ("small_gemm.c", "small_gemm_bf16.c", "cached_attention.c", "cached_attention_impl.h",
                                   "decode_layer.c", "logprobs.c", "simd.h")]
# no implicit FMA contraction: the fused layer's rotary and residual sums round like torch's separate ops
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_PACKED: dict[tuple[int, str], tuple] = {}  # (id(weight), path) -> (weakref, data_ptr, version, packed)
# lib: None = not tried yet, False = unavailable; amx: whether the bf16 kernel runs on AMX tiles
# onednn: {dtype: whether this torch build and CPU can prepack it} (a CPU without bf16 support cannot prepack bf16)
_state = {"backend": "auto", "onednn": {}, "lib": None, "amx": False}


@contextlib.contextmanager
def backend(name: str):
    """Serve inference matmuls inside a block by one path: "auto" (the default, see module doc), "torch"
    (F.linear), "onednn" (prepacked, bf16/fp32), "small_gemm" (fp32, up to SMALL_GEMM_MAX_ROWS rows; layers op by
    op) or "fused" (small_gemm, and cached few-token layers in one `decode_layer` call)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown matmul backend {name!r}; valid: {', '.join(BACKENDS)}")
    before, _state["backend"] = _state["backend"], name
    try:
        yield
    finally:
        _state["backend"] = before


@contextlib.contextmanager
def fp32_layout(wide: bool):
    """Tests: run the fp32 kernels in the AVX-512 layout (wide, where the CPU has AVX-512) or the AVX2 one inside a
    block (csrc/small_gemm.c: the same bits either way). fp32 weights are packed anew inside and after it."""
    lib = small_gemm_lib()

    def repack() -> None:
        for key in [k for k in _PACKED if k[1] == "small_gemm"]:
            _PACKED.pop(key, None)
    lib.tlt_fp32_set_layout(int(wide))
    repack()
    try:
        yield
    finally:
        lib.tlt_fp32_set_layout(_isa_layout())
        repack()


@contextlib.contextmanager
def bf16_amx(on: bool):
    """Tests and benchmarks: run the bf16 kernel on AMX tiles (where the CPU has them) or on vdpbf16ps inside a
    block. The packed weights serve both; the two round differently, so a run keeps one."""
    lib = small_gemm_lib()
    before = _state["amx"]
    _state["amx"] = bool(lib.tlt_bf16_amx(int(on and cpu_has_amx_bf16())))
    try:
        yield _state["amx"]
    finally:
        _state["amx"] = bool(lib.tlt_bf16_amx(int(before)))


def amx_requested() -> bool:
    """Whether this process asks for the bf16 kernel on AMX tiles: TLT_BF16_AMX set to anything but "" or "0", on a
    CPU with AMX-BF16 that oneDNN's ISA cap allows."""
    return os.environ.get("TLT_BF16_AMX", "0") not in ("", "0") and cpu_has_amx_bf16()


def bf16_uses_amx() -> bool:
    """Whether tlt's bf16 matmul kernel runs on AMX tiles in this process (see the module doc)."""
    return small_gemm_lib() is not None and _state["amx"]


def _isa_layout() -> int:
    """The fp32 kernels' layout torch's instruction set allows: 1 = AVX-512 (the C side keeps it only where the CPU
    has AVX-512), 0 = AVX2, as with ATEN_CPU_CAPABILITY=avx2."""
    return int(cpu_capability() == "AVX512")


def prefetch_min_rows(vendor: str | None = None) -> tuple[int, int, int]:
    """From how many rows (exclusive) the small-row matmul kernels prefetch the next panel of the weight, for the
    fp32 AVX2 layout, the fp32 AVX-512 layout and the bf16 kernel: (0, 2, 0) on Intel CPUs, whose hardware prefetcher
    left the 1-3-row matmuls of a decode or verification step waiting on memory (1.07-1.34x faster with it on an
    Emerald Rapids Xeon, except the AVX-512 fp32 layout at one row, 0.88x), (3, 3, 3) elsewhere (on a Zen 4 EPYC it
    got in the hardware prefetcher's way at 1-3 rows). docs/design.md §9."""
    return (0, 2, 0) if (cpu_vendor() if vendor is None else vendor) == "GenuineIntel" else (3, 3, 3)


def _set_prefetch(lib, narrow: int, wide: int, bf16: int) -> None:
    lib.tlt_fp32_set_prefetch(narrow, wide)
    lib.tlt_bf16_set_prefetch(bf16)


@contextlib.contextmanager
def prefetch_rows(narrow: int, wide: int, bf16: int):
    """Tests: run the kernels with these prefetch thresholds inside a block (`prefetch_min_rows`; no bit of any
    output depends on them), the CPU's own after it."""
    lib = small_gemm_lib()
    _set_prefetch(lib, narrow, wide, bf16)
    try:
        yield
    finally:
        _set_prefetch(lib, *prefetch_min_rows())


def small_gemm_lib():
    """The compiled fp32 kernels (small-row matmul, cached attention), built once per source version; None where
    they cannot be built (no C compiler, no AVX2). The failure is reported once as a warning and torch serves."""
    if _state["lib"] is None:
        _state["lib"] = False
        try:
            if cpu_capability() not in ("AVX2", "AVX512"):
                raise RuntimeError(f"this CPU has no AVX2 (torch reports {cpu_capability()})")
            cc = shutil.which("cc") or shutil.which("gcc")
            if cc is None:
                raise RuntimeError("no C compiler (cc) on PATH")
            tag = hashlib.sha256(b"".join(f.read_bytes() for f in _SRCS) + " ".join(_CFLAGS).encode()).hexdigest()[:12]

            def build(tmp: Path) -> None:
                sources = [str(f) for f in _SRCS if f.suffix == ".c"]
                subprocess.run([cc, *_CFLAGS, *sources, "-o", str(tmp / "small_gemm.so")], check=True,
                               capture_output=True, text=True)
            out = build_atomically(cache_root() / "kernels" / f"small_gemm-{tag}", build,
                                   lambda d: (d / "small_gemm.so").exists())
            lib = ctypes.CDLL(str(out / "small_gemm.so"))  # after torch: binds torch's own libgomp
            vp, i32 = ctypes.c_void_p, ctypes.c_int
            lib.tlt_pack.argtypes = [vp, i32, i32, vp]
            lib.tlt_fp32_set_layout.argtypes = [i32]
            lib.tlt_small_gemm.argtypes = [vp, i32, i32, vp, i32, vp, vp, i32]
            i64 = ctypes.c_int64
            lib.tlt_cached_attention.argtypes = [vp, i64, i64, i64, vp, vp, i32, vp, vp, vp, vp, i32, i32, i32, i32,
                                                 i32, ctypes.c_float, i32]
            lib.tlt_decode_layer.argtypes = [vp, vp, *[i32] * 7, *[vp] * 4, ctypes.c_float, *[vp] * 7, vp, vp, i32,
                                             i32, vp, vp, vp, vp, vp, i32]
            lib.tlt_token_logprobs.argtypes = [vp, i32, i32, vp, vp, vp, i32]
            lib.tlt_greedy_logprobs.argtypes = [vp, i32, i32, vp, vp, i32]
            lib.tlt_pack_bf16.argtypes = [vp, i32, i32, vp]
            lib.tlt_small_gemm_bf16.argtypes = [vp, i32, i32, i64, vp, i32, vp, vp, vp, i32]
            lib.tlt_decode_layer_bf16.argtypes = lib.tlt_decode_layer.argtypes
            lib.tlt_bf16_amx.argtypes, lib.tlt_bf16_amx.restype = [i32], i32
            lib.tlt_fp32_set_prefetch.argtypes = [i32, i32]
            lib.tlt_bf16_set_prefetch.argtypes = [i32]
            lib.tlt_fp32_set_layout(_isa_layout())
            _set_prefetch(lib, *prefetch_min_rows())
            _state["amx"] = bool(lib.tlt_bf16_amx(int(amx_requested())))
            _state["lib"] = lib
        except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or e
            warnings.warn(f"tlt: fp32 small-batch matmul kernel unavailable ({str(detail).strip()[:300]}); "
                          f"torch's matmul serves instead", RuntimeWarning, stacklevel=3)
    return _state["lib"] or None


def matmul_path(x: torch.Tensor, weight: torch.Tensor) -> str:
    """Which path `linear(x, weight)` takes: "torch", "onednn", "small_gemm" or "small_gemm_bf16"."""
    if (torch.is_grad_enabled() or x.device.type != "cpu" or x.dtype != weight.dtype or weight.dim() != 2
            or weight.is_inference()):
        return "torch"
    return _path(_state["backend"], weight.dtype, x.numel() // max(x.shape[-1], 1), x.shape[-1] % 2 == 0)


def keeps_packed_copy(dtype: torch.dtype, rows: int) -> bool:
    """Whether an inference matmul of `rows` rows on this CPU (backend auto) keeps a packed copy of its weight beside
    it, as long as the weight lives (tlt plan counts these copies)."""
    return _path("auto", dtype, rows, True) != "torch"


def _path(b: str, dtype: torch.dtype, rows: int, k_even: bool) -> str:
    ours = b in ("auto", "small_gemm", "fused") and small_gemm_lib() is not None  # tlt's kernels may serve
    if ours and dtype == torch.float32 and rows <= SMALL_GEMM_MAX_ROWS:
        return "small_gemm"
    if ours and dtype == torch.bfloat16 and rows <= BF16_GEMM_MAX_ROWS and k_even and cpu_has_avx512_bf16():
        return "small_gemm_bf16"
    fp32_onednn = dtype == torch.float32 and (b == "onednn" or cpu_capability() == "AVX512")
    if b in ("auto", "onednn") and (dtype == torch.bfloat16 or fp32_onednn) and _onednn_prepacks(dtype):
        return "onednn"
    return "torch"


def _onednn_prepacks(dtype: torch.dtype) -> bool:
    if dtype not in _state["onednn"]:
        try:
            _pack(torch.ones(4, 4, dtype=dtype), "onednn")
            _state["onednn"][dtype] = True
        except (RuntimeError, AttributeError):
            _state["onednn"][dtype] = False
    return _state["onednn"][dtype]


def _pack(weight: torch.Tensor, path: str):
    w = weight.detach().contiguous()
    if path == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w, 1)
    N, K = w.shape
    if path == "small_gemm_bf16":  # [panels of 64 columns][pairs of k][64][2]
        packed = torch.empty((N + 63) // 64 * 64 * ((K + 1) // 2) * 2, dtype=torch.bfloat16)
        small_gemm_lib().tlt_pack_bf16(w.data_ptr(), N, K, packed.data_ptr())
        return packed
    P = small_gemm_lib().tlt_fp32_panel_width()  # 16 (AVX2) or 64 (AVX-512) columns a panel
    packed = torch.empty((N + P - 1) // P * P * K, dtype=torch.float32)
    small_gemm_lib().tlt_pack(w.data_ptr(), N, K, packed.data_ptr())
    return packed


def _packed(weight: torch.Tensor, path: str):
    key, ptr, version = (id(weight), path), weight.data_ptr(), weight._version
    hit = _PACKED.get(key)
    if hit is not None and hit[1] == ptr and hit[2] == version:
        return hit[3]
    packed = _pack(weight, path)
    _PACKED[key] = (weakref.ref(weight, lambda _, k=key: _PACKED.pop(k, None)), ptr, version, packed)
    return packed


def _small_gemm(x: torch.Tensor, packed: torch.Tensor, N: int, bias: torch.Tensor | None) -> torch.Tensor:
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    small_gemm_lib().tlt_small_gemm(x2.data_ptr(), x2.shape[0], K, packed.data_ptr(), N,
                                    None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y.view(*x.shape[:-1], N)


def _small_gemm_bf16(x: torch.Tensor, packed: torch.Tensor, N: int, bias: torch.Tensor | None,
                     out_fp32: bool) -> torch.Tensor:
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(x2.shape[0], N, dtype=torch.float32 if out_fp32 else torch.bfloat16)
    b = None if bias is None else bias.float().contiguous()
    y32, y16 = (y.data_ptr(), None) if out_fp32 else (None, y.data_ptr())
    small_gemm_lib().tlt_small_gemm_bf16(x2.data_ptr(), x2.shape[0], K, K, packed.data_ptr(), N,
                                         None if b is None else b.data_ptr(), y32, y16, torch.get_num_threads())
    return y.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_fp32: bool = False) -> torch.Tensor:
    """F.linear, through a packed weight and a faster kernel when autograd is off on CPU (see module doc).
    out_fp32: return fp32 (the LM head's logits); the bf16 kernel then skips rounding its fp32 sums to bf16."""
    path = matmul_path(x, weight)
    if path == "small_gemm":
        return _small_gemm(x, _packed(weight, path), weight.shape[0], bias)
    if path == "small_gemm_bf16":
        return _small_gemm_bf16(x, _packed(weight, path), weight.shape[0], bias, out_fp32)
    if path == "onednn":
        y = torch.ops.mkldnn._linear_pointwise(x, _packed(weight, path), bias, "none", [], "")
    else:
        y = F.linear(x, weight, bias)
    return y.float() if out_fp32 else y


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict keys) whose inference forward uses `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def attention_bias(mask: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, 1, T, L] bool (True = may attend) -> additive bias [B, 1, 1, T, capacity] (0 / -inf; keys from L on
    are hidden), made once per forward and shared by every layer's `small_query_attention`."""
    B, _, T, L = mask.shape
    bias = torch.full((B, 1, 1, T, capacity), float("-inf"), dtype=dtype, device=mask.device)
    bias[..., :L].masked_fill_(mask[:, :, None], 0.0)
    return bias


def small_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                          n_keys: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, nh, D], k/v [B, nkv, C, D], bias [B, 1, 1, T, C] from `attention_bias` -> [B, T, nh, D].

    Query head h reads KV head h // (nh / nkv), as in transformers' repeat_kv; the arithmetic is transformers' eager
    attention (scores scaled and masked in the model dtype, softmax in fp32). Every query must see at least one key.
    n_keys [B] (optional) says that row b's keys from n_keys[b] on are all masked: in fp32 on CPU, tlt's kernel
    (csrc/cached_attention.c) then reads each row's own keys only. The torch path runs two batched matmuls over the
    whole capacity C: pass k/v contiguous (not a slice [:L], which would cost a copy, 5x slower at B = 64).
    """
    if n_keys is not None and _attention_kernel_ok(q, k, v):
        return _cached_attention(q, k, v, bias, n_keys)
    B, T, nh, D = q.shape
    nkv, C = k.shape[1], k.shape[2]
    g = nh // nkv
    qg = q.transpose(1, 2).reshape(B, nkv, g * T, D)  # the heads of one KV group side by side
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(B, nkv, g, T, C)
    scores = scores.mul_(D ** -0.5).add_(bias)
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype).view(B, nkv, g * T, C)
    return torch.matmul(probs, v).view(B, nh, T, D).transpose(1, 2)


def _attention_kernel_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    D = q.shape[-1]
    return (_state["backend"] != "torch" and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32
            and not (torch.is_grad_enabled() and q.requires_grad) and D % 8 == 0 and D <= 256 and q.stride(-1) == 1
            and k.is_contiguous() and v.is_contiguous() and q.shape[2] % k.shape[1] == 0
            and small_gemm_lib() is not None)


def _cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                      n_keys: torch.Tensor) -> torch.Tensor:
    B, T, nh, D = q.shape
    nkv, C = k.shape[1], k.shape[2]
    bias = bias.reshape(B, T, C).contiguous()
    n_keys = n_keys.to(torch.int64).contiguous()
    out = torch.empty(B, T, nh, D, dtype=q.dtype)
    small_gemm_lib().tlt_cached_attention(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(),
                                          v.data_ptr(), C, None, n_keys.data_ptr(), bias.data_ptr(), out.data_ptr(),
                                          B, T, nh, nkv, D, D ** -0.5, torch.get_num_threads())
    return out


def _logprobs_kernel_ok(logits: torch.Tensor) -> bool:
    return (_state["backend"] != "torch" and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and not (torch.is_grad_enabled() and logits.requires_grad)
            and small_gemm_lib() is not None)


def token_logprobs(logits: torch.Tensor, temperature: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """log softmax(logits / T)[ids] per row (T <= 0: T = 1), logits [N, V] fp32 on CPU, through csrc/logprobs.c
    (one pass for the max and one for the sum, no [N, V] output); None where it does not serve (the caller then
    uses torch's log_softmax)."""
    if not _logprobs_kernel_ok(logits):
        return None
    x = logits.contiguous()
    t = temperature.to(torch.float32).contiguous()
    i = ids.to(torch.int64).contiguous()
    out = torch.empty(x.shape[0], dtype=torch.float32)
    small_gemm_lib().tlt_token_logprobs(x.data_ptr(), x.shape[0], x.shape[1], t.data_ptr(), i.data_ptr(),
                                        out.data_ptr(), torch.get_num_threads())
    return out


def greedy_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits.argmax(-1), its log-prob under the raw softmax) for logits [N, V] fp32 on CPU in one kernel call
    (csrc/logprobs.c): the max pass finds the index too, so the pair costs what `token_logprobs` alone does, and the
    log-prob is bit for bit token_logprobs' at T = 0. None where it does not serve, or when a row holds NaN (whose
    argmax is the NaN, as torch's)."""
    if not _logprobs_kernel_ok(logits):
        return None
    x = logits.contiguous()
    ids = torch.empty(x.shape[0], dtype=torch.int64)
    out = torch.empty(x.shape[0], dtype=torch.float32)
    small_gemm_lib().tlt_greedy_logprobs(x.data_ptr(), x.shape[0], x.shape[1], ids.data_ptr(), out.data_ptr(),
                                         torch.get_num_threads())
    if bool(out.isnan().any()):  # a NaN logit (the sum is NaN): leave the row's argmax to torch's rule
        return None
    return ids, out


@dataclass
class LayerWeights:
    """The tensors of one decoder layer that `decode_layer` reads (ln1 None: no input norm, the drafter's layer)."""
    ln1: torch.Tensor | None        # [H]
    ln2: torch.Tensor               # [H]
    q_norm: torch.Tensor | None     # [D] (Qwen3)
    k_norm: torch.Tensor | None     # [D]
    eps: float
    qkv: torch.Tensor               # [(nh + 2 nkv) D, H]
    qkv_bias: torch.Tensor | None   # [(nh + 2 nkv) D] (Qwen2)
    o: torch.Tensor                 # [H, nh D]
    gate_up: torch.Tensor           # [2 I, H]
    down: torch.Tensor              # [H, I]
    num_heads: int
    num_kv_heads: int


@dataclass
class LayerInputs:
    """What every fused layer of one cached forward reads alike, in the kernel's types: made once per forward."""
    cos: torch.Tensor         # [B, T, 1, D] fp32 (a bf16 model's tables hold bf16 values)
    signed_sin: torch.Tensor  # [B, T, 1, D] fp32
    cols: torch.Tensor        # [B, T] int64 cache positions of the new tokens
    n_keys: torch.Tensor      # [B] int64
    bias: torch.Tensor        # [B, 1, 1, T, cap] fp32 0 / -inf
    slots: torch.Tensor | None = None  # [B] int64 cache slot of each row; None: slot_start + b


def layer_inputs(cos: torch.Tensor, signed_sin: torch.Tensor, cols: torch.Tensor, n_keys: torch.Tensor,
                 bias: torch.Tensor, slots: torch.Tensor | None = None) -> LayerInputs:
    return LayerInputs(cos.float().contiguous(), signed_sin.float().contiguous(), cols.to(torch.int64).contiguous(),
                       n_keys.to(torch.int64).contiguous(), bias.float().contiguous(),
                       None if slots is None else slots.to(torch.int64).contiguous())


def decode_layer_ok(x: torch.Tensor, w: LayerWeights, k_cache: torch.Tensor) -> bool:
    """Whether `decode_layer` serves this layer: on CPU without autograd, fp32 on the small-row matmul path or bf16
    on the bf16 kernel's (x, weights and cache of one dtype), and shapes its kernel handles. Off under
    backend("torch" / "onednn" / "small_gemm"); "fused" forces it where it can run."""
    if _state["backend"] not in ("auto", "fused") or not x.is_contiguous() or not k_cache.is_contiguous():
        return False
    D, H = k_cache.shape[-1], x.shape[-1]
    path = "small_gemm" if k_cache.dtype == torch.float32 else "small_gemm_bf16"
    return (matmul_path(x, w.qkv) == path and k_cache.dtype == x.dtype == w.ln2.dtype and D % 8 == 0 and D <= 256
            and H % 8 == 0 and w.down.shape[1] % 2 == 0 and w.num_heads % w.num_kv_heads == 0)


def decode_layer(x: torch.Tensor, w: LayerWeights, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_start: int,
                 inp: LayerInputs) -> torch.Tensor:
    """A whole decoder layer for x [B, T, H] in one kernel call (csrc/decode_layer.c), writing this step's K/V into
    the slot cache [S, nkv, cap, D] at slot slot_start + b (inp.slots[b] where given), positions inp.cols; n_keys
    and the mask bias as for `small_query_attention`. Same arithmetic as the layer's torch ops with tlt's matmul and
    attention kernels, up to the order of rms_norm's sum and silu's exp (~1e-6 of the output's scale). In bf16 (x,
    weights and cache), fp32 between the matmuls: see csrc/decode_layer.c."""
    B, T, H = x.shape
    nh, nkv, D = w.num_heads, w.num_kv_heads, k_cache.shape[-1]
    inter = w.down.shape[1]
    M = B * T
    ptr = lambda t: None if t is None else t.data_ptr()
    # held in a local: a temporary's memory would be freed before the kernel reads it. fp32 in both dtypes.
    qkv_bias = None if w.qkv_bias is None else w.qkv_bias.float().contiguous()
    floats = M * ((nh + 2 * nkv) * D + nh * D + 2 * H + 3 * inter)
    if x.dtype == torch.float32:
        path, fn = "small_gemm", small_gemm_lib().tlt_decode_layer
    else:  # + fp32 input and output rows, norm weights, and bf16 scratch for the matmuls' rounded inputs
        path, fn = "small_gemm_bf16", small_gemm_lib().tlt_decode_layer_bf16
        floats += 2 * M * H + 2 * H + 2 * D + (M * max(H, nh * D, inter) + 1) // 2
    work = torch.empty(floats, dtype=torch.float32)
    out = torch.empty_like(x)
    fn(out.data_ptr(), x.data_ptr(), M, T, H, inter, nh, nkv, D, ptr(w.ln1), w.ln2.data_ptr(), ptr(w.q_norm),
       ptr(w.k_norm), w.eps, _packed(w.qkv, path).data_ptr(), ptr(qkv_bias), _packed(w.o, path).data_ptr(),
       _packed(w.gate_up, path).data_ptr(), _packed(w.down, path).data_ptr(), inp.cos.data_ptr(),
       inp.signed_sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2], slot_start,
       ptr(inp.slots), inp.cols.data_ptr(), inp.n_keys.data_ptr(), inp.bias.data_ptr(), work.data_ptr(),
       torch.get_num_threads())
    return out
